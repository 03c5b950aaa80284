"""GGML's block formats, unpacked into the kernels' plain form (quant.QuantParts) without arithmetic on values.

Why a module of its own: each GGML type packs its integers differently (nibbles, high-bit planes, 6-bit scales
split over three bytes), and the kernels want one layout per "shape" of format. Each reader here follows
gguf-py's `gguf/quants.py` dequantizer step by step, stopping before the float arithmetic: it returns the
integer codes, the integer sub-block scales and the float16 block scales, and the kernel (or
`QuantParts.dequantize`) then computes every weight exactly as gguf does, bit for bit. The codes of the common
types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, MXFP4, IQ4_NL, IQ4_XS: a byte a weight, the bulk of loading)
are unpacked in C (csrc/quant_pack.c's `gguf_codes`, the same steps); numpy takes the scales and the rarer types.

Which kernel format each type becomes, and what it costs against the file (bits a weight, resident / file):
Q4_0 q4_0 (4.5 / 4.5), Q4_1 q4_1 (5 / 5), Q5_0 q5_0 (5.5 / 5.5), Q5_1 q5_1 (6 / 6), Q8_0 q8_0 (8.5 / 8.5),
Q4_K q4_k (4.63 / 4.5), Q5_K q5_k (5.63 / 5.5), Q6_K q6_k (6.56 / 6.56), MXFP4 mxfp4 (4.25 / 4.25: the E8M0
scale kept as its byte), IQ4_NL iq4_nl (4.5 / 4.5), IQ4_XS iq4_xs (4.31 / 4.25: the 6-bit scales as int8, the
float16 d per column), F16 / BF16 as stored (16 / 16); the rarer ones wider, as bytes: Q2_K k8m (9.1 / 2.6),
Q3_K k8 (8.6 / 3.4). A type held at more than 1.1x its file's bits says so once in the log, with the factor. The
kernel formats of GGML types' layouts bear those types' names.
"""

from __future__ import annotations

import numpy as np

import pagedllm.model.kernels.cpu_kernel as cpu_kernel
from pagedllm.model.kernels.quant_linear import (
    K_FORMATS,
    SUPER,
    QuantParts,
    QuantWeight,
    log_once,
    pack_experts,
    pack_threads,
)

# GGML type number -> name; the types kept quantized (`iter_gguf`)
GGML_TYPES = {
    1: "F16",
    2: "Q4_0",
    3: "Q4_1",
    6: "Q5_0",
    7: "Q5_1",
    8: "Q8_0",
    10: "Q2_K",
    11: "Q3_K",
    12: "Q4_K",
    13: "Q5_K",
    14: "Q6_K",
    20: "IQ4_NL",
    23: "IQ4_XS",
    30: "BF16",
    39: "MXFP4",
}
_TYPE = {name: t for t, name in GGML_TYPES.items()}
_BLOCK = {  # name -> (weights, bytes) per block
    "F16": (1, 2),
    "BF16": (1, 2),
    "Q4_0": (32, 18),
    "Q4_1": (32, 20),
    "Q5_0": (32, 22),
    "Q5_1": (32, 24),
    "Q8_0": (32, 34),
    "Q2_K": (256, 84),
    "Q3_K": (256, 110),
    "Q4_K": (256, 144),
    "Q5_K": (256, 176),
    "Q6_K": (256, 210),
    "IQ4_NL": (32, 18),
    "IQ4_XS": (256, 136),
    "MXFP4": (32, 17),
}
_TILE_BITS = {"q4_1": 5.0, "q4_0": 4.5, "q5_0": 5.5, "q5_1": 6.0, "q8_0": 8.5, "q8m": 9.0, "f16": 16.0, "bf16": 16.0}
_TILE_BITS |= {"q4_k": 4.625, "q5_k": 5.625, "q6_k": 6.5625, "k8m": 9.125, "k8": 8.5625, "mxfp4": 4.25}
_TILE_BITS |= {"iq4_nl": 4.5, "iq4_xs": 4.3125}


def _f16(b: np.ndarray) -> np.ndarray:
    """[..., 2] bytes -> float16 [...]."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 2 n] bytes -> [..., 2, 2 n] low nibbles then high nibbles (gguf's `>> [0, 4]`)."""
    return np.stack([qs & 15, qs >> 4], axis=-2)


def _bits(b: np.ndarray, shifts: list[int], mask: int) -> np.ndarray:
    """[..., n] -> [..., len(shifts), n]: (b >> s) & mask for each shift s."""
    return np.stack([(b >> s) & mask for s in shifts], axis=-2)


