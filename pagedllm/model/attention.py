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
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

import pagedllm.model.cpu_kernel as cpu_kernel
import pagedllm.model.kv_quant as kv_quant


@dataclass(frozen=True)
class AttentionSpec:
    """What one layer's attention needs beyond q, k and v (ModelConfig's attn_scale, attn_logit_softcapping and
    layer_window): scale None = head_dim ** -0.5, softcap None = no cap, window None = full attention."""

    scale: float | None = None
    softcap: float | None = None
    window: int | None = None


@dataclass
class AttentionGroup:
    """Sequences attended together: S sequences, queries padded to q_len, keys padded to blocks*block_size."""

    q_len: int
    query_index: torch.Tensor  # [S * q_len] flat token index of each padded query (padding -> any valid token)
    block_tables: torch.Tensor  # [S, max_blocks] block ids (padding -> block 0, masked out)
    mask: torch.Tensor  # [S, 1, q_len, max_blocks * block_size] bool, True = may attend
    valid: torch.Tensor | None  # [S * q_len] bool, which padded queries are real (None when all are)
    token_index: torch.Tensor  # [n_real] flat token index of each real query, in padded order
    context_lens: torch.Tensor  # [S] long: tokens each sequence attends to after this step (cached + new)


@dataclass
class AttentionMetadata:
    """Per-step, per-batch tensors shared by every layer."""

    slot_mapping: torch.Tensor  # [T] long: cache slot of each new token
    positions: torch.Tensor  # [T] long: absolute position of each new token
    groups: list[AttentionGroup] = field(default_factory=list)
    num_tokens: int = 0


