"""A mixture-of-experts layer's routed experts on CPU, run from their quantized tiles by csrc/moe.c.

Why a kernel of its own: a decode step should read only the routed experts' bytes (8 of 128 for Qwen3-30B-A3B),
straight from their tiles, and with many rows in a step each routed expert's weights once for all of its rows.
The torch form (a loop over experts, index_select, index_add) costs a dozen ops per active expert per layer,
more than the expert's matmuls at one row. The router stays in torch (it differs by family; moe.c takes the
routed ids and weights); the kernel does the three matmuls, the activation and the weighted sum. A token's
result does not depend on the other tokens of the step, bit for bit (the dense kernels' rows do not, and each
token sums its experts in its own choice order).

Layout: per expert, gate_up is one weight [2 * ffn, hidden] with the gate's rows first and then the up rows (a
checkpoint that interleaves them, as gpt-oss's does, is reordered when it is packed; ungated relu2 experts, as
Nemotron-H's: the up rows alone) and down [hidden, ffn].
`stack` packs a 3-D tensor's experts into one buffer whose per-expert weights are views of it.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

import numpy as np
import torch

import pagedllm.model.kernels.cpu_kernel as cpu_kernel
from pagedllm.model.kernels.quant_linear import FORMATS, QuantParts, QuantWeight, _tiles, bf16_kernel, col_bytes

# moe.h's activation kinds, by the names the families give them
ACTIVATIONS = {"silu": 0, "gelu_pytorch_tanh": 1, "swigluoai": 2, "relu2": 3}  # relu2: ungated experts
ERRORS = {-1: "out of memory", -2: "bad sizes", -5: "an expert id out of range, or an active expert without weights"}


@dataclass
class MoeExperts:
    """One layer's experts in the kernel's form; `load` counts the rows routed to each expert over every call
    (tokens per expert: what the engine shows as the expert load)."""

    gate_up: list[QuantWeight]  # per expert [2 ffn, hidden]: gate rows, then up rows (relu2, ungated: [ffn, hidden])
    down: list[QuantWeight]  # per expert [hidden, ffn]
    act: str = "silu"
    alpha: float = 1.702  # swigluoai's sigmoid scale (gpt-oss's swiglu_alpha)
    limit: float = 7.0  # swigluoai's clamp (swiglu_limit)
    gate_up_bias: torch.Tensor | None = None  # [experts, gate_up's rows]
    down_bias: torch.Tensor | None = None  # [experts, hidden]
    load: torch.Tensor | None = None  # int64 [experts], added to (a row of the model's counters); None: zeros
    _layer: ctypes.Structure = field(init=False, repr=False)
    _keep: list[object] = field(init=False, repr=False)  # what the structure's pointers point into

    def __post_init__(self) -> None:
        e, hidden, ffn = len(self.gate_up), self.down[0].n if self.down else 0, self.down[0].k if self.down else 0
        if not e or len(self.down) != e:
            raise ValueError(f"{e} gate_up weights and {len(self.down)} down weights: one of each per expert")
        if self.act not in ACTIVATIONS:
            raise ValueError(f"activation {self.act!r}: the kernel has {', '.join(ACTIVATIONS)}")
        rows = ffn if self.act == "relu2" else 2 * ffn
        for name, ws, shape in (("gate_up", self.gate_up, (rows, hidden)), ("down", self.down, (hidden, ffn))):
            if {(w.n, w.k) for w in ws} != {shape} or len({w.fmt for w in ws}) != 1:
                raise ValueError(f"experts' {name} weights differ in shape or format (want {shape}, one format)")
        if self.load is None:
            self.load = torch.zeros(e, dtype=torch.int64)
        if self.load.shape != (e,) or self.load.dtype != torch.int64 or not self.load.is_contiguous():
            raise ValueError(f"load must be a contiguous int64 tensor of {e} counters")
        biases = []
        for name, b, shape in (
            ("gate_up_bias", self.gate_up_bias, (e, rows)),
            ("down_bias", self.down_bias, (e, hidden)),
        ):
            if b is not None and tuple(b.shape) != shape:
                raise ValueError(f"{name} has shape {tuple(b.shape)}, expected {shape}")
            biases.append(None if b is None else b.detach().float().contiguous())
        ptrs = [(ctypes.c_void_p * e)(*[w.tiles.data_ptr() for w in ws]) for ws in (self.gate_up, self.down)]
        self._keep = [*ptrs, *biases]
        self._layer = cpu_kernel.c_structs("moe.h")["MoeLayer"](
            ctypes.addressof(ptrs[0]),
            ctypes.addressof(ptrs[1]),
            *[None if b is None else b.data_ptr() for b in biases],
            e,
            hidden,
            ffn,
            FORMATS[self.gate_up[0].fmt],
            FORMATS[self.down[0].fmt],
            ACTIVATIONS[self.act],
            0,
            self.alpha,
            self.limit,
        )

    @property
    def layer(self) -> ctypes.Structure:
        """The MoeLayer structure (moe.h) the kernel runs; the fused C step points its sparse layers at it."""
        return self._layer

    def sync_routes(self, bf16: bool) -> None:
        """The routes the experts' weights take (set by the loader after packing): the dot route
        (QuantWeight.dot), the int8 route for an expert's matmul of at least `i8_min_rows` rows (0: never;
        the weights of a format the route does not run have 0), and with bfloat16 activations (`bf16`, where
        the CPU has vdpbf16ps) the bfloat16 route for steps of at least the weights' `amx_min_rows` rows, the
        threshold kernel_choice.py measured for the dense matmuls (a step's rows take one route in every layer)."""
        self._layer.dot = int(self.gate_up[0].dot)
        self._layer.i8_min_rows = max(self.gate_up[0].i8_min_rows, self.down[0].i8_min_rows)
        on = bf16 and bf16_kernel() is not None
        self._layer.bf16_min_rows = self.gate_up[0].amx_min_rows if on else 0

    @property
    def hidden(self) -> int:
        return self.down[0].n

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for w in self.gate_up) + sum(w.nbytes for w in self.down)

    def forward(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t]) for each row t of x [T, hidden], in x's dtype;
        added into `out` (float32 [T, hidden], contiguous) instead when given. The dot route (activations rounded
        to 16 bits per group of 32) when the experts' weights take it (QuantWeight.dot, set by the loader), the
        int8 route (8 bits) for an expert's matmul of at least their `i8_min_rows` rows, the bfloat16 route for a
        bfloat16 x of at least their `amx_min_rows` rows."""
        lib = cpu_kernel.load()
        if lib is None:
            raise RuntimeError("the MoE kernel is not built on this machine")
        t = x.shape[0]
        if x.dim() != 2 or x.shape[1] != self.hidden or topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != t:
            raise ValueError(f"x {tuple(x.shape)}, ids {tuple(topk_ids.shape)}, weights {tuple(topk_weights.shape)}")
        y = out if out is not None else torch.zeros(t, self.hidden, dtype=torch.float32)
        if out is not None and (out.dtype != torch.float32 or out.shape != (t, self.hidden) or not out.is_contiguous()):
            raise ValueError("out must be float32 [T, hidden] and contiguous")
        if t == 0:
            return y if out is not None else y.to(x.dtype)
        xf = x.float().contiguous()
        ids, w = topk_ids.to(torch.int64).contiguous(), topk_weights.float().contiguous()
        self.sync_routes(x.dtype == torch.bfloat16)
        assert self.load is not None  # __post_init__ made it
        rc = lib.moe_experts(
            y.data_ptr(),
            xf.data_ptr(),
            ids.data_ptr(),
            w.data_ptr(),
            t,
            ids.shape[1],
            ctypes.byref(self._layer),
            self.load.data_ptr(),
            torch.get_num_threads(),
        )
        if rc != 0:
            raise (ValueError if rc == -5 else RuntimeError)(f"moe_experts failed: {ERRORS.get(rc, rc)}")
        return y if out is not None else y.to(x.dtype)


def stack(parts: list[QuantParts]) -> list[QuantWeight]:
    """Experts of one shape and format packed side by side into one buffer (a 3-D tensor's experts): one
    allocation, each expert's weight a view of its rows of it."""
    n, k = parts[0].shape
    if {p.shape for p in parts} != {(n, k)} or len({p.fmt for p in parts}) != 1:
        raise ValueError("experts to stack differ in shape or format")
    nb = -(-n // 16)
    out = np.empty((len(parts) * nb, col_bytes(parts[0].fmt, k)), dtype=np.uint8)
    for i, p in enumerate(parts):
        _tiles(p, out[i * nb : (i + 1) * nb])
    tiles = torch.from_numpy(out)
    return [QuantWeight(p.fmt, n, k, tiles[i * nb : (i + 1) * nb], p.source) for i, p in enumerate(parts)]
