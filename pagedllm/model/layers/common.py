"""The small shared layers of every decoder family: RMSNorm (plain or Gemma's (1 + w)), the MLP (gated, or
Nemotron-H's ungated relu2), gpt-oss's attention sinks.

Numerics deliberately follow Hugging Face transformers (norm in float32 then cast, Gemma's weight applied in
float32 before the cast) so that float32 results agree to ~1e-5 and bfloat16 ones mostly pick the same top
token. Nothing here is CPU-specific: tensors live on whatever device the weights do.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.model.layers.linear import Linear, empty_param

ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "relu2")


class RMSNorm(nn.Module):
    """y = w * (x / rms(x)) as Llama computes it; with `offset` 1, y = (1 + w) * (x / rms(x)) in float32 (Gemma)."""

    def __init__(
        self, size: int, eps: float, dtype: torch.dtype, device: torch.device | str, offset: float = 0.0
    ) -> None:
        super().__init__()
        self.weight = empty_param(size, dtype=dtype, device=device)
        self.eps = eps
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (h * (self.offset + self.weight.float())).to(dtype)
        return self.weight * h.to(dtype)


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) in float32, cast back: an RMSNorm without a weight (Gemma 4's norm of V)."""
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def activation(name: str, x: torch.Tensor) -> torch.Tensor:
    """The gate's activation: SiLU (SwiGLU) or tanh-approximated GELU (Gemma's GeGLU); relu(x)^2 (an ungated
    MLP's: Nemotron-H)."""
    if name == "relu2":
        return torch.square(F.relu(x))
    return F.silu(x) if name == "silu" else F.gelu(x, approximate="tanh")


def gated(name: str, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """act(gate) * up: SwiGLU / GeGLU."""
    return activation(name, gate) * up


Glu = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (gate, up) -> the down projection's input


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up merged into one matmul (one weight read, one kernel call);
    `glu` replaces act(gate) * up (an expert's clamped SwiGLU, moe.py), `bias` adds both matmuls' biases.
    `has_gate=False`: down(act(up(x))), `gate_up` holding the up rows alone (Nemotron-H's relu2 MLP): the same slots,
    so the loader, LoRA and the fused step treat both alike."""

    def __init__(
        self,
        hidden: int,
        inter: int,
        act: str,
        dtype: torch.dtype,
        device: torch.device | str,
        bias: bool = False,
        glu: Glu | None = None,
        has_gate: bool = True,
    ) -> None:
        super().__init__()
        self.inter = inter
        self.act = act
        self.has_gate = has_gate
        self.glu: Glu = glu or (lambda g, u: gated(act, g, u))
        self.gate_up = Linear((2 if has_gate else 1) * inter, hidden, bias, dtype, device)
        self.down = Linear(hidden, inter, bias, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.has_gate:
            return self.down(activation(self.act, self.gate_up(x)))
        g, u = self.gate_up(x).split(self.inter, dim=-1)
        return self.down(self.glu(g, u))


class Learned(nn.Module):
    """A learned vector that the checkpoint names itself, no `.weight` suffix (Gemma 4's `layer_scalar` on each
    layer's output, its router's `scale` and `per_expert_scale`)."""

    bare = True

    def __init__(self, size: int, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.weight = empty_param(size, dtype=dtype, device=device)


class AttentionSinks(nn.Module):
    """gpt-oss's learned logit per query head (`self_attn.sinks`), which every attention path reads through the
    layer's AttentionSpec. Kept in float32 whatever the model's dtype: the softmaxes add it in float32, and the C
    kernel reads it as it lies. `bare`: the checkpoint names the parameter itself (no `.weight` suffix)."""

    bare = True

    def __init__(self, heads: int, device: torch.device | str) -> None:
        super().__init__()
        self.weight = empty_param(heads, dtype=torch.float32, device=device)
