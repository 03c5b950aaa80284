"""Paged attention: the KV cache lives in fixed-size blocks, each sequence reaches its keys through a block table.

The kernel sits behind one small interface, `PagedAttentionBackend.forward(q, k, v, k_cache, v_cache, meta)`,
so a CPU or GPU kernel can replace the portable torch one without touching the model. On CPU, decode groups
go through a C kernel (`cpu_kernel.py`) that reads blocks in place instead of gathering them.

The torch backend, per layer:
1. writes the step's new K/V into the cache through `slot_mapping` (block_id * block_size + offset);
2. for each *group* of sequences (all decodes, which have one query each; all prefill chunks, padded to the
   longest chunk) gathers each sequence's blocks with one batched index (padded block tables), and runs one
   masked SDPA call. GQA is handled by folding query heads onto their KV head, so K/V are never repeated.
Everything that depends only on the batch (indices, masks) is built once per step in `AttentionMetadata` and
shared by all layers, so the per-layer Python cost is a handful of tensor ops. No per-sequence buffer of
`max_model_len` is ever allocated: the gathered keys cover only the blocks a sequence actually holds.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field, replace

import numpy as np
import torch
import torch.nn.functional as F

import pagedllm.model.kernels.cpu_kernel as cpu_kernel
import pagedllm.model.kernels.kv_quant as kv_quant
from pagedllm.model.config import ModelConfig


@dataclass(frozen=True)
class AttentionSpec:
    """How one layer attends, beyond causal: what a family module fills per layer and every path (torch, the C
    decode kernel, the fused C step) reads. Sliding and full layers interleave (Gemma 3: five sliding per global
    one), so each layer carries its own."""

    window: int | None = None  # tokens a query sees, itself included (transformers' sliding_window); None: all
    scale: float | None = None  # softmax scale; None: head_dim ** -0.5
    softcap: float | None = None  # Gemma 2: scores become softcap * tanh(score / softcap) before the softmax
    # gpt-oss: one learned logit per query head ([H] float32), an extra term exp(sink) in the softmax's denominator
    # (a key every query sees whose value is zero), so a head can attend to "nothing". The layer's parameter
    # itself, filled when the weights load (not compared: two specs differ by it only between models).
    sinks: torch.Tensor | None = field(default=None, compare=False)

    @staticmethod
    def for_layer(cfg: ModelConfig, layer: int, sinks: torch.Tensor | None = None) -> AttentionSpec:
        return AttentionSpec(cfg.layer_window(layer), cfg.attn_scale, cfg.attn_logit_softcapping, sinks)


@dataclass
class StepIndex:
    """A step's flat-batch indices (int64 numpy), built once per step for the fused C step and the torch path."""

    lens: np.ndarray  # [S] new tokens of each sequence
    starts: np.ndarray  # [S] tokens of each sequence already cached
    first: np.ndarray  # [S] flat index of each sequence's first new token
    seq: np.ndarray  # [T] sequence of each token
    positions: np.ndarray  # [T] absolute position of each token
    slots: np.ndarray  # [T] cache slot of each token (block_id * block_size + offset)
    tables: np.ndarray  # [S, most blocks needed]: the blocks each sequence needs, padded with 0


def step_index(new_lens: list[int], starts: list[int], block_tables: list[list[int]], block_size: int) -> StepIndex:
    """The indices of a step where sequence i adds `new_lens[i]` tokens after `starts[i]` cached ones."""
    lens = np.array(new_lens, dtype=np.int64)
    start = np.array(starts, dtype=np.int64)
    T = int(lens.sum())
    seq = np.repeat(np.arange(len(lens), dtype=np.int64), lens)
    first = np.cumsum(lens) - lens
    pos = start[seq] + np.arange(T, dtype=np.int64) - first[seq]
    tables, slots = _table_index(lens, start, seq, pos, block_tables, block_size)
    return StepIndex(lens, start, first, seq, pos, slots, tables)


