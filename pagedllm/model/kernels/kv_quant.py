"""Quantized KV caches (--kv-cache-dtype int8 | fp8 | fp8_e4m3 | fp8_e5m2): one byte per value and one scale per
(token, KV head), the layout of llama.cpp's q8_0 cache and ik_llama's Q8_KV, for vLLM's flag names.

A cache tensor is [num_blocks, block_size, KVH, D + 2]: each (token, head) row holds D one-byte codes, then one
bfloat16 scale (value = code x scale). The tensor's dtype names the codes (int8, float8_e4m3fn, float8_e5m2);
every kernel reads it as bytes. The scale is the row's largest magnitude over the format's largest value, rounded
*up* to a bfloat16 before the codes are computed with it, so no code overflows and the two-byte scale costs no
accuracy: a row of 64 values takes 66 bytes instead of 256 (float32) or 128 (bfloat16).

The codes hold the row *rotated* by a normalized Walsh-Hadamard transform (`rotate`, over blocks of the largest
power of two dividing D; ik_llama's -khad, QuaRot): the keys' outlier channels, which set a plain row's scale and
left the other channels a few steps, are spread over all D values first. Attention is unchanged by a rotation
applied to both sides (q.k = Hq.Hk, and sum p v = H sum p Hv since H is its own inverse), so the kernels rotate
each query once and each output once and read the cache as stored. Measured on the RAG corpus against a float32
cache (docs/benchmarks.md): a scale per 32 plain values had half the error of a scale per plain row, and its
greedy top-1 agreement missed 99%; the rotated row with one scale has less error than either.

The C kernels (csrc/paged_attention.c, csrc/model_step.c) write and read the same bytes: each block is widened
to float32 only for the KV heads a thread reads, into a block-sized scratch buffer, never the whole context.
"""

from __future__ import annotations

import functools

import torch

from pagedllm.kv.sizing import KV_DTYPES, KV_SCALE_BYTES

# The codes' dtype -> their largest finite value.
CODE_MAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
# The quantized --kv-cache-dtype names (kv/sizing's table) -> their codes' dtype.
QUANT_KV_DTYPES = {name: getattr(torch, d.torch_name) for name, d in KV_DTYPES.items() if d.scale_bytes}
# The kernels' cache kinds (csrc/paged_attention.h).
KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2, torch.float8_e4m3fn: 3, torch.float8_e5m2: 4}


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> tuple[str, torch.dtype]:
    """A --kv-cache-dtype as (its name in kv/sizing's table, the torch dtype of the cache's tensors); "auto" is
    the model's dtype."""
    if name == "auto":
        name = str(model_dtype).removeprefix("torch.")
    return name, getattr(torch, KV_DTYPES[name].torch_name)


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype in CODE_MAX


def cache_shape(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> tuple[int, int, int, int]:
    return num_blocks, block_size, num_kv_heads, head_dim + (KV_SCALE_BYTES if is_quantized(dtype) else 0)


def head_dim(cache: torch.Tensor) -> int:
    """The values per row of a cache tensor: D of D + 2 bytes for a quantized one (its scale)."""
    return cache.shape[-1] - (KV_SCALE_BYTES if is_quantized(cache.dtype) else 0)


@functools.cache
def _hadamard(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return (h / n**0.5).float()


def rotate(x: torch.Tensor) -> torch.Tensor:
    """[..., D] float32 -> the same rotated by a normalized Walsh-Hadamard transform over each block of P values,
    P the largest power of two dividing D: its own inverse (csrc/model_step.c's fwht computes the same)."""
    d = x.shape[-1]
    p = d & -d
    return (x.reshape(*x.shape[:-1], d // p, p) @ _hadamard(p)).reshape(x.shape)


def quantize(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., D] float -> [..., D + 2] uint8: the `dtype` codes of the rotated row, then its bfloat16 scale."""
    return encode(rotate(x.float()), dtype)


def encode(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., D] float32 rows as they are (rotated already) -> [..., D + 2] uint8 codes and scale."""
    top = CODE_MAX[dtype]
    scale = (x.abs().amax(-1, keepdim=True) / top).clamp_min(2.0**-100)
    bits = (scale.view(torch.int32) + 0xFFFF) & -65536  # rounded up to a bfloat16
    q = (x / bits.view(torch.float32)).clamp(-top, top)
    codes = q.round().to(torch.int8) if dtype == torch.int8 else q.to(dtype)
    return torch.cat([codes.view(torch.uint8), (bits >> 16).to(torch.int16).view(torch.uint8)], dim=-1)


def dequantize(rows: torch.Tensor, dtype: torch.dtype, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[..., D + 2] bytes (of `dtype` codes) -> [..., D] values in `out_dtype`, rotated back."""
    rows = rows.view(torch.uint8)
    d = head_dim(rows.view(dtype))
    scale = rows[..., d:].contiguous().view(torch.bfloat16).float()
    return rotate(rows[..., :d].view(dtype).float() * scale).to(out_dtype)
