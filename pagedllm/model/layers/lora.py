"""The LoRA term of a matmul over a step that mixes adapters: y = W x + s B (A x), each row with its own adapter.

vLLM's punica kernels (bgmv for decode, sgmv for prefill segments) gather each token's adapter from stacked A / B
tensors. On a CPU the same result comes from a grouped loop: for each adapter present in the step, its rows are
gathered, multiplied by its A then its B (the scale folded into B at load), and added back into the base output.
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


@dataclass
class LoRABatch:
    """The step being run: for each adapter present, its rows of the flat batch and its weights by key. The
    runner fills `groups` before a forward and empties it after; every targeted Linear reads the one object."""

    groups: list[tuple[torch.Tensor, dict[LoRAKey, LoRAWeight]]] = field(default_factory=list)


@dataclass
class LoRAHook:
    """A Linear's link to the step's adapters: `key` names its matmul in every adapter's weights."""

    batch: LoRABatch
    key: LoRAKey

    def add(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """y[rows] += B (A x[rows]) for each adapter's rows (in place; rows of no adapter are left as they are)."""
        for rows, weights in self.batch.groups:
            w = weights.get(self.key)
            if w is None:
                continue
            xs = x.index_select(0, rows).to(w.a.dtype)
            y.index_add_(0, rows, (xs @ w.a.T @ w.b.T).to(y.dtype))
