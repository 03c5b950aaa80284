"""Quantized KV caches (--kv-cache-dtype int8 | fp8 | fp8_e4m3 | fp8_e5m2): one byte per value and one scale per
(token, KV head), the layout of llama.cpp's q8_0 cache and ik_llama's Q8_KV, for vLLM's flag names.

A cache tensor is [num_blocks, block_size, KVH, D + D / 16]: each (token, head) row holds D one-byte codes, then
a bfloat16 scale per 32 codes (value = code x scale; llama.cpp's q8_0 groups). The tensor's dtype names the codes
(int8, float8_e4m3fn, float8_e5m2); every kernel reads it as bytes. A scale is its group's largest magnitude over
the format's largest value, rounded *up* to a bfloat16 before the codes are computed with it, so no code
overflows and the two-byte scale costs no accuracy: a row of 64 values takes 68 bytes instead of 256 (float32)
or 128 (bfloat16). One scale per row (66 bytes) was measured: the keys' outlier channels then cost twice the KL
divergence against a float32 cache (docs/benchmarks.md).

The C kernels (csrc/paged_attention.c, csrc/model_step.c) write and read the same bytes: each block is widened
to float32 only for the KV heads a thread reads, into a block-sized scratch buffer, never the whole context.
"""
from __future__ import annotations

import torch

from pagedllm.kv.sizing import kv_scale_bytes

# The codes' dtype -> their largest finite value.
CODE_MAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
# --kv-cache-dtype names (vLLM's: fp8 is e4m3).
QUANT_KV_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
                   "fp8_e5m2": torch.float8_e5m2}
# The kernels' cache kinds (csrc/paged_attention.h).
KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2, torch.float8_e4m3fn: 3, torch.float8_e5m2: 4}


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype in CODE_MAX


def row_bytes(head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one (token, KV head) row of keys (or values)."""
    if is_quantized(dtype):
        return head_dim + kv_scale_bytes(head_dim)
    return head_dim * torch.empty((), dtype=dtype).element_size()


def cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                dtype: torch.dtype) -> tuple[int, int, int, int]:
    return num_blocks, block_size, num_kv_heads, head_dim + (kv_scale_bytes(head_dim) if is_quantized(dtype) else 0)


def head_dim(cache: torch.Tensor) -> int:
    """The values per row of a cache tensor: D of D + D / 16 bytes for a quantized one (its scales)."""
    if not is_quantized(cache.dtype):
        return cache.shape[-1]
    width = cache.shape[-1]
    return next(d for d in (width * 16 // 17, width - 2) if d + kv_scale_bytes(d) == width)


def quantize(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., D] float -> [..., D + scale bytes] uint8: the `dtype` codes, then a bfloat16 scale per group."""
    d = x.shape[-1]
    groups = kv_scale_bytes(d) // 2
    x = x.float().reshape(*x.shape[:-1], groups, d // groups)
    top = CODE_MAX[dtype]
    scale = (x.abs().amax(-1, keepdim=True) / top).clamp_min(2.0 ** -100)
    bits = (scale.view(torch.int32) + 0xFFFF) & -65536  # rounded up to a bfloat16
    q = (x / bits.view(torch.float32)).clamp(-top, top)
    codes = q.round().to(torch.int8) if dtype == torch.int8 else q.to(dtype)
    codes = codes.view(torch.uint8).reshape(*x.shape[:-2], d)
    scales = (bits >> 16).to(torch.int16).reshape(*x.shape[:-2], groups).view(torch.uint8)
    return torch.cat([codes, scales], dim=-1)


def dequantize(rows: torch.Tensor, dtype: torch.dtype, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[..., D + scale bytes] bytes (of `dtype` codes) -> [..., D] values in `out_dtype`."""
    rows = rows.view(torch.uint8)
    d = head_dim(rows.view(dtype))
    groups = kv_scale_bytes(d) // 2
    codes = rows[..., :d].view(dtype).float().reshape(*rows.shape[:-1], groups, d // groups)
    scale = rows[..., d:].contiguous().view(torch.bfloat16).float().unsqueeze(-1)
    return (codes * scale).reshape(*rows.shape[:-1], d).to(out_dtype)