def _make_group(seqs: list[tuple[int, int, int, list[int]]], block_size: int, device: torch.device) -> AttentionGroup:
    """seqs: (first flat token index, number of new tokens, start_pos, block_table) for each sequence."""
    q_len = max(n for _, n, _, _ in seqs)
    n_blocks = [-(-(start + n) // block_size) for _, n, start, _ in seqs]
    max_blocks = max(n_blocks)
    bt = [list(table[:nb]) + [0] * (max_blocks - nb) for (_, _, _, table), nb in zip(seqs, n_blocks)]
    qidx: list[int] = []
    real: list[bool] = []
    for first, n, _, _ in seqs:
        qidx.extend(range(first, first + n))
        qidx.extend([first] * (q_len - n))
        real.extend([True] * n + [False] * (q_len - n))
    starts = torch.tensor([s for _, _, s, _ in seqs], dtype=torch.long)
    lens = torch.tensor([n for _, n, _, _ in seqs], dtype=torch.long)
    qi = torch.arange(q_len)
    kj = torch.arange(max_blocks * block_size)
    qpos = starts[:, None] + qi[None, :]  # [S, q_len] absolute position of each query
    mask = kj[None, None, :] <= qpos[:, :, None]  # causal over cached + new tokens
    pad_q = qi[None, :] >= lens[:, None]  # [S, q_len]
    if bool(pad_q.any()):
        mask[pad_q] = False
        mask[pad_q, 0] = True  # padded queries attend to one key so softmax stays finite; results are dropped
    valid = torch.tensor(real, dtype=torch.bool, device=device) if not all(real) else None
    qidx_t = torch.tensor(qidx, dtype=torch.long, device=device)
    return AttentionGroup(
        q_len=q_len,
        query_index=qidx_t,
        block_tables=torch.tensor(bt, dtype=torch.long, device=device),
        mask=mask[:, None].to(device),
        valid=valid,
        token_index=qidx_t[valid] if valid is not None else qidx_t,
        context_lens=(starts + lens).to(device),
    )


def build_metadata(
    new_lens: list[int],
    start_positions: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device,
) -> AttentionMetadata:
    """Flat-batch metadata for sequences contributing `new_lens[i]` tokens after `start_positions[i]` cached ones."""
    slots: list[int] = []
    positions: list[int] = []
    decode: list[tuple[int, int, int, list[int]]] = []
    prefill: list[tuple[int, int, int, list[int]]] = []
    first = 0
    for n, start, table in zip(new_lens, start_positions, block_tables):
        if len(table) * block_size < start + n:
            raise ValueError(f"block table of {len(table)} blocks cannot hold {start + n} tokens")
        for p in range(start, start + n):
            slots.append(table[p // block_size] * block_size + p % block_size)
        positions.extend(range(start, start + n))
        (decode if n == 1 else prefill).append((first, n, start, table))
        first += n
    groups = [_make_group(g, block_size, device) for g in (decode, prefill) if g]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        positions=torch.tensor(positions, dtype=torch.long, device=device),
        groups=groups,
        num_tokens=first,
    )


class PagedAttentionBackend:
    """The one interface a kernel implements. q: [T, H, D], k/v: [T, KVH, D], caches: [blocks, bs, KVH, D]."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        spec: AttentionSpec | None = None,
    ) -> torch.Tensor:
        """Write k/v into the cache at meta.slot_mapping, return attention output [T, H, D]."""
        raise NotImplementedError


class TorchPagedAttention(PagedAttentionBackend):
    """Portable implementation: batched block gather + masked SDPA, GQA by head folding."""

    def __init__(self, scale: float | None = None) -> None:
        self.scale = scale

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        spec: AttentionSpec | None = None,
    ) -> torch.Tensor:
        spec = spec or AttentionSpec(scale=self.scale)
        nb, bs, kvh, w = k_cache.shape
        if kv_quant.is_quantized(k_cache.dtype):  # written as bytes: codes and a scale per (token, head)
            for cache, x in ((k_cache, k), (v_cache, v)):
                cache.view(torch.uint8).view(nb * bs, kvh, w).index_copy_(
                    0, meta.slot_mapping, kv_quant.quantize(x, cache.dtype)
                )
        else:
            k_cache.view(nb * bs, kvh, w).index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
            v_cache.view(nb * bs, kvh, w).index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))
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
        S, mb = grp.block_tables.shape
        Q = grp.q_len
        # [S, mb, bs, kvh, d] -> [S, kvh, L, d]
        keys = _gather(k_cache, grp.block_tables, q.dtype).view(S, mb * bs, kvh, d).transpose(1, 2)
        vals = _gather(v_cache, grp.block_tables, q.dtype).view(S, mb * bs, kvh, d).transpose(1, 2)
        qq = q[grp.query_index] if not (Q == 1 and S == q.shape[0]) else q
        # [S*Q, H, d] -> [S, Q, kvh, g, d] -> [S, kvh, g*Q, d] (row = gi*Q + qi)
        qq = qq.view(S, Q, kvh, g, d).permute(0, 2, 3, 1, 4).reshape(S, kvh, g * Q, d)
        mask = grp.mask if g == 1 or Q == 1 else grp.mask.repeat(1, 1, g, 1)
        if spec.softcap is None:
            o = F.scaled_dot_product_attention(qq, keys, vals, attn_mask=mask, scale=spec.scale)
        else:
            o = _capped_attention(qq, keys, vals, mask, spec.scale or d**-0.5, spec.softcap)
        o = o.view(S, kvh, g, Q, d).permute(0, 3, 1, 2, 4).reshape(S * Q, kvh * g, d)
        if grp.valid is not None:
            o = o[grp.valid]
        return o


def _capped_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, cap: float
) -> torch.Tensor:
    """Attention with tanh soft-capped scores (Gemma 2), as transformers' eager path computes it."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / cap) * cap
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)


def _gather(cache: torch.Tensor, block_tables: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The blocks of `block_tables` ([S, mb]) as `dtype` values: [S, mb, bs, kvh, d] (the portable path)."""
    if kv_quant.is_quantized(cache.dtype):
        return kv_quant.dequantize(cache.view(torch.uint8)[block_tables], cache.dtype, dtype)
    return cache[block_tables].to(dtype)


class CpuPagedAttention(TorchPagedAttention):
    """Decode groups (one query per sequence) through the C kernel, which reads each block where it lies;
    prefill groups through the torch path, where the gather is small next to the chunk's own compute."""

    def __init__(self, lib: ctypes.CDLL, scale: float | None = None) -> None:
        super().__init__(scale)
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
        if grp.q_len != 1 or spec.softcap is not None or not cpu_kernel.supports(q, k_cache, v_cache):
            return super()._group(q, k_cache, v_cache, grp, g, spec)
        qq = q if grp.block_tables.shape[0] == q.shape[0] else q[grp.query_index]
        scale = spec.scale if spec.scale is not None else q.shape[-1] ** -0.5
        return cpu_kernel.decode_attention(self.lib, qq, k_cache, v_cache, grp.block_tables, grp.context_lens, scale)


def make_attention_backend(device: torch.device | str, scale: float | None = None) -> PagedAttentionBackend:
    """The fastest backend that works on `device`: the C kernel on CPU when it builds, else the torch path."""
    if torch.device(device).type == "cpu":
        lib = cpu_kernel.attention_lib()
        if lib is not None:
            return CpuPagedAttention(lib, scale)
    return TorchPagedAttention(scale)