def _scale_min_k4(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 bytes of 6-bit scales and minimums -> ([..., 8], [..., 8]) (gguf's get_scale_min)."""
    d, m, m_d = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _codes(name: str, b: np.ndarray, n: int) -> np.ndarray:
    """The codes of the types csrc/quant_pack.c reads (`gguf_codes`), int8 [n, K] in gguf's weight order (the
    4-bit ones as uint8 0..15): the bulk of a file, unpacked without numpy's whole-array temporaries."""
    k = b.shape[1] * _BLOCK[name][0]
    out = np.empty((n, k), dtype=np.int8)
    raw, lib = np.ascontiguousarray(b), cpu_kernel.load()
    if lib is None:
        raise RuntimeError("the quantized kernels are not built on this machine")
    rc = lib.gguf_codes(out.ctypes.data, raw.ctypes.data, n, k, _TYPE[name], pack_threads(n * k))
    if rc != 0:
        raise ValueError(f"cannot read {name} blocks of {n} x {k} ({rc})")
    unsigned = ("Q4_1", "Q4_K", "MXFP4", "IQ4_NL", "IQ4_XS")  # 0..15 (the IQ4 types: their table's indices)
    return out.view(np.uint8) if name in unsigned else out  # Q4_0: q - 8, -8..7


def _legacy(name: str, b: np.ndarray, n: int) -> QuantParts:
    """The types of 32-weight blocks: [n, blocks, bytes] -> q4_0 / q4_1 / q5_0 / q5_1 / q8_0 (float16 scales),
    or mxfp4 (MXFP4: the E8M0 byte, then the E2M1 nibbles as Q4_0 orders them), iq4_nl (IQ4_NL: Q4_0's layout,
    its nibbles indices into IQ4_VALUES)."""
    if name == "MXFP4":
        return QuantParts("mxfp4", _codes(name, b, n), b[..., 0].copy(), None, name)
    d = _f16(b[..., 0:2])
    codes = _codes(name, b, n)
    if name == "IQ4_NL":
        return QuantParts("iq4_nl", codes, d, None, name)
    if name == "Q8_0":
        return QuantParts("q8_0", codes, d, None, name)
    if name == "Q4_1":
        return QuantParts("q4_1", codes, d, _f16(b[..., 2:4]), name)
    if name == "Q4_0":
        return QuantParts("q4_0", codes, d, None, name)  # w = d (q - 8): gguf_codes gave q - 8
    if name == "Q5_1":
        return QuantParts("q5_1", codes, d, _f16(b[..., 2:4]), name)
    return QuantParts("q5_0", codes, d, None, name)


def _k_small(name: str, b: np.ndarray, n: int) -> QuantParts:
    """Q2_K and Q3_K: 16 sub-blocks of 16 with 4-bit (Q2_K: scale and minimum) or 6-bit signed scales."""
    if name == "Q2_K":
        scales, qs = b[..., 0:16], b[..., 16:80]
        q = _bits(qs.reshape(*qs.shape[:-1], 2, 32), [0, 2, 4, 6], 3).reshape(n, -1)
        d, dmin = _f16(b[..., 80:82]), _f16(b[..., 82:84])
        return QuantParts(
            "k8m",
            q.astype(np.int8),
            d,
            dmin,
            name,
            (scales & 15).reshape(n, -1).view(np.int8),
            (scales >> 4).reshape(n, -1),
        )
    hmask, qs, scales, d = b[..., 0:32], b[..., 32:96], b[..., 96:108], _f16(b[..., 108:110])
    low = _nibbles(scales[..., 0:8]).reshape(*scales.shape[:-1], 16)
    high = _bits(scales[..., 8:12], [0, 2, 4, 6], 3).reshape(*scales.shape[:-1], 16)
    s = ((low | (high << 4)).astype(np.int16) - 32).astype(np.int8)
    ql = _bits(qs.reshape(*qs.shape[:-1], 2, 32), [0, 2, 4, 6], 3).reshape(*qs.shape[:-1], 256)
    qh = _bits(hmask, list(range(8)), 1).reshape(*hmask.shape[:-1], 256) ^ 1  # a set bit means no -4
    q = (ql.astype(np.int8) - (qh << 2).astype(np.int8)).reshape(n, -1)
    return QuantParts("k8", q, d, None, name, s.reshape(n, -1))


def _k_large(name: str, b: np.ndarray, n: int) -> QuantParts:
    """Q4_K, Q5_K (8 sub-blocks of 32, 6-bit scales and minimums), Q6_K (16 of 16, int8 scales), IQ4_XS."""
    if name == "Q6_K":
        scales, d = b[..., 192:208], _f16(b[..., 208:210])
        return QuantParts("q6_k", _codes(name, b, n), d, None, name, scales.copy().view(np.int8).reshape(n, -1))
    if name == "IQ4_XS":
        d, sh = _f16(b[..., 0:2]), np.ascontiguousarray(b[..., 2:4]).view("<u2")  # [n, blocks, 1]
        low = _nibbles(b[..., 4:8]).swapaxes(-1, -2).reshape(*b.shape[:-1], 8)  # byte j: sub-blocks 2j, 2j + 1
        high = ((sh >> (2 * np.arange(8, dtype=np.uint16))) & 3).astype(np.uint8)
        s = ((low | (high << 4)).astype(np.int16) - 32).astype(np.int8)
        return QuantParts("iq4_xs", _codes(name, b, n), d, None, name, s.reshape(n, -1))
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    sc, mn = _scale_min_k4(b[..., 4:16])
    fmt = "q4_k" if name == "Q4_K" else "q5_k"
    return QuantParts(fmt, _codes(name, b, n), d, dmin, name, sc.reshape(n, -1).view(np.int8), mn.reshape(n, -1))


def from_gguf_blocks(raw: np.ndarray, ggml_type: int) -> QuantParts:
    """raw: uint8 [N, row bytes] as stored in the file (a view of the mapped file is fine) -> QuantParts (no
    arithmetic on values) whose arrays are all new: none is a view of `raw`."""
    name = GGML_TYPES[ggml_type]
    n = raw.shape[0]
    if name in ("F16", "BF16"):
        parts = QuantParts(name.lower(), np.array(raw, order="C").view(np.uint16).reshape(n, -1), None, None, name)
    else:
        b = np.ascontiguousarray(raw).reshape(n, -1, _BLOCK[name][1])
        read = _legacy if _BLOCK[name][0] == 32 else _k_small if name in ("Q2_K", "Q3_K") else _k_large
        parts = read(name, b, n)
    _note_width(name, parts.fmt)
    return parts


def experts_from_gguf(raws: list[np.ndarray], ggml_types: list[int]) -> list[QuantWeight]:
    """The experts of MoE GGUF tensors as stored, uint8 [n_expert, N, row bytes] each (`ffn_gate_exps` with
    `ffn_up_exps`, merged along N as a dense gate/up is, or `ffn_down_exps` alone; views of the mapped file are
    fine), one QuantWeight per expert, all in one buffer (quant.pack_experts). Why this way: a row of a GGUF
    tensor is whole blocks, so expert e is the slice raw[e], a view; it is read like a 2-D tensor and packed
    straight into its place, so nothing is dequantized and no more than one expert's plain form is ever held.
    With GGUFFile: gf.load_raw(gate, lambda g: gf.load_raw(up, lambda u: experts_from_gguf([g, u], types)))."""
    count = raws[0].shape[0]
    for raw, t in zip(raws, ggml_types):
        if raw.ndim != 3 or raw.shape[0] != count or t not in GGML_TYPES:
            raise ValueError(f"expert tensors of shapes {[r.shape for r in raws]} and types {ggml_types}")
    return pack_experts(count, lambda e: [from_gguf_blocks(raw[e], t) for raw, t in zip(raws, ggml_types)])


def block_shape(ggml_type: int) -> tuple[int, int]:
    """(weights, bytes) of one block of a type kept quantized."""
    return _BLOCK[GGML_TYPES[ggml_type]]


def _note_width(name: str, fmt: str) -> None:
    """One line per type held wider than the file stores it: what it costs in memory."""
    weights, nbytes = _BLOCK[name]
    file_bits, bits = 8 * nbytes / weights, _TILE_BITS[fmt]
    if bits > 1.1 * file_bits:
        log_once(
            f"{name} tensors are held as {bits:.2f} bits a weight ({fmt}), {bits / file_bits:.2f}x the file's "
            f"{file_bits:.2f}: exact values, more memory than the file (still far below dense)"
        )


__all__ = ["GGML_TYPES", "K_FORMATS", "SUPER", "block_shape", "experts_from_gguf", "from_gguf_blocks"]