def _table_index(
    lens: np.ndarray, start: np.ndarray, seq: np.ndarray, pos: np.ndarray, block_tables: list[list[int]], bs: int
) -> tuple[np.ndarray, np.ndarray]:
    """The padded tables [S, most blocks needed] and each token's slot through them."""
    need = (start + lens + bs - 1) // bs
    tables = np.zeros((len(lens), int(need.max()) if len(lens) else 0), dtype=np.int64)
    for i, (table, n) in enumerate(zip(block_tables, need.tolist())):
        if len(table) < n:
            raise ValueError(f"block table of {len(table)} blocks cannot hold {int(start[i] + lens[i])} tokens")
        tables[i, :n] = table[:n]
    return tables, tables[seq, pos // bs] * bs + pos % bs


def group_step_index(
    new_lens: list[int], starts: list[int], group_tables: list[list[list[int]]], block_size: int
) -> list[StepIndex]:
    """Per KV-cache group, the step's indices through that group's tables (`group_tables[g][i]`: sequence i's):
    positions and sequences are built once and shared, tables and slots are each group's own."""
    ix = step_index(new_lens, starts, group_tables[0], block_size)
    rest = [_table_index(ix.lens, ix.starts, ix.seq, ix.positions, t, block_size) for t in group_tables[1:]]
    return [ix] + [replace(ix, tables=tables, slots=slots) for tables, slots in rest]


@dataclass
class AttentionGroup:
    """Sequences attended together: S sequences, queries padded to q_len, keys padded to blocks*block_size."""

    q_len: int
    query_index: torch.Tensor  # [S * q_len] flat token index of each padded query (padding -> any valid token)
    block_tables: torch.Tensor  # [S, max_blocks] block ids (padding -> block 0, masked out)
    mask: torch.Tensor  # [S, 1, q_len, max_blocks * block_size] bool, True = may attend (causal)
    valid: torch.Tensor | None  # [S * q_len] bool, which padded queries are real (None when all are)
    token_index: torch.Tensor  # [n_real] flat token index of each real query, in padded order
    context_lens: torch.Tensor  # [S] long: tokens each sequence attends to after this step (cached + new)
    query_pos: torch.Tensor  # [S, 1, q_len, 1] long: each query's position (0 for padding)
    first_pos: int = 0  # the lowest position of a real query in the group
    # window -> (the blocks from the first one any query's window reaches, the causal mask within the window)
    windowed: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def window_view(self, window: int | None, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Block tables and mask for a layer with `window` (made once per step and window): the blocks before the
        first one a window reaches are left out, so a long context gathers only its windows' blocks (those
        entries may be the null block: the pool handed them on)."""
        if window is None:
            return self.block_tables, self.mask
        if window not in self.windowed:
            skip = max(0, self.first_pos - window + 1) // block_size
            keys = torch.arange(skip * block_size, self.mask.shape[-1], device=self.mask.device)
            mask = self.mask[..., skip * block_size :] & (keys > self.query_pos - window)
            mask[..., 0] |= ~mask.any(-1)  # padded queries keep one key, so softmax stays finite; dropped later
            self.windowed[window] = (self.block_tables[:, skip:], mask)
        return self.windowed[window]


def _make_group(ix: StepIndex, sel: np.ndarray, block_size: int, device: torch.device) -> AttentionGroup:
    """The group of sequences `sel` (indices into the step)."""
    lens, starts, first = ix.lens[sel], ix.starts[sel], ix.first[sel]
    q_len = int(lens.max())
    max_blocks = int(((starts + lens + block_size - 1) // block_size).max())
    qi = np.arange(q_len, dtype=np.int64)
    real = qi[None, :] < lens[:, None]  # [S, q_len]
    qidx = np.where(real, first[:, None] + qi[None, :], first[:, None]).reshape(-1)
    qpos = torch.from_numpy(np.where(real, starts[:, None] + qi[None, :], 0))
    kj = torch.arange(max_blocks * block_size)
    mask = kj[None, None, :] <= qpos[:, :, None]  # causal over cached + new tokens
    pad_q = torch.from_numpy(~real)
    if bool(pad_q.any()):
        mask[pad_q] = False
        mask[pad_q, 0] = True  # padded queries attend to one key so softmax stays finite; results are dropped
    valid = None if real.all() else torch.from_numpy(real.reshape(-1)).to(device)
    qidx_t = torch.from_numpy(qidx).to(device)
    return AttentionGroup(
        q_len=q_len,
        query_index=qidx_t,
        block_tables=torch.from_numpy(np.ascontiguousarray(ix.tables[sel, :max_blocks])).to(device),
        mask=mask[:, None].to(device),
        valid=valid,
        token_index=qidx_t[valid] if valid is not None else qidx_t,
        context_lens=torch.from_numpy(starts + lens).to(device),
        query_pos=qpos[:, None, :, None].to(device),
        first_pos=int(starts.min()),
    )


@dataclass
class AttentionMetadata:
    """Per-step, per-batch tensors shared by every layer."""

    slot_mapping: torch.Tensor  # [T] long: cache slot of each new token
    positions: torch.Tensor  # [T] long: absolute position of each new token
    groups: list[AttentionGroup] = field(default_factory=list)
    num_tokens: int = 0


def build_metadata(
    new_lens: list[int],
    start_positions: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device,
    index: StepIndex | None = None,
) -> AttentionMetadata:
    """Flat-batch metadata for sequences contributing `new_lens[i]` tokens after `start_positions[i]` cached ones
    (from `index` when the caller has built it already)."""
    ix = index or step_index(new_lens, start_positions, block_tables, block_size)
    decode, prefill = np.flatnonzero(ix.lens == 1), np.flatnonzero(ix.lens != 1)
    groups = [_make_group(ix, sel, block_size, device) for sel in (decode, prefill) if len(sel)]
    return AttentionMetadata(
        slot_mapping=torch.from_numpy(ix.slots).to(device),
        positions=torch.from_numpy(ix.positions).to(device),
        groups=groups,
        num_tokens=int(ix.lens.sum()),
    )


class PagedAttentionBackend:
    """The one interface a kernel implements. q: [T, H, D], k/v: [T, KVH, D], caches: [blocks, bs, KVH, D]."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        spec: AttentionSpec = AttentionSpec(),
    ) -> torch.Tensor:
        """Write k/v into the cache at meta.slot_mapping (none when None: a layer that reads another's KV), return
        attention output [T, H, D] as `spec` says."""
        raise NotImplementedError


