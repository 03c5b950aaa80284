"""The LoRA term of a matmul over a step that mixes adapters: y = W x + s B (A x), each row with its own adapter.

vLLM's punica kernels (bgmv for decode, sgmv for prefill segments) gather each token's adapter from stacked A / B
tensors. Here the step's adapters' A are stacked into one matrix and their B into another (the scale folded into
B at load): the rows that have an adapter are multiplied by all the A at once, the columns of other adapters
masked to zero, then by all the B, and added back into the base output: two matmuls per targeted layer however
many adapters the step holds, instead of a loop over them (extra FLOPs: rank x adapters, small beside W).
Base rows (no adapter) are never touched, so they stay bit for bit what the base model computes; the base weight
is multiplied as stored (dense, packed or quantized): the adapter never needs a merged copy of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

LoRAKey = tuple[int, str]  # (decoder layer, slot: qkv / o / gate_up / down)


@dataclass
class LoRAWeight:
    """One adapter's matrices for one matmul: a [R, in] and b [out, R] with the scale folded in (q/k/v or gate/up
    pieces stacked along R, each piece's B in its own rows, zero elsewhere)."""

    a: torch.Tensor
    b: torch.Tensor
    # (out start, out end, R start, R end) of each piece: B is zero outside these blocks (the fused step reads them)
    pieces: list[tuple[int, int, int, int]] = field(default_factory=list)


@dataclass
class LoRAStack:
    """The step's adapters' matrices for one matmul, stacked along R (vLLM's stacked A / B) and laid out for
    x @ at @ bt: at [in, sum R], bt [sum R, out], float32 (a bfloat16 matmul of these thin shapes takes CPUs a slow
    path, and the term is small beside the base matmul); `mask` [rows, sum R]: 1 where the column belongs to the
    row's adapter (None: one adapter, every column is every row's)."""

    at: torch.Tensor
    bt: torch.Tensor
    mask: torch.Tensor | None


@dataclass
class LoRABatch:
    """The step being run: the rows of the flat batch that have an adapter, and per matmul the stacked adapters.
    The runner fills it before a forward and empties it after; every targeted Linear reads the one object."""

    rows: torch.Tensor | None = None
    stacks: dict[LoRAKey, LoRAStack] = field(default_factory=dict)
    all_rows: bool = False  # every row has an adapter: no gather, and a plain add (index_add_ is slow on bfloat16)


@dataclass
class LoRAHook:
    """A Linear's link to the step's adapters: `key` names its matmul in every adapter's weights."""

    batch: LoRABatch
    key: LoRAKey

    def add(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """y[rows] += B (A x[rows]), each row through its own adapter's columns only: two matmuls over all the
        step's adapters at once, whatever their number (rows of no adapter are left as they are)."""
        s, rows = self.batch.stacks.get(self.key), self.batch.rows
        if s is None or rows is None:
            return
        every = self.batch.all_rows
        h = (x if every else x.index_select(0, rows)).float() @ s.at
        if s.mask is not None:
            h = h * s.mask
        delta = (h @ s.bt).to(y.dtype)
        if every:
            y.add_(delta)
        else:
            y.index_add_(0, rows, delta)
