"""Linear layers whose weight format is chosen once at load: a small "linear method" per layer (as vLLM's).

A checkpoint's matmul weight ends up in one of three forms: dense (a torch parameter, any device), packed (the
same weights in oneDNN's layout, on CPU: onednn_linear.py) or quantized (GGUF blocks or round-to-nearest codes run
by the C kernels: quant.py). The loader picks the form once per layer; every call site is then `layer(x)`,
and the fused C step reads the quantized tiles from the same objects.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.model.kernels.onednn_linear import pack
from pagedllm.model.kernels.quant_linear import QuantWeight, qlinear, qrows
from pagedllm.model.layers.lora import LoRAHook


def empty_param(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    """An uninitialised, frozen parameter: weights always come from a checkpoint, so random init is wasted time."""
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


def free(param: torch.Tensor) -> None:
    """Drop a parameter's storage once another form of the weight serves it (two copies would come out of the
    KV cache's share of memory)."""
    param.data = torch.empty(0, dtype=param.dtype, device=param.device)


class LinearMethod:
    """How one weight [out, in] is multiplied: `apply(x, bias)` = x @ W.T + bias."""

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        """Bytes this form holds outside the module's parameters (0 for the dense form, which is a parameter)."""
        return 0


class DenseMethod(LinearMethod):
    """The parameter itself through `F.linear` (GPU, or CPU where oneDNN has no kernel for the dtype)."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, self.weight, bias)


class PackedMethod(LinearMethod):
    """The weight reordered once into oneDNN's blocked layout (see onednn_linear.py for why)."""

    def __init__(self, packed: torch.Tensor) -> None:
        self.packed = packed

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")

    @property
    def nbytes(self) -> int:
        return self.packed.numel() * self.packed.element_size()


class QuantMethod(LinearMethod):
    """A quantized weight (Q4_0 / Q4_1 / Q8_0 as stored, or int8 / int4 rounded at load) on the C kernels."""

    def __init__(self, weight: QuantWeight) -> None:
        self.weight = weight

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return qlinear(x, self.weight, bias)

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes


class Linear(nn.Module):
    """y = x @ W.T (+ b), W served by `method`; `tied_to` shares another layer's parameter (a tied LM head)."""

    def __init__(
        self,
        out_features: int,
        in_features: int,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device | str,
        tied_to: nn.Parameter | None = None,
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = out_features, in_features
        self.weight = (
            tied_to if tied_to is not None else empty_param(out_features, in_features, dtype=dtype, device=device)
        )
        self.bias = empty_param(out_features, dtype=dtype, device=device) if bias else None
        self.tied = tied_to is not None
        self.keep_dense = False  # a router: rounding it at load (--quantization int8|int4) would move tokens
        self.method: LinearMethod = DenseMethod(self.weight)
        self.lora: LoRAHook | None = None  # set on the matmuls adapters may target when LoRA is enabled

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.method.apply(x, self.bias)
        if self.lora is not None:
            self.lora.add(x, y)
        return y

    @property
    def quant(self) -> QuantWeight | None:
        """The quantized weight when this layer runs quantized, else None."""
        return self.method.weight if isinstance(self.method, QuantMethod) else None

    def set_quantized(self, weight: QuantWeight) -> None:
        self.method = QuantMethod(weight)
        if not self.tied:
            free(self.weight)

    def pack_for_cpu(self) -> None:
        """Dense -> oneDNN-packed where oneDNN can (a tied head packs a copy: the embedding keeps its table)."""
        if not isinstance(self.method, DenseMethod) or self.weight.numel() == 0:
            return
        packed = pack(self.weight)
        if packed is not None:
            self.method = PackedMethod(packed)
            if not self.tied:
                free(self.weight)


class Embedding(nn.Module):
    """Token embeddings: a dense table, or a quantized one read one row per token."""

    def __init__(self, vocab: int, hidden: int, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.weight = empty_param(vocab, hidden, dtype=dtype, device=device)
        self.dtype = dtype
        self.quant: QuantWeight | None = None

    def set_quantized(self, weight: QuantWeight) -> None:
        self.quant = weight
        free(self.weight)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.quant is None:
            return F.embedding(ids, self.weight)
        return qrows(self.quant, ids).to(self.dtype)
