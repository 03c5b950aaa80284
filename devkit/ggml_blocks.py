"""Random GGML blocks of every type, made byte by byte: what the dequantizer and kernel tests compare against
gguf-py, and what the kernel benchmarks time (speed does not depend on the values); and `widened`, the IQ4 types
as they ran before they were kept as stored (the reference route of their tests and benchmark)."""

from __future__ import annotations

import numpy as np

from pagedllm.model.formats.gguf_quants import GGML_TYPES, block_shape
from pagedllm.model.kernels import quant_linear as quant

_F16_FIELDS = {
    "Q4_0": [(0, 1)],
    "Q4_1": [(0, 2)],
    "Q5_0": [(0, 1)],
    "Q5_1": [(0, 2)],
    "Q8_0": [(0, 1)],
    "Q2_K": [(80, 2)],
    "Q3_K": [(108, 1)],
    "Q4_K": [(0, 2)],
    "Q5_K": [(0, 2)],
    "Q6_K": [(208, 1)],
    "IQ4_NL": [(0, 1)],
    "IQ4_XS": [(0, 1)],
}


def random_blocks(ggml_type: int, n: int, k: int, seed: int, scale: float = 0.01) -> np.ndarray:
    """uint8 [n, row bytes]: random bytes, the float16 fields small finite numbers (F16 / BF16: random values;
    MXFP4: its E8M0 byte 2^(e - 128) within 8x of `scale`)."""
    rng = np.random.default_rng(seed)
    name = GGML_TYPES[ggml_type]
    if name in ("F16", "BF16"):
        x = rng.normal(0, 1, (n, k)).astype(np.float32)
        raw = x.astype(np.float16).view(np.uint16) if name == "F16" else (x.view(np.uint32) >> 16).astype(np.uint16)
        return raw.view(np.uint8).reshape(n, -1)
    weights, nbytes = block_shape(ggml_type)
    raw = rng.integers(0, 256, (n, k // weights, nbytes), dtype=np.uint8)
    if name == "MXFP4":
        e = 128 + round(float(np.log2(scale)))
        raw[..., 0] = rng.integers(e - 3, e + 4, (n, k // weights), dtype=np.uint8)
    for offset, count in _F16_FIELDS.get(name, []):
        f16 = rng.normal(0, scale, (n, k // weights, count)).astype(np.float16)
        raw[..., offset : offset + 2 * count] = f16.view(np.uint8).reshape(n, k // weights, 2 * count)
    return raw.reshape(n, -1)


def widened(parts: quant.QuantParts) -> quant.QuantParts:
    """IQ4_NL / IQ4_XS widened as the loader once did: their table's values as byte codes (q8_0; k8 with each
    32-input scale for both of its halves of 16), the same weights at ~1.9x the bits; other parts as they are."""
    if parts.fmt not in ("iq4_nl", "iq4_xs"):
        return parts
    values = quant.IQ4_VALUES[parts.codes]
    if parts.fmt == "iq4_nl":
        return quant.QuantParts("q8_0", values, parts.d, None, parts.source)
    assert parts.s is not None
    return quant.QuantParts("k8", values, parts.d, None, parts.source, np.repeat(parts.s, 2, axis=1))
