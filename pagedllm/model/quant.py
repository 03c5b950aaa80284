"""Weight-only quantized linear layers: GGUF Q4_0 / Q4_1 / Q8_0 tensors kept as stored, or Hugging Face weights
rounded to int8 / int4 at load (`--quantization int8|int4`), run by the C kernels in csrc/quant_matmul.c.

Why keep them quantized: a decode step reads every weight once, so with few sequences per step its time is
the weights' bytes over the memory bandwidth. The default model is 96 MB as stored and 269 MB (bfloat16) or
540 MB (float32) dequantized.

Two formats cover the four sources, both in groups of 32 along the input dimension:
- "q4": w = d * q + m, q in 0..15 (Q4_1 as stored; Q4_0 is m = -8 d; int4 is round-to-nearest between the
  group's minimum and maximum);
- "q8": w = d * q, q in -128..127 (Q8_0 as stored; int8 is symmetric round-to-nearest).
d and m are float16, the file's own numbers, so the dequantized weights equal the file's values exactly.
`QuantParts` is the plain form (codes [N, K], scales [N, K/32]) in which rows are un-permuted and q/k/v or
gate/up merged; `pack` then lays it out in the kernel's tiles (see the C file's header).
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

import pagedllm.model.cpu_kernel as cpu_kernel

log = logging.getLogger("pagedllm.model")
_said: set[str] = set()

GROUP = 32
FORMATS = {"q4": 0, "q8": 1}
TILE_BYTES = {"q4": 64 + 256, "q8": 32 + 512}
# GGML type number -> (format, bytes per block of 32)
GGML_TYPES = {2: ("q4_0", 18), 3: ("q4_1", 20), 8: ("q8_0", 34)}


def log_once(message: str) -> None:
    """A fallback is worth one warning, not one per tensor or per call."""
    if message not in _said:
        _said.add(message)
        log.warning(message)


@dataclass
class QuantParts:
    """A quantized weight [N, K] in plain form: codes (uint8 0..15 for q4, int8 for q8), float16 scales."""

    fmt: str  # "q4" | "q8"
    codes: np.ndarray  # [N, K]
    d: np.ndarray  # [N, K/32] float16
    m: np.ndarray | None  # [N, K/32] float16 (q4 only)
    source: str  # "Q4_1", "Q8_0", "int4", ... for messages

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape[0], self.codes.shape[1]

    def rows(self, index: np.ndarray) -> QuantParts:
        """The same weight with its rows (output features) reordered, e.g. GGUF's Q/K un-permutation."""
        return QuantParts(self.fmt, self.codes[index], self.d[index], None if self.m is None else self.m[index],
                          self.source)

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K], computed as the GGUF reference does (d * q + m in float32)."""
        n, k = self.shape
        q = self.codes.astype(np.float32).reshape(n, k // GROUP, GROUP)
        w = q * self.d.astype(np.float32)[..., None]
        if self.m is not None:
            w = w + self.m.astype(np.float32)[..., None]
        return torch.from_numpy(w.reshape(n, k))


def merge(parts: list[QuantParts]) -> QuantParts | None:
    """Stack weights along N (q/k/v, gate/up) into one; None when their formats differ."""
    if len({p.fmt for p in parts}) != 1:
        return None
    m = None if parts[0].m is None else np.concatenate([p.m for p in parts])
    return QuantParts(parts[0].fmt, np.concatenate([p.codes for p in parts]), np.concatenate([p.d for p in parts]),
                      m, "+".join(sorted({p.source for p in parts})))


def from_gguf_blocks(raw: np.ndarray, ggml_type: int) -> QuantParts | None:
    """raw: uint8 [N, K/32 * block bytes] as stored in the file -> QuantParts (no arithmetic on values); None
    for a Q4_0 tensor whose -8 d would overflow float16 (it is then dequantized instead)."""
    name, nbytes = GGML_TYPES[ggml_type]
    n = raw.shape[0]
    b = np.ascontiguousarray(raw).reshape(n, -1, nbytes)
    d = b[..., 0:2].copy().view(np.float16)[..., 0]
    if name == "q8_0":
        codes = b[..., 2:34].copy().view(np.int8).reshape(n, -1)
        return QuantParts("q8", codes, d, None, "Q8_0")
    qs = b[..., 4:20] if name == "q4_1" else b[..., 2:18]
    codes = np.concatenate([qs & 15, qs >> 4], axis=-1).reshape(n, -1)
    if name == "q4_1":
        m = b[..., 2:4].copy().view(np.float16)[..., 0]
    else:  # Q4_0: w = d * (q - 8) = d * q + (-8 d), and -8 d is exact in float16 unless it overflows
        m = (d.astype(np.float32) * -8).astype(np.float16)
        if not np.isfinite(m).all():
            return None
    return QuantParts("q4", codes, d, m, name.upper())


def quantize_rtn(w: torch.Tensor, bits: int) -> QuantParts:
    """Round-to-nearest weight-only quantization in groups of 32 (int8 symmetric, int4 min/max)."""
    n, k = w.shape
    g = w.detach().float().reshape(n, k // GROUP, GROUP)
    if bits == 8:
        d = (g.abs().amax(-1) / 127).to(torch.float16)
        df = d.float().clamp(min=torch.finfo(torch.float16).tiny)
        q = torch.round(g / df[..., None]).clamp(-127, 127).to(torch.int8)
        return QuantParts("q8", q.reshape(n, k).numpy(), d.numpy(), None, "int8")
    lo, hi = g.amin(-1), g.amax(-1)
    d = ((hi - lo) / 15).to(torch.float16)
    m = lo.to(torch.float16)
    df = d.float().clamp(min=torch.finfo(torch.float16).tiny)
    q = torch.round((g - m.float()[..., None]) / df[..., None]).clamp(0, 15).to(torch.uint8)
    return QuantParts("q4", q.reshape(n, k).numpy(), d.numpy(), m.numpy(), "int4")


def _tiles(parts: QuantParts) -> np.ndarray:
    """QuantParts -> uint8 [ceil(N/16), K/32, tile bytes] in the kernel's order."""
    n, k = parts.shape
    nb, g = -(-n // 16), k // GROUP
    pad = nb * 16 - n
    codes = np.pad(parts.codes, ((0, pad), (0, 0))).reshape(nb, 16, g, 16, 2).transpose(0, 2, 3, 1, 4)
    d = np.pad(parts.d, ((0, pad), (0, 0))).reshape(nb, 16, g).transpose(0, 2, 1)
    head = [d.copy().view(np.uint8)]  # [nb, g, 32]
    if parts.fmt == "q4":
        m = np.pad(parts.m, ((0, pad), (0, 0))).reshape(nb, 16, g).transpose(0, 2, 1)
        head.append(m.copy().view(np.uint8))
        c = codes.astype(np.uint8)  # [nb, g, 16 rows, 16 cols, 2]
        body = (c[:, :, :, :8] | (c[:, :, :, 8:] << 4)).reshape(nb, g, 256)
    else:
        body = codes.view(np.uint8).reshape(nb, g, 512)
    return np.concatenate(head + [body], axis=-1)


@dataclass
class QuantWeight:
    """A packed weight ready for the kernels: `tiles` is all that stays in memory."""

    fmt: str
    n: int
    k: int
    tiles: torch.Tensor  # uint8 [ceil(n/16), k/32, tile bytes]
    source: str
    amx_min_rows: int = 0  # bfloat16 inputs of at least this many rows run on AMX (kernel_choice.py); 0: never

    @property
    def nbytes(self) -> int:
        return self.tiles.numel()


def pack(parts: QuantParts) -> QuantWeight:
    n, k = parts.shape
    if k % GROUP:
        raise ValueError(f"input size {k} is not a multiple of {GROUP}")
    return QuantWeight(parts.fmt, n, k, torch.from_numpy(_tiles(parts)), parts.source)


def _lib() -> ctypes.CDLL:
    lib = cpu_kernel.load()
    if lib is None:
        raise RuntimeError("the quantized kernels are not built on this machine")
    return lib


@lru_cache(maxsize=1)
def amx_available() -> bool:
    """Whether the bfloat16 AMX kernel can run here (built with AMX, and the OS grants the tiles)."""
    lib = cpu_kernel.load()
    return lib is not None and bool(lib.qmm_amx_available())


def qlinear(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None,
            out: torch.Tensor | None = None, accumulate: bool = False) -> torch.Tensor:
    """x [..., K] @ w.T (+ bias); the result in x's dtype. float32 activations always take the float32 kernel
    (exact weights, sums in a fixed order); bfloat16 ones take AMX from `w.amx_min_rows` rows on where the CPU
    has it. `out` (float32, contiguous rows) is written in place, or added to with `accumulate`."""
    lead = x.shape[:-1]
    xf = x.reshape(-1, w.k)
    m = xf.shape[0]
    amx = x.dtype == torch.bfloat16 and 0 < w.amx_min_rows <= m and amx_available()
    if xf.dtype != torch.float32 or xf.stride(-1) != 1:
        xf = xf.float().contiguous()
    res = out if out is not None else torch.empty(m, w.n, dtype=torch.float32)
    b = None if bias is None else bias.float().contiguous()
    fn = _lib().qmm_amx if amx else _lib().qmm_f32
    rc = fn(res.data_ptr(), xf.data_ptr(), w.tiles.data_ptr(), None if b is None else b.data_ptr(), m, w.n, w.k,
            xf.stride(0), res.stride(0), FORMATS[w.fmt], int(accumulate), torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"quantized matmul failed ({rc})")
    if out is not None:
        return out
    return res.reshape(*lead, w.n).to(x.dtype)


def qrows(w: QuantWeight, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of the weight as float32 [len(ids), K]: the embedding lookup of a quantized table."""
    ids = ids.to(torch.int64).contiguous()
    out = torch.empty(ids.numel(), w.k, dtype=torch.float32)
    rc = _lib().qrows_f32(out.data_ptr(), ids.data_ptr(), ids.numel(), w.tiles.data_ptr(), w.n, w.k,
                          FORMATS[w.fmt])
    if rc != 0:
        raise RuntimeError("qrows_f32: a token id outside the table" if rc == -3 else f"qrows_f32 failed ({rc})")
    return out
