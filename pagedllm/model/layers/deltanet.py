"""Gated DeltaNet, the linear-attention mixer of Qwen3.5 / Qwen3-Next's hybrid layers, over explicit state tensors.

Where a full-attention layer keeps every past token's K/V, a Gated DeltaNet layer keeps a fixed-size state per
sequence: the last K-1 inputs of its causal depthwise convolution (`conv`, [C, K-1]) and the recurrent matrix of the
gated delta rule (`rec`, [Hv, Dk, Dv], float32), S_t = exp(g_t) S_{t-1} (I - beta_t k_t k_t^T) + beta_t k_t v_t^T,
read out as o_t = S_t^T q_t. The runner owns one row of each per state slot (kv/state_slots.py hands a slot to each
running request); a step reads its sequences' rows and, only once every layer ran (`RecurrentStep.commit`), writes
them back, so a step that fails leaves every state as it was and the retry continues from the same one.

Two ways to advance a state, both from an initial state and returning the final one:
- a prompt chunk: the chunked form of the rule (transformers' torch_chunk_gated_delta_rule, FLA's chunk kernel):
  per 64-token chunk the intra-chunk part is a few matmuls, the chunks are scanned in order. The unit lower
  triangular system of each chunk, (I + A) X = B, is solved as X = (I - A)(I + A^2)(I + A^4)...(I + A^32) B: A is
  strictly lower triangular (A^64 = 0), so the series is exact, and it is six squarings and six products of
  64 x 64 matrices for every chunk and head at once: batched matmuls only, no 64-step loop (measured about as fast
  as torch's triangular solve on a Zen 5 CPU: docs/benchmarks.md);
- decode tokens: one recurrent update of every decoding sequence's state at once, in place.
A sequence that starts at position 0 starts from zeros (a new request, or one preempted and recomputed).

A prompt chunk may also ask for its state at token offsets inside it (`RecurrentStep.marks`: the block boundaries
of a prompt whose states are kept as prefix-cache checkpoints, --mamba-cache-mode all): the scan has the state at
its 64-token chunk ends only, so the state after t tokens of a chunk is that chunk's start state decayed to t plus
the first t corrected values' own part, one small product per mark, written at commit like the final state.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.model.config import ModelConfig
from pagedllm.model.layers.linear import Linear, empty_param

CHUNK = 64  # tokens per chunk of the chunked scan (FLA's and transformers' choice)


class Bare(nn.Module):
    """A parameter the checkpoint names itself, no `.weight` suffix (A_log, dt_bias); the loader reads `bare`."""

    bare = True

    def __init__(self, *shape: int, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.weight = empty_param(*shape, dtype=dtype, device=device)


class Param(nn.Module):
    """A parameter under `<name>.weight` that is no Linear (the depthwise conv's [C, 1, K], the gated norm's)."""

    def __init__(self, *shape: int, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.weight = empty_param(*shape, dtype=dtype, device=device)


@dataclass
class RecurrentStep:
    """A step's view of the recurrent states: each sequence's slot, token count, whether it starts from zeros;
    the new states each layer computed wait in `pending` until `commit` (after the whole forward ran)."""

    slots: torch.Tensor  # [S] long: each sequence's state slot
    lens: list[int]  # new tokens of each sequence, in flat-batch order
    fresh: list[bool]  # starts at position 0: from a zero state
    caches: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # model layer -> its states
    pending: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=list)
    # Per sequence, offsets 0 < t < its length after which its state is also wanted (prefix-cache checkpoints),
    # ascending; `mark_rows` the state rows they go to, in sequence then offset order; `marked` each layer's
    marks: list[list[int]] = field(default_factory=list)
    mark_rows: torch.Tensor | None = None
    marked: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=list)

    def marks_of(self, seq: int) -> list[int]:
        return self.marks[seq] if self.marks else []

    def commit(self) -> None:
        """Write every layer's new states into their slots, and the states at the marks into their rows (once
        per step, after every layer succeeded)."""
        for conv, rec, conv_new, rec_new in self.pending:
            conv.index_copy_(0, self.slots, conv_new.to(conv.dtype))
            rec.index_copy_(0, self.slots, rec_new)
        for conv, rec, conv_new, rec_new in self.marked:
            assert self.mark_rows is not None
            conv.index_copy_(0, self.mark_rows, conv_new.to(conv.dtype))
            rec.index_copy_(0, self.mark_rows, rec_new)
        self.pending.clear()
        self.marked.clear()

    def add_marked(
        self, conv_cache: torch.Tensor, rec_cache: torch.Tensor, convs: list[torch.Tensor], recs: list[torch.Tensor]
    ) -> None:
        """A layer's states at the marks (in order), to write at commit."""
        if convs:
            self.marked.append((conv_cache, rec_cache, torch.stack(convs), torch.stack(recs)))


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """FLA's (and transformers') L2 normalisation of each query / key vector."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    marks: list[int] | None = None,
    at_marks: list[torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's tokens through the rule in chunks of CHUNK. q, k: [L, H, Dk] (normalised, q scaled), v: [L, H,
    Dv], g (log decay), beta: [L, H], all float32; state: [H, Dk, Dv] float32. Returns (out [L, H, Dv], new state);
    the states after `marks` tokens (ascending, 0 < t < L) are appended to `at_marks`."""
    L = q.shape[0]
    pad = (CHUNK - L % CHUNK) % CHUNK
    q, k, v = (F.pad(x.transpose(0, 1), (0, 0, 0, pad)) for x in (q, k, v))  # [H, L', D]
    g, beta = (F.pad(x.transpose(0, 1), (0, pad)) for x in (g, beta))  # [H, L']
    H, n = q.shape[0], q.shape[1] // CHUNK
    v_beta, k_beta = v * beta[..., None], k * beta[..., None]
    q, k, k_beta, v_beta = (x.reshape(H, n, CHUNK, x.shape[-1]) for x in (q, k, k_beta, v_beta))
    cum = g.reshape(H, n, CHUNK).cumsum(-1)  # log of the decay from the chunk's start
    upper = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).triu(1)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()  # [H, n, C, C]
    # (I + A)^-1 by a unit lower-triangular solve, as transformers' (a product-of-powers inverse lost every digit
    # in float32 on slowly decaying, correlated keys: its intermediate powers grow before they cancel)
    system = (k_beta @ k.transpose(-1, -2) * decay).tril(-1)
    values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)  # corrected values
    k_cumdecay = torch.linalg.solve_triangular(system, k_beta * cum.exp()[..., None], upper=False, unitriangular=True)
    intra = (q @ k.transpose(-1, -2)) * decay
    q = q * cum.exp()[..., None]
    k_raw, k = k, k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]  # [H, n, 1, 1]
    out = torch.empty_like(values)
    pending = list(marks or [])
    for i in range(n):
        v_new = values[:, i] - k_cumdecay[:, i] @ state
        out[:, i] = q[:, i] @ state + intra[:, i] @ v_new
        while pending and pending[0] <= (i + 1) * CHUNK:  # a mark inside this chunk: its state after t tokens
            t = pending.pop(0) - i * CHUNK
            last = cum[:, i, t - 1 : t]  # [H, 1]
            own = (k_raw[:, i, :t] * (last - cum[:, i, :t]).exp()[..., None]).transpose(-1, -2) @ v_new[:, :t]
            assert at_marks is not None
            at_marks.append(state * last.exp()[..., None] + own)
        state = state * chunk_decay[:, i] + k[:, i].transpose(-1, -2) @ v_new
    return out.reshape(H, n * CHUNK, -1)[:, :L].transpose(0, 1), state