class TorchPagedAttention(PagedAttentionBackend):
    """Portable implementation: batched block gather + masked SDPA, GQA by head folding."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        spec: AttentionSpec = AttentionSpec(),
    ) -> torch.Tensor:
        nb, bs, kvh, w = k_cache.shape
        for cache, x in ((k_cache, k), (v_cache, v)):
            if x is None:  # a layer that reads another's KV (Gemma 4's shared layers) writes none
                continue
            if kv_quant.is_quantized(cache.dtype):  # written as bytes: codes and a scale per (token, head)
                cache.view(torch.uint8).view(nb * bs, kvh, w).index_copy_(
                    0, meta.slot_mapping, kv_quant.quantize(x, cache.dtype)
                )
            else:
                cache.view(nb * bs, kvh, w).index_copy_(0, meta.slot_mapping, x.to(cache.dtype))
        T, H, _ = q.shape
        g = H // kvh
        if len(meta.groups) == 1 and meta.groups[0].valid is None and meta.groups[0].q_len == 1:
            return self._group(q, k_cache, v_cache, meta.groups[0], g, spec)  # pure decode: order is already flat
        out = torch.empty_like(q)
        for grp in meta.groups:
            res = self._group(q, k_cache, v_cache, grp, g, spec)
            out[grp.token_index] = res
        return out

    def _group(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        grp: AttentionGroup,
        g: int,
        spec: AttentionSpec,
    ) -> torch.Tensor:
        nb, bs, kvh, _ = k_cache.shape
        d = q.shape[-1]
        tables, mask = grp.window_view(spec.window, bs)
        S, mb = tables.shape
        Q = grp.q_len
        # [S, mb, bs, kvh, d] -> [S, kvh, L, d]
        keys = _gather(k_cache, tables, q.dtype).view(S, mb * bs, kvh, d).transpose(1, 2)
        vals = _gather(v_cache, tables, q.dtype).view(S, mb * bs, kvh, d).transpose(1, 2)
        qq = q[grp.query_index] if not (Q == 1 and S == q.shape[0]) else q
        # [S*Q, H, d] -> [S, Q, kvh, g, d] -> [S, kvh, g*Q, d] (row = gi*Q + qi)
        qq = qq.view(S, Q, kvh, g, d).permute(0, 2, 3, 1, 4).reshape(S, kvh, g * Q, d)
        mask = mask if g == 1 or Q == 1 else mask.repeat(1, 1, g, 1)
        o = _attend(qq, keys, vals, mask, spec)
        o = o.view(S, kvh, g, Q, d).permute(0, 3, 1, 2, 4).reshape(S * Q, kvh * g, d)
        if grp.valid is not None:
            o = o[grp.valid]
        return o


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, spec: AttentionSpec) -> torch.Tensor:
    """softmax(scale q k^T, capped, masked) v: SDPA where neither a soft-cap nor sinks are asked for, else written
    out (SDPA has neither; transformers' eager Gemma 2 and gpt-oss attention do the same steps). q: [S, kvh, g * Q,
    d], row gi * Q + qi being query head kvh_i * g + gi of query qi."""
    if spec.softcap is None and spec.sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=spec.scale)
    scale = spec.scale if spec.scale is not None else q.shape[-1] ** -0.5
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if spec.softcap is not None:
        scores = torch.tanh(scores / spec.softcap) * spec.softcap
    scores = scores.masked_fill(~mask, float("-inf")).float()
    if spec.sinks is None:
        return torch.matmul(torch.softmax(scores, dim=-1).to(v.dtype), v)
    S, kvh, rows, _ = scores.shape
    g = spec.sinks.numel() // kvh
    sink = spec.sinks.float().view(kvh, g).repeat_interleave(rows // g, dim=1)  # [kvh, g * Q], in q's row order
    probs = torch.softmax(torch.cat([scores, sink[None, :, :, None].expand(S, kvh, rows, 1)], dim=-1), dim=-1)
    return torch.matmul(probs[..., :-1].to(v.dtype), v)


def _gather(cache: torch.Tensor, block_tables: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The blocks of `block_tables` ([S, mb]) as `dtype` values: [S, mb, bs, kvh, d] (the portable path)."""
    if kv_quant.is_quantized(cache.dtype):
        return kv_quant.dequantize(cache.view(torch.uint8)[block_tables], cache.dtype, dtype)
    return cache[block_tables].to(dtype)


