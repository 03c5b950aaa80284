"""LFM2's short convolution, the mixer of its "conv" layers: in_proj to (B, C, x), a causal depthwise conv of
width K (3) over B * x, gated by C, out_proj. Its whole state per sequence is the conv's last K-1 inputs (`conv`,
[hidden, K-1]); it keeps no SSM state (the slot's second tensor is empty), over the same slots and commit as the
other recurrent mixers (deltanet.py)."""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.model.config import ModelConfig
from pagedllm.model.layers.causal_conv import causal_conv, gather_states
from pagedllm.model.layers.deltanet import RecurrentStep
from pagedllm.model.layers.linear import Linear
from pagedllm.model.layers.mamba2 import Conv


class ShortConv(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        hidden = self.hidden = cfg.hidden_size
        self.kernel = cfg.linear_conv_kernel_dim
        self.in_proj = Linear(3 * hidden, hidden, cfg.mixer_proj_bias, dtype, device)
        self.conv = Conv(hidden, self.kernel, cfg.mixer_conv_bias, dtype, device)
        self.out_proj = Linear(hidden, hidden, cfg.mixer_proj_bias, dtype, device)

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """One slot's conv state, and no SSM state."""
        return (self.hidden, self.kernel - 1), (0,)

    def slots(self) -> dict[str, nn.Module]:
        return {"conv_in": self.in_proj, "conv_conv": self.conv, "conv_out": self.out_proj}

    def linears(self) -> list[Linear]:
        return [self.in_proj, self.out_proj]

    def forward(
        self, x: torch.Tensor, conv_cache: torch.Tensor, rec_cache: torch.Tensor, step: RecurrentStep
    ) -> torch.Tensor:
        """x [T, hidden] of the step's sequences (flat, in `step`'s order) -> [T, hidden]; the new conv states go
        to `step.pending`."""
        b, c, h = self.in_proj(x).chunk(3, -1)
        conv, rec = gather_states(step, conv_cache, rec_cache)
        convs: list[torch.Tensor] = []
        y = causal_conv(b * h, conv, step.lens, self.conv.weight, self.conv.bias, step, convs)
        step.pending.append((conv_cache, rec_cache, conv, rec))
        step.add_marked(conv_cache, rec_cache, convs, [rec[0]] * len(convs))  # (the SSM state is empty)
        return self.out_proj(c * y)
