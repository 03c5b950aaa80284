"""Mamba2, the state-space mixer of Granite 4.0-H's (granitemoehybrid) and Nemotron-H's hybrid layers, over the
same explicit state slots as Gated DeltaNet (deltanet.py: the runner owns one row of each state per slot, a step's
new states wait in `RecurrentStep.pending` until the whole forward ran).

Per sequence a Mamba2 layer keeps the last K-1 inputs of its causal depthwise convolution (`conv`, [C, K-1], the
model's dtype) and the SSM state (`rec`, [H, P, N] float32: heads x head dim x state size). With dt_t =
softplus(dt_raw + dt_bias) (clamped to `time_step_limit`), a_t = dt_t * A (A = -exp(A_log), one per head):
h_t = exp(a_t) h_{t-1} + dt_t x_t B_t^T, y_t = h_t C_t + D x_t, B and C shared by the heads of a group. The output
is RMS-normed per group after gating by SiLU(z) (transformers' RMSNormGated, norm_before_gate=False).

Two ways to advance the state, both from an initial state and returning the final one:
- a prompt chunk: the SSD form (Mamba2 paper; transformers' torch_chunk_scan): per CHUNK tokens the intra-chunk
  part is a masked C B^T "attention" times the decayed inputs, each chunk's own contribution to the state one
  einsum for all chunks at once, then a scan over the chunks (not the tokens) carries the state;
- decode tokens: one recurrent update of every decoding sequence's state at once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.model.config import ModelConfig
from pagedllm.model.layers.causal_conv import causal_conv, gather_states, seq_starts
from pagedllm.model.layers.deltanet import Bare, Param, RecurrentStep
from pagedllm.model.layers.linear import Linear, empty_param

CHUNK = 64  # tokens per chunk of the SSD scan (the result does not depend on it; checkpoints say 256 for GPUs)


class Conv(nn.Module):
    """The depthwise conv's weight [C, K] (checkpoints: [C, 1, K]; llama.cpp's files: [C, K]) and, where the
    checkpoint has one, its bias [C]."""

    def __init__(self, channels: int, kernel: int, bias: bool, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.weight = empty_param(channels, kernel, dtype=dtype, device=device)
        self.bias = empty_param(channels, dtype=dtype, device=device) if bias else None


def chunk_scan(
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    state: torch.Tensor,
    marks: list[int] | None = None,
    at_marks: list[torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's tokens through the SSM in chunks of CHUNK, float32. x [L, H, P] (already times dt), a [L, H]
    (dt * A, the log decay of each step), b, c [L, H, N] (the group's, repeated to its heads), state [H, P, N].
    Returns (y [L, H, P] without the D skip, the final state); the states after `marks` tokens (ascending,
    0 < t < L: prefix-cache checkpoints inside the chunk) are appended to `at_marks`: a chunk's start state
    decayed to t plus its first t inputs' own part."""
    L, H = x.shape[0], x.shape[1]
    pad = (CHUNK - L % CHUNK) % CHUNK  # padded steps: a = 0 (no decay), x = 0 (nothing added)
    n = (L + pad) // CHUNK
    # head-major [H * n, l, .], contiguous: every product below is one bmm over (head, chunk)
    x, b, c = (F.pad(t, (0, 0, 0, 0, 0, pad)).transpose(0, 1).reshape(H * n, CHUNK, -1).contiguous() for t in (x, b, c))
    cum = F.pad(a, (0, 0, 0, pad)).T.reshape(H * n, CHUNK).cumsum(-1)  # log decay from the chunk's start to l
    upper = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=x.device).triu(1)
    decay = (cum[:, :, None] - cum[:, None, :]).masked_fill_(upper, float("-inf")).exp_()  # [H * n, l, s]
    y = torch.bmm(torch.bmm(c, b.transpose(1, 2)).mul_(decay), x).view(H, n, CHUNK, -1)  # the intra-chunk part
    own = torch.bmm((x * (cum[:, -1:] - cum).exp()[..., None]).transpose(1, 2), b).view(H, n, x.shape[-1], -1)
    c = c.view(H, n, CHUNK, -1).transpose(0, 1).contiguous()  # [n, H, l, N]: each chunk's rows in one piece
    own = own.transpose(0, 1).contiguous()
    chunk_decay = cum[:, -1].exp().view(H, n).T[..., None, None]  # [n, H, 1, 1]
    from_state = torch.empty(n, H, CHUNK, y.shape[-1], dtype=y.dtype, device=y.device)
    pending = list(marks or [])
    xv, bv, cumv = x.view(H, n, CHUNK, -1), b.view(H, n, CHUNK, -1), cum.view(H, n, CHUNK)
    for i in range(n):  # each chunk's output from its start state, then the next chunk's start state
        torch.bmm(c[i], state.transpose(1, 2), out=from_state[i])
        while pending and pending[0] <= (i + 1) * CHUNK:
            t = pending.pop(0) - i * CHUNK
            last = cumv[:, i, t - 1 : t]  # [H, 1]
            part = torch.bmm((xv[:, i, :t] * (last - cumv[:, i, :t]).exp()[..., None]).transpose(1, 2), bv[:, i, :t])
            assert at_marks is not None
            at_marks.append(state * last.exp()[..., None] + part)
        state = state * chunk_decay[i] + own[i]
    y += from_state.transpose(0, 1) * cum.exp().view(H, n, CHUNK, 1)
    return y.reshape(H, n * CHUNK, -1)[:, :L].transpose(0, 1), state