class CpuPagedAttention(TorchPagedAttention):
    """Decode groups (one query per sequence) through the C kernel, which reads each block where it lies;
    prefill groups through the torch path, where the gather is small next to the chunk's own compute."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib

    def _group(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        grp: AttentionGroup,
        g: int,
        spec: AttentionSpec,
    ) -> torch.Tensor:
        if grp.q_len != 1 or not cpu_kernel.supports(q, k_cache, v_cache):
            return super()._group(q, k_cache, v_cache, grp, g, spec)
        qq = q if grp.block_tables.shape[0] == q.shape[0] else q[grp.query_index]
        scale = spec.scale if spec.scale is not None else q.shape[-1] ** -0.5
        return cpu_kernel.decode_attention(
            self.lib,
            qq,
            k_cache,
            v_cache,
            grp.block_tables,
            grp.context_lens,
            scale,
            spec.window,
            spec.softcap,
            spec.sinks,
        )


def make_attention_backend(device: torch.device | str) -> PagedAttentionBackend:
    """The fastest backend that works on `device`: the C kernel on CPU when it builds, else the torch path."""
    if torch.device(device).type == "cpu":
        lib = cpu_kernel.attention_lib()
        if lib is not None:
            return CpuPagedAttention(lib)
    return TorchPagedAttention()