def recurrent_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> torch.Tensor:
    """One token of each of S sequences: q, k [S, H, Dk], v [S, H, Dv], g, beta [S, H] float32; `state` [S, H, Dk,
    Dv] float32 is updated in place. Returns out [S, H, Dv]."""
    state.mul_(g.exp()[..., None, None])
    remembered = (state * k[..., None]).sum(-2)  # what the state predicts for k: [S, H, Dv]
    delta = (v - remembered) * beta[..., None]
    state.add_(k[..., None] * delta[..., None, :])
    return (state * q[..., None]).sum(-2)


class GatedDeltaNet(nn.Module):
    """The mixer: projections, causal depthwise conv (SiLU) over q/k/v, the gated delta rule, a norm gated by
    SiLU(z), the output projection, stored as `ModelConfig.linear_proj` says (Qwen3.5's four projections,
    Qwen3-Next's two interleaved per key head, or llama.cpp's three)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.hk, self.hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_dim, self.value_dim = self.hk * self.dk, self.hv * self.dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel = cfg.linear_conv_kernel_dim
        self.eps = cfg.rms_norm_eps
        hidden = cfg.hidden_size
        self.proj = cfg.linear_proj
        self.tiled = cfg.linear_value_heads_tiled
        if self.proj == "fused":
            self.in_qkvz = Linear(self.conv_dim + self.value_dim, hidden, False, dtype, device)
        else:
            self.in_qkv = Linear(self.conv_dim, hidden, False, dtype, device)
            self.in_z = Linear(self.value_dim, hidden, False, dtype, device)
        if self.proj == "split":
            self.in_b = Linear(self.hv, hidden, False, dtype, device)
            self.in_a = Linear(self.hv, hidden, False, dtype, device)
        else:
            self.in_ba = Linear(2 * self.hv, hidden, False, dtype, device)
        self.conv = Param(self.conv_dim, 1, self.kernel, dtype=dtype, device=device)
        self.a_log = Bare(self.hv, dtype=dtype, device=device)
        self.dt_bias = Bare(self.hv, dtype=dtype, device=device)
        self.norm = Param(self.dv, dtype=dtype, device=device)
        self.out = Linear(hidden, self.value_dim, False, dtype, device)

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """One slot's conv state and recurrent state."""
        return (self.conv_dim, self.kernel - 1), (self.hv, self.dk, self.dv)

    def slots(self) -> dict[str, nn.Module]:
        proj: dict[str, nn.Module] = (
            {"lin_qkvz": self.in_qkvz} if self.proj == "fused" else {"lin_qkv": self.in_qkv, "lin_z": self.in_z}
        )
        proj |= {"lin_b": self.in_b, "lin_a": self.in_a} if self.proj == "split" else {"lin_ba": self.in_ba}
        rest = {"lin_conv": self.conv, "lin_a_log": self.a_log, "lin_dt_bias": self.dt_bias, "lin_norm": self.norm}
        return proj | rest | {"lin_out": self.out}

    def linears(self) -> list[Linear]:
        return [m for m in self.slots().values() if isinstance(m, Linear)]

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> conv input [T, C] (q, k, v), z [T, Hv, Dv], b and a [T, Hv]."""
        T = x.shape[0]
        if self.proj == "split":
            return self.in_qkv(x), self.in_z(x).view(T, self.hv, self.dv), self.in_b(x), self.in_a(x)
        r = self.hv // self.hk
        b, a = self.in_ba(x).view(T, self.hk, 2 * r).split([r, r], -1)
        b, a = b.reshape(T, self.hv), a.reshape(T, self.hv)
        if self.proj == "qkv_z_ba":
            return self.in_qkv(x), self.in_z(x).view(T, self.hv, self.dv), b, a
        q, k, v, z = self.in_qkvz(x).view(T, self.hk, -1).split([self.dk, self.dk, r * self.dv, r * self.dv], -1)
        qkv = torch.cat([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], -1)
        return qkv, z.reshape(T, self.hv, self.dv), b, a

    def _qkv(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Convolved [n, C] -> q, k (normalised, repeated to the value heads, q scaled) [n, Hv, Dk], v [n, Hv, Dv],
        float32."""
        n = mixed.shape[0]
        q, k, v = mixed.float().split([self.key_dim, self.key_dim, self.value_dim], -1)
        q, k = l2norm(q.view(n, self.hk, self.dk)), l2norm(k.view(n, self.hk, self.dk))
        if self.hv != self.hk and self.tiled:
            q, k = q.repeat(1, self.hv // self.hk, 1), k.repeat(1, self.hv // self.hk, 1)
        elif self.hv != self.hk:
            q, k = q.repeat_interleave(self.hv // self.hk, 1), k.repeat_interleave(self.hv // self.hk, 1)
        return q * self.dk**-0.5, k, v.view(n, self.hv, self.dv)

    def forward(
        self, x: torch.Tensor, conv_cache: torch.Tensor, rec_cache: torch.Tensor, step: RecurrentStep
    ) -> torch.Tensor:
        """x [T, hidden] of the step's sequences (flat, in `step`'s order) -> [T, hidden]; the new states go to
        `step.pending`."""
        mixed, z, b, a = self._project(x)
        beta = torch.sigmoid(b.float())
        g = -self.a_log.weight.float().exp() * F.softplus(a.float() + self.dt_bias.weight.float())
        conv = conv_cache[step.slots]  # gathered copies: the slots change only at commit
        rec = rec_cache[step.slots]
        fresh = [i for i, f in enumerate(step.fresh) if f]
        if fresh:
            conv[fresh], rec[fresh] = 0, 0
        weight = self.conv.weight[:, 0]  # [C, K]
        out = torch.empty(x.shape[0], self.hv, self.dv, dtype=torch.float32, device=x.device)
        starts = [0]
        for n in step.lens:
            starts.append(starts[-1] + n)
        decode = [i for i, n in enumerate(step.lens) if n == 1]
        if len(decode) == len(step.lens):  # decode only: the step's copies are updated in place
            window = torch.cat([conv, mixed[:, :, None].to(conv.dtype)], -1)  # [S, C, K]
            conv = window[..., 1:]
            q, k, v = self._qkv(F.silu((window * weight).sum(-1)))
            out = recurrent_gated_delta_rule(q, k, v, g, beta, rec)
        elif decode:
            seqs = torch.tensor(decode, dtype=torch.long, device=x.device)
            rows = torch.tensor([starts[i] for i in decode], dtype=torch.long, device=x.device)
            window = torch.cat([conv[seqs], mixed[rows, :, None].to(conv.dtype)], -1)
            conv[seqs] = window[..., 1:]
            q, k, v = self._qkv(F.silu((window * weight).sum(-1)))
            state = rec[seqs]
            out[rows] = recurrent_gated_delta_rule(q, k, v, g[rows], beta[rows], state)
            rec[seqs] = state
        convs: list[torch.Tensor] = []
        recs: list[torch.Tensor] = []
        for i, n in enumerate(step.lens):
            if n == 1:
                continue
            a_, b_ = starts[i], starts[i + 1]
            window = torch.cat([conv[i], mixed[a_:b_].T.to(conv.dtype)], -1)  # [C, K - 1 + n]
            conv[i] = window[:, -(self.kernel - 1) :]
            marks = step.marks_of(i)
            convs += [window[:, t : t + self.kernel - 1] for t in marks]  # the last K-1 inputs after t tokens
            y = F.silu(F.conv1d(window[None], self.conv.weight, groups=self.conv_dim)[0]).T  # [n, C]
            q, k, v = self._qkv(y)
            out[a_:b_], rec[i] = chunk_gated_delta_rule(q, k, v, g[a_:b_], beta[a_:b_], rec[i], marks, recs)
        step.pending.append((conv_cache, rec_cache, conv, rec))
        step.add_marked(conv_cache, rec_cache, convs, recs)
        return self.out(self._gated_norm(out, z).reshape(x.shape[0], self.value_dim))

    def _gated_norm(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """RMSNorm of each head's output, times SiLU(z) (transformers' RMSNormGated), in z's dtype."""
        dtype = z.dtype
        h = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.norm.weight * h.to(dtype)
        return (h * F.silu(z.float())).to(dtype)