def recurrent_step(
    x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, state: torch.Tensor
) -> torch.Tensor:
    """One token of each of S sequences, float32: x [S, H, P] (not times dt), dt and a [S, H], b, c [S, H, N];
    `state` [S, H, P, N] is updated in place. Returns y [S, H, P] without the D skip."""
    state.mul_(a.exp()[..., None, None]).add_((dt[..., None] * x)[..., None] * b[:, :, None])
    return (state * c[:, :, None]).sum(-1)


class Mamba2(nn.Module):
    """The mixer: in_proj to (z, xBC, dt), causal conv (+ bias, SiLU) over xBC, the SSM, the gated grouped RMS
    norm, out_proj."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.heads, self.head_dim = cfg.mamba_num_heads, cfg.mamba_head_dim
        self.state_size, self.groups = cfg.mamba_state_size, cfg.mamba_num_groups
        self.inner = self.heads * self.head_dim
        self.conv_dim = self.inner + 2 * self.groups * self.state_size
        self.kernel = cfg.linear_conv_kernel_dim
        self.eps = cfg.rms_norm_eps
        self.dt_min, self.dt_max = cfg.mamba_dt_limit
        hidden = cfg.hidden_size
        self.in_proj = Linear(self.inner + self.conv_dim + self.heads, hidden, cfg.mixer_proj_bias, dtype, device)
        self.conv = Conv(self.conv_dim, self.kernel, cfg.mixer_conv_bias, dtype, device)
        self.a_log = Bare(self.heads, dtype=dtype, device=device)
        self.dt_bias = Bare(self.heads, dtype=dtype, device=device)
        self.d = Bare(self.heads, dtype=dtype, device=device)
        self.norm = Param(self.inner, dtype=dtype, device=device)
        self.out_proj = Linear(hidden, self.inner, cfg.mixer_proj_bias, dtype, device)

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """One slot's conv state and SSM state."""
        return (self.conv_dim, self.kernel - 1), (self.heads, self.head_dim, self.state_size)

    def slots(self) -> dict[str, nn.Module]:
        return {
            "ssm_in": self.in_proj,
            "ssm_conv": self.conv,
            "ssm_a_log": self.a_log,
            "ssm_dt_bias": self.dt_bias,
            "ssm_d": self.d,
            "ssm_norm": self.norm,
            "ssm_out": self.out_proj,
        }

    def linears(self) -> list[Linear]:
        return [self.in_proj, self.out_proj]

    def _by_head(self, t: torch.Tensor) -> torch.Tensor:
        """B or C [n, G * N] -> [n, H, N] float32, each group's to its heads."""
        t = t.float().view(t.shape[0], self.groups, self.state_size)
        return t.repeat_interleave(self.heads // self.groups, 1)

    def forward(
        self, x: torch.Tensor, conv_cache: torch.Tensor, rec_cache: torch.Tensor, step: RecurrentStep
    ) -> torch.Tensor:
        """x [T, hidden] of the step's sequences (flat, in `step`'s order) -> [T, hidden]; the new states go to
        `step.pending`."""
        T = x.shape[0]
        z, xbc, dt = self.in_proj(x).split([self.inner, self.conv_dim, self.heads], -1)
        conv, rec = gather_states(step, conv_cache, rec_cache)
        convs: list[torch.Tensor] = []
        recs: list[torch.Tensor] = []
        xbc = F.silu(causal_conv(xbc, conv, step.lens, self.conv.weight, self.conv.bias, step, convs))
        xs, b, c = xbc.split([self.inner, self.groups * self.state_size, self.groups * self.state_size], -1)
        xs = xs.float().view(T, self.heads, self.head_dim)
        b, c = self._by_head(b), self._by_head(c)
        dt = F.softplus(dt.float() + self.dt_bias.weight.float()).clamp(self.dt_min, self.dt_max)
        a = dt * -self.a_log.weight.float().exp()
        y = torch.empty(T, self.heads, self.head_dim, dtype=torch.float32, device=x.device)
        starts = seq_starts(step.lens)
        decode = [i for i, n in enumerate(step.lens) if n == 1]
        if len(decode) == len(step.lens):  # decode only: the step's state copies updated in place
            y = recurrent_step(xs, dt, a, b, c, rec)
        elif decode:
            seqs = torch.tensor(decode, dtype=torch.long, device=x.device)
            rows = torch.tensor([starts[i] for i in decode], dtype=torch.long, device=x.device)
            state = rec[seqs]
            y[rows] = recurrent_step(xs[rows], dt[rows], a[rows], b[rows], c[rows], state)
            rec[seqs] = state
        for i, n in enumerate(step.lens):
            if n == 1:
                continue
            s, e = starts[i], starts[i + 1]
            y[s:e], rec[i] = chunk_scan(
                xs[s:e] * dt[s:e, :, None], a[s:e], b[s:e], c[s:e], rec[i], step.marks_of(i), recs
            )
        y = y + xs * self.d.weight.float()[:, None]
        step.pending.append((conv_cache, rec_cache, conv, rec))
        step.add_marked(conv_cache, rec_cache, convs, recs)
        return self.out_proj(self._gated_norm(y.view(T, self.inner), z).to(x.dtype))

    def _gated_norm(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """y * SiLU(z), RMS-normed over each group's channels, times the weight (float32)."""
        h = y * F.silu(z.float())
        g = h.view(h.shape[0], self.groups, -1)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.norm.weight.float() * g.view_as(h)
