"""Weight-only quantized linear layers: a GGUF's tensors kept as stored (every common GGML type, see
gguf_quants.py), or Hugging Face weights rounded to int8 / int4 at load (`--quantization int8|int4`), run by the
C kernels in csrc/qmm_f32.c, qmm_dot.c and qmm_bf16.c (one file per route).

Why keep them quantized: a decode step reads every weight once, so with few sequences per step its time is
the weights' bytes over the memory bandwidth. The default model is 96 MB as stored and 269 MB (bfloat16) or
540 MB (float32) dequantized.

Formats ("shapes" of a format, shared by the GGML types that have them; all in groups of 32 along K):
- q4_1 / q4_0 / q5_0 / q5_1 / q8_0 / q8m: w = d * q (+ m) with float16 d (and m) per group (each named after
  the GGML type whose layout it is: Q4_1, Q4_0, Q5_0, Q5_1, Q8_0; `--quantization int4 / int8` as q4_1 / q8_0;
  q8m, int8 codes with a minimum, has no GGML twin: Q8_1's second float is the block's sum, not a minimum);
- q4_k / q5_k / q6_k / k8m / k8: GGUF's K types, super-blocks of 256 with float16 D (and M) and integer
  sub-block scales s (and minimums mi) per 32 or 16: w = (D * s) * q - (M * mi) (Q4_K, Q5_K, Q6_K; k8m and k8
  are byte codes with / without minimums that Q2_K and Q3_K widen to, no GGML type's layout);
- iq4_nl / iq4_xs: IQ4_NL and IQ4_XS (GGML types 20, 23, MoE files' experts among others) as stored, 4-bit codes
  of the non-linear table IQ4_VALUES: w = d * IQ4_VALUES[q] per group of 32 (4.5 bits, as the file), or
  w = (D * s) * IQ4_VALUES[q] with s the file's 6-bit scale - 32 per 32 (4.31 bits, the file's 4.25 and D);
- mxfp4: MXFP4 (GGML type 39, gpt-oss's experts): w = kvalues[q] * 2^(e - 128), q an E2M1 code 0..15 (its value
  doubled: 0, 1, 2, 3, 4, 6, 8, 12 and their negatives), e the group's E8M0 byte, kept as the byte (4.25 bits a
  weight, as the file: float16 cannot hold 2^-128..2^127, and a float32 a group would be 5 bits);
- f16 / bf16: the values themselves.
Every product of those factors is exact in float32 and the one rounding (the final add) is gguf's, so the
dequantized weights equal the file's values exactly. `QuantParts` is the plain form (codes [N, K] and the
scales per row) in which rows are un-permuted and q/k/v or gate/up merged; `pack` then lays it out in the
kernel's tiles (see the C file's header), and `pack_merged` keeps pieces of different types side by side.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

import pagedllm.model.kernels.cpu_kernel as cpu_kernel

log = logging.getLogger("pagedllm.model")
_said: set[str] = set()

GROUP = 32
SUPER = 256  # a K format's super-block (GGUF's QK_K)
# the kernel's format numbers (csrc/quant_matmul.h)
FORMATS = {"q4_1": 0, "q8_0": 1, "q8m": 2, "f16": 3, "bf16": 4, "q4_k": 5, "k8m": 6, "k8": 7}
FORMATS |= {"q5_0": 8, "q5_1": 9, "q5_k": 10, "q6_k": 11, "q4_0": 12, "mxfp4": 13, "iq4_nl": 14, "mixed": 15}
FORMATS |= {"iq4_xs": 16}
K_FORMATS = {"q4_k", "k8m", "k8", "q5_k", "q6_k", "iq4_xs"}
# what the dot route runs (csrc dot_fmt); others: float32
DOT_FORMATS = {"q4_1", "q4_0", "q5_0", "q5_1", "q8_0", "q8m", "q4_k", "q5_k", "q6_k", "mxfp4", "iq4_nl", "iq4_xs"}
# what the int8 route runs (csrc i8_fmt); others: float32
I8_FORMATS = {"q4_1", "q4_0", "q8_0", "q8m", "q4_k", "q6_k"}
_SUB = {"q4_k": 32, "k8m": 16, "k8": 16, "q5_k": 32, "q6_k": 16, "iq4_xs": 32}  # inputs per integer scale s (and mi)
MX4_VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.int8)  # E2M1, doubled
# IQ4_NL / IQ4_XS's non-linear table (llama.cpp's kvalues_iq4nl); csrc/simd.h's IQ4_VALUES
IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8)


def e8m0_half(e: np.ndarray) -> np.ndarray:
    """E8M0 bytes -> float32 2^(e - 128), as llama.cpp's ggml_e8m0_to_fp32_half: e = 0, 1 the subnormals
    2^-128, 2^-127; e = 255 is 2^127 (OCP MX reads it as NaN; llama.cpp and gguf-py do not, and the weights
    must be the file's values as they read them)."""
    e32 = e.astype(np.uint32)
    return np.where(e32 < 2, np.uint32(0x200000) << e32, (e32 - 1) << 23).astype(np.uint32).view(np.float32)


def log_once(message: str) -> None:
    """A fallback is worth one warning, not one per tensor or per call."""
    if message not in _said:
        _said.add(message)
        log.warning(message)


@dataclass
class QuantParts:
    """A quantized weight [N, K] in plain form, rows = output features:
    - q4_1 / q4_0 / q5_0 / q5_1 / q8_0 / q8m: w = d * q (+ m), d and m float16 [N, K/32]; codes uint8 0..15
      (q4_1) or int8 (q4_0 -8..7, q5_0 -16..15, q5_1 0..31);
    - q4_k / q5_k / q6_k / k8m / k8: w = (D * s) * q - (M * mi), D and M float16 [N, K/256] (in `d` and `m`),
      s int8 and mi uint8 [N, K/32] (q4_k, q5_k) or [N, K/16]; codes uint8 0..15 (q4_k) or int8 (q5_k 0..31,
      q6_k -32..31);
    - mxfp4: w = MX4_VALUES[q] * e8m0_half(d), codes uint8 0..15 (E2M1), d the E8M0 bytes uint8 [N, K/32];
    - iq4_nl: w = d * IQ4_VALUES[q], d float16 [N, K/32]; iq4_xs: w = (D * s) * IQ4_VALUES[q], D float16
      [N, K/256] (in `d`), s int8 [N, K/32]; codes uint8 0..15 (table indices);
    - f16 / bf16: codes are the uint16 values themselves [N, K]."""

    fmt: str
    codes: np.ndarray
    d: np.ndarray | None
    m: np.ndarray | None
    source: str  # "Q4_K", "Q8_0", "int4", ... for messages
    s: np.ndarray | None = None
    mi: np.ndarray | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape[0], self.codes.shape[1]

    def rows(self, index: np.ndarray) -> QuantParts:
        """The same weight with its rows (output features) reordered, e.g. GGUF's Q/K un-permutation."""
        pick = [None if a is None else a[index] for a in (self.d, self.m, self.s, self.mi)]
        return QuantParts(self.fmt, self.codes[index], pick[0], pick[1], self.source, pick[2], pick[3])

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K], computed as gguf's reference does (every product exact in float32, one rounding)."""
        n, k = self.shape
        if self.fmt in ("f16", "bf16"):
            c = np.ascontiguousarray(self.codes)
            w = (
                c.view(np.float16).astype(np.float32)
                if self.fmt == "f16"
                else (c.astype(np.uint32) << 16).view(np.float32)
            )
            return torch.from_numpy(np.ascontiguousarray(w))
        assert self.d is not None
        if self.fmt == "mxfp4":
            v = MX4_VALUES[self.codes].astype(np.float32).reshape(n, k // GROUP, GROUP)
            return torch.from_numpy(np.ascontiguousarray((v * e8m0_half(self.d)[..., None]).reshape(n, k)))
        sub = _SUB.get(self.fmt, GROUP)
        values = IQ4_VALUES[self.codes] if self.fmt in ("iq4_nl", "iq4_xs") else self.codes
        q = values.astype(np.float32).reshape(n, k // sub, sub)
        if self.fmt in K_FORMATS:
            assert self.s is not None
            a = np.repeat(self.d.astype(np.float32), SUPER // sub, axis=1) * self.s.astype(np.float32)
            w = q * a[..., None]
            if self.m is not None and self.mi is not None:
                b = np.repeat(self.m.astype(np.float32), SUPER // sub, axis=1) * self.mi.astype(np.float32)
                w = w - b[..., None]
        else:
            w = q * self.d.astype(np.float32)[..., None]
            if self.m is not None:
                w = w + self.m.astype(np.float32)[..., None]
        return torch.from_numpy(np.ascontiguousarray(w.reshape(n, k), dtype=np.float32))


def _cat(arrays: list[np.ndarray | None]) -> np.ndarray | None:
    return None if arrays[0] is None else np.concatenate(arrays)  # type: ignore[arg-type]


def merge(parts: list[QuantParts]) -> QuantParts | None:
    """Stack weights along N (q/k/v, gate/up) into one; None when their formats differ."""
    if len({p.fmt for p in parts}) != 1:
        return None
    return QuantParts(
        parts[0].fmt,
        np.concatenate([p.codes for p in parts]),
        _cat([p.d for p in parts]),
        _cat([p.m for p in parts]),
        "+".join(sorted({p.source for p in parts})),
        _cat([p.s for p in parts]),
        _cat([p.mi for p in parts]),
    )


def quantize_rtn(w: torch.Tensor, bits: int) -> QuantParts:
    """Round-to-nearest weight-only quantization in groups of 32 (int8 symmetric, int4 min/max)."""
    n, k = w.shape
    g = w.detach().float().reshape(n, k // GROUP, GROUP)
    if bits == 8:
        d = (g.abs().amax(-1) / 127).to(torch.float16)
        df = d.float().clamp(min=torch.finfo(torch.float16).tiny)
        q = torch.round(g / df[..., None]).clamp(-127, 127).to(torch.int8)
        return QuantParts("q8_0", q.reshape(n, k).numpy(), d.numpy(), None, "int8")
    lo, hi = g.amin(-1), g.amax(-1)
    d = ((hi - lo) / 15).to(torch.float16)
    m = lo.to(torch.float16)
    df = d.float().clamp(min=torch.finfo(torch.float16).tiny)
    q = torch.round((g - m.float()[..., None]) / df[..., None]).clamp(0, 15).to(torch.uint8)
    return QuantParts("q4_1", q.reshape(n, k).numpy(), d.numpy(), m.numpy(), "int4")


# Below this many weights a load-time repack (`gguf_codes`, `qpack_tiles`) runs on one thread: one MoE expert
# (768 x 2048) is ~0.5 ms of byte shuffling, while an OpenMP region waits for its second thread to be scheduled,
# which on a busy 2-core host took 5-15 ms per call (20-70x the work; 60 s a GB for a 30B MoE file's experts).
PACK_MIN_PARALLEL = 1 << 23


def pack_threads(weights: int) -> int:
    """Threads for repacking a weight of `weights` values at load: torch's count for large ones, else one."""
    return torch.get_num_threads() if weights >= PACK_MIN_PARALLEL else 1


def _tiles(parts: QuantParts, out: np.ndarray | None = None) -> np.ndarray:
    """QuantParts -> uint8 [ceil(N/16), bytes of a column block] in the kernel's order (csrc/quant_pack.c: one
    pass, nothing allocated but the tiles), written into `out` when given (rows of a larger weight's tiles)."""
    n, k = parts.shape
    if k % (SUPER if parts.fmt in K_FORMATS else GROUP):
        raise ValueError(f"input size {k} is not a multiple of {SUPER if parts.fmt in K_FORMATS else GROUP}")
    if out is None:
        out = np.empty((-(-n // 16), col_bytes(parts.fmt, k)), dtype=np.uint8)
    assert out.shape == (-(-n // 16), col_bytes(parts.fmt, k)) and out.flags.c_contiguous
    keep = [None if a is None else np.ascontiguousarray(a) for a in (parts.codes, parts.d, parts.m, parts.s, parts.mi)]
    sub = _SUB.get(parts.fmt, GROUP)
    scale = k // (SUPER if parts.fmt in K_FORMATS else GROUP)
    want = [(n, k), (n, scale), (n, scale), (n, k // sub), (n, k // sub)]
    sizes = [2 if parts.fmt in ("f16", "bf16") else 1, 1 if parts.fmt == "mxfp4" else 2, 2, 1, 1]
    for a, shape, size in zip(keep, want, sizes):
        if a is not None and (a.shape != shape or a.itemsize != size):
            raise ValueError(f"a {parts.fmt} weight's part has shape {a.shape} ({a.dtype}), expected {shape}")
    ptrs = [None if a is None else a.ctypes.data for a in keep]
    rc = _lib().qpack_tiles(out.ctypes.data, *ptrs, n, k, FORMATS[parts.fmt], out.shape[1], pack_threads(n * k))
    if rc != 0:
        raise ValueError(f"cannot pack a {parts.fmt} weight of shape {parts.shape} ({rc})")
    return out


def col_bytes(fmt: str, k: int) -> int:
    """Bytes of one column block (16 output features) in the kernel's layout, as the C library counts them."""
    return int(_lib().qcol_bytes(FORMATS[fmt], k // GROUP))


@dataclass
class QuantWeight:
    """A packed weight ready for the kernels: `tiles` is all that stays in memory."""

    fmt: str
    n: int
    k: int
    tiles: torch.Tensor  # uint8: [ceil(n/16), column block bytes], or a mixed weight's table and blocks
    source: str
    amx_min_rows: int = 0  # bf16 inputs of at least this many rows run on bf16_kernel() (kernel_choice.py); 0: never
    dot: bool = False  # inputs rounded to 16-bit integers per group of 32 (the dot route), at every row count
    i8_min_rows: int = 0  # inputs of at least this many rows rounded to int8 per group of 32 (the int8 route); 0: never
    i8_passes: int = 1  # the int8 route's passes of codes: 1 llama.cpp's Q8_0, 2 int8 + residual (16-bit's error)

    @property
    def nbytes(self) -> int:
        return self.tiles.numel()


def pack(parts: QuantParts) -> QuantWeight:
    n, k = parts.shape
    return QuantWeight(parts.fmt, n, k, torch.from_numpy(_tiles(parts)), parts.source)


def pack_merged(parts: list[QuantParts], into: np.ndarray | None = None) -> QuantWeight | None:
    """Pieces stacked along N (q/k/v, gate/up) as one weight. Pieces of one format whose blocks of 16 rows do
    not straddle two pieces are packed side by side into one array (their column blocks are the merged
    weight's: no merged copy of the codes first); pieces of different formats (a Q4_K_M file's Q4_K q/k and
    Q6_K v) stay as they are, each in its own column blocks, behind a table of where each block starts and its
    format; that needs every piece but the last to fill whole blocks (else None). `into` (uint8, the
    `merged_bytes` of the pieces) receives the tiles, and the weight's tiles are a view of it."""
    size = merged_bytes(parts)
    if size is None:
        return None
    flat = np.empty(size, dtype=np.uint8) if into is None else into
    if flat.shape != (size,) or not flat.flags.c_contiguous:
        raise ValueError(f"a buffer of {flat.shape} bytes for a weight of {size}")
    n, k, source = sum(p.shape[0] for p in parts), parts[0].shape[1], "+".join(sorted({p.source for p in parts}))
    if len({p.fmt for p in parts}) == 1:
        out = flat.reshape(-1, col_bytes(parts[0].fmt, k))
        if any(p.shape[0] % 16 for p in parts[:-1]):
            one = merge(parts)
            assert one is not None  # one format
            _tiles(one, out)
        else:
            at = 0
            for p in parts:
                at += _tiles(p, out[at : at - (-p.shape[0] // 16)]).shape[0]
        return QuantWeight(parts[0].fmt, n, k, torch.from_numpy(out), source)
    blocks = [-(-p.shape[0] // 16) for p in parts]
    table, offset, at = flat[: 8 * sum(blocks)].view("<i8"), 8 * sum(blocks), 0
    for p, nb in zip(parts, blocks):
        cb = col_bytes(p.fmt, k)
        table[at : at + nb] = [(offset + i * cb) << 5 | FORMATS[p.fmt] for i in range(nb)]
        _tiles(p, flat[offset : offset + nb * cb].reshape(nb, cb))
        at, offset = at + nb, offset + nb * cb
    return QuantWeight("mixed", n, k, torch.from_numpy(flat), source)


def merged_bytes(parts: list[QuantParts]) -> int | None:
    """The bytes of `pack_merged(parts)`'s tiles; None where it cannot merge them (a change of format inside a
    block of 16 rows, or pieces of different K)."""
    k = parts[0].shape[1]
    if len({p.shape[1] for p in parts}) != 1:
        return None
    if len({p.fmt for p in parts}) == 1:
        return -(-sum(p.shape[0] for p in parts) // 16) * col_bytes(parts[0].fmt, k)
    if any(p.shape[0] % 16 for p in parts[:-1]):
        return None
    return sum(-(-p.shape[0] // 16) * (8 + col_bytes(p.fmt, k)) for p in parts)


def pack_experts(count: int, pieces: Callable[[int], list[QuantParts]]) -> list[QuantWeight]:
    """A MoE layer's `count` experts, expert e the weight of `pieces(e)` stacked along N (gate and up, or down
    alone), packed expert after expert into one buffer: expert e's QuantWeight has tiles that are a view of it,
    its `nbytes` at e * nbytes, so a grouped kernel can address every routed expert from the first one's
    pointer. `pieces` is called once per expert, in order, so that one expert's plain form lives at a time (the
    buffer is all that stays); from a GGUF, gguf_quants.experts_from_gguf. Every expert must have the first
    one's formats and shapes (a ValueError names the one that does not)."""
    first = pieces(0)
    size, shape = merged_bytes(first), [(p.fmt, p.shape) for p in first]
    if size is None:
        raise ValueError(f"expert 0's pieces {shape} cannot be merged into one weight")
    buf = np.empty((count, size), dtype=np.uint8)
    weights = [_packed(first, buf[0])]
    del first  # one expert's plain form at a time
    for e in range(1, count):
        parts = pieces(e)
        if [(p.fmt, p.shape) for p in parts] != shape:
            raise ValueError(f"expert {e}: {[(p.fmt, p.shape) for p in parts]}, expert 0 has {shape}")
        weights.append(_packed(parts, buf[e]))
        del parts
    return weights


def _packed(parts: list[QuantParts], into: np.ndarray) -> QuantWeight:
    w = pack_merged(parts, into)
    assert w is not None  # merged_bytes said it merges
    return w


def _lib() -> ctypes.CDLL:
    lib = cpu_kernel.load()
    if lib is None:
        raise RuntimeError("the quantized kernels are not built on this machine")
    return lib


@lru_cache(maxsize=1)
def bf16_kernel() -> str | None:
    """Which bfloat16-input kernel runs here: "amx", "avx512-bf16" (vdpbf16ps dot products: twice the float32
    FMA's multiply-adds an instruction, on Zen 4 and later without AMX) or None (the build has neither)."""
    lib = cpu_kernel.load()
    return None if lib is None else {2: "amx", 1: "avx512-bf16"}.get(int(lib.qmm_bf16_kind()))


def qlinear(
    x: torch.Tensor,
    w: QuantWeight,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
) -> torch.Tensor:
    """x [..., K] @ w.T (+ bias); the result in x's dtype. From `w.i8_min_rows` rows on, x is rounded to 8 bits
    per group of 32 and multiplied as bytes (the int8 route, for many rows: twice the multiply-adds an
    instruction of the 16-bit one; kernel_choice.py measures from where). With `w.dot`, x is rounded to 16 bits
    per group of 32 and multiplied as integers (the dot route: decode at the memory's speed, and faster than the
    float32 route at every row count measured); otherwise float32 activations take the float32 kernel (exact weights,
    sums in a fixed order). bfloat16 activations take bf16_kernel() (AMX, or AVX-512 BF16) from
    `w.amx_min_rows` rows on where the CPU has one. A row's result does not depend on the other rows except
    across those thresholds. `out` (float32, contiguous rows) is written in place, or added to with `accumulate`."""
    lead = x.shape[:-1]
    xf = x.reshape(-1, w.k)
    m = xf.shape[0]
    i8 = 0 < w.i8_min_rows <= m
    amx = not i8 and x.dtype == torch.bfloat16 and 0 < w.amx_min_rows <= m and bf16_kernel() is not None
    dot = w.dot and not amx and not i8
    if xf.dtype != torch.float32 or xf.stride(-1) != 1:
        xf = xf.float().contiguous()
    res = out if out is not None else torch.empty(m, w.n, dtype=torch.float32)
    b = None if bias is None else bias.float().contiguous()
    i8fn = _lib().qmm_i8x2 if w.i8_passes == 2 else _lib().qmm_i8
    fn = i8fn if i8 else _lib().qmm_dot if dot else _lib().qmm_amx if amx else _lib().qmm_f32
    rc = fn(
        res.data_ptr(),
        xf.data_ptr(),
        w.tiles.data_ptr(),
        None if b is None else b.data_ptr(),
        m,
        w.n,
        w.k,
        xf.stride(0),
        res.stride(0),
        FORMATS[w.fmt],
        int(accumulate),
        torch.get_num_threads(),
    )
    if rc != 0:
        raise RuntimeError(f"quantized matmul failed ({rc})")
    if out is not None:
        return out
    return res.reshape(*lead, w.n).to(x.dtype)


def qrows(w: QuantWeight, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of the weight as float32 [len(ids), K]: the embedding lookup of a quantized table."""
    ids = ids.to(torch.int64).contiguous()
    out = torch.empty(ids.numel(), w.k, dtype=torch.float32)
    rc = _lib().qrows_f32(out.data_ptr(), ids.data_ptr(), ids.numel(), w.tiles.data_ptr(), w.n, w.k, FORMATS[w.fmt])
    if rc != 0:
        raise RuntimeError("qrows_f32: a token id outside the table" if rc == -3 else f"qrows_f32 failed ({rc})")
    return out
