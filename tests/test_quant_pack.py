"""csrc/quant_pack.c lays a weight's plain form out in the kernels' tiles: byte for byte what the numpy layout
below (quant.py's packing before it moved to C, step by step from csrc/qtile.h's header) gives, for every
format, a row count that leaves a column block partly empty, and one or more super-blocks."""

from __future__ import annotations

import numpy as np
import pytest
from kernel_helpers import needs_kernel

from devkit.ggml_blocks import random_blocks
from pagedllm.model.formats.gguf_quants import GGML_TYPES, from_gguf_blocks
from pagedllm.model.kernels import quant_linear as quant

pytestmark = needs_kernel

_NIBBLES = {"q4_1", "q4_0", "q4_k", "q5_0", "q5_1", "q5_k", "q6_k"}
_PLANE = {"q5_0": 1, "q5_1": 1, "q5_k": 1}
_OFFSET = {"q5_0": 16, "q6_k": 32, "q4_0": 8}
_TABLE = {"mxfp4", "iq4_nl", "iq4_xs"}  # 4-bit indices into a table, row quads interleaved


def _per_column(a: np.ndarray, nb: int) -> np.ndarray:
    return np.ascontiguousarray(np.pad(a, ((0, nb * 16 - a.shape[0]), (0, 0))).reshape(nb, 16, -1).transpose(0, 2, 1))


def _body(parts: quant.QuantParts, nb: int) -> np.ndarray:
    n, k = parts.shape
    c = np.pad(parts.codes, ((0, nb * 16 - n), (0, 0))).reshape(nb, 16, k // 32, 16, 2).transpose(0, 2, 3, 1, 4)
    if parts.fmt in _TABLE:  # row quads t of 64 bytes: byte 2 u + p, row 4 t + p low, row 4 t + p + 2 high, word u
        q = np.ascontiguousarray(c).reshape(nb, k // 32, 4, 4, 32)  # [.., t, row of the quad, word u]
        quad = q[..., 0:2, :] | q[..., 2:4, :] << 4  # [.., t, p, u]
        return np.ascontiguousarray(quad.swapaxes(-1, -2)).astype(np.uint8).reshape(nb, k // 32, 256)
    if parts.fmt not in _NIBBLES:
        return np.ascontiguousarray(c).view(np.uint8).reshape(nb, k // 32, -1)
    u = (c.astype(np.int16) + _OFFSET.get(parts.fmt, 0)).astype(np.uint8)
    if parts.fmt == "q6_k":  # byte j: column j/2's code, then 2 bits of 8 + j/2's; row pairs t of 32 bytes, plane
        lo, hi = (u[:, :, :, s, :].reshape(nb, k // 32, 8, 2, 2, 8) for s in (slice(0, 8), slice(8, 16)))
        codes = (lo | (hi & 3) << 6).transpose(0, 1, 2, 4, 3, 5)  # [.., pair t, byte half, row of the pair, byte]
        top = (hi >> 2).reshape(nb, k // 32, 8, 2, 2, 8)  # [.., pair t, row of the pair, byte half, byte]
        plane = top[..., 0, :] | top[..., 1, :] << 4  # per pair and row 8 bytes: bytes 0-7 low nibbles, 8-15 high
        return np.concatenate([codes.reshape(nb, k // 32, 256), plane.reshape(nb, k // 32, 128)], axis=-1)
    low = u & 15
    body = [(low[:, :, :, :8] | (low[:, :, :, 8:] << 4)).reshape(nb, k // 32, 256)]
    bits = _PLANE.get(parts.fmt, 0)
    if bits == 1:  # per row quad 16 bytes; byte j: its low nibble's bit in row 4 t + p at bit p, the high's at 4 + p
        h = (u >> 4).reshape(nb, k // 32, 4, 4, 2, 16)  # [.., row quad, row of the quad, low/high nibble, byte]
        shift = np.arange(4, dtype=np.uint8)[:, None, None] + np.array([0, 4], np.uint8)[:, None]
        plane = np.bitwise_or.reduce(h.astype(np.uint8) << shift, axis=(-3, -2))
        body.append(plane.astype(np.uint8).reshape(nb, k // 32, -1))
    return np.concatenate(body, axis=-1)


def numpy_tiles(parts: quant.QuantParts) -> np.ndarray:
    n, k = parts.shape
    nb, g = -(-n // 16), k // 32
    if parts.fmt == "mxfp4":  # the E8M0 bytes
        return np.concatenate([_per_column(parts.d, nb).reshape(nb, g, 16), _body(parts, nb)], -1).reshape(nb, -1)
    f16 = [_per_column(a, nb).astype(np.float16) for a in (parts.d, parts.m) if a is not None]
    if parts.fmt not in quant.K_FORMATS:
        head = [a.view(np.uint8).reshape(nb, g, -1) for a in f16]
        return np.concatenate(head + [_body(parts, nb)], axis=-1).reshape(nb, -1)
    per = 2 if parts.fmt in ("k8m", "k8", "q6_k") else 1
    ints = [_per_column(parts.s.view(np.uint8), nb)] + ([] if parts.mi is None else [_per_column(parts.mi, nb)])
    scales = [a.reshape(nb, g, per * 16) for a in ints]
    tiles = np.concatenate(scales + [_body(parts, nb)], axis=-1).reshape(nb, g // 8, -1)
    head = [a.view(np.uint8).reshape(nb, g // 8, 32) for a in f16]
    return np.concatenate(head + [tiles], axis=-1).reshape(nb, -1)


@pytest.mark.parametrize("ggml_type", sorted(GGML_TYPES), ids=[GGML_TYPES[t] for t in sorted(GGML_TYPES)])
@pytest.mark.parametrize("n,k", [(16, 256), (37, 512), (5, 1024)])
def test_packed_tiles_are_the_reference_layout(ggml_type, n, k):
    parts = from_gguf_blocks(random_blocks(ggml_type, n, k, n + ggml_type), ggml_type)
    w = quant.pack(parts)
    assert w.tiles.shape == (-(-n // 16), quant.col_bytes(parts.fmt, k))
    assert np.array_equal(w.tiles.numpy(), numpy_tiles(parts))


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_rounded_weights_pack_as_the_reference(fmt):
    from kernel_helpers import random_parts

    parts = random_parts(fmt, 40, 96, 3)
    assert np.array_equal(quant.pack(parts).tiles.numpy(), numpy_tiles(parts))


@pytest.mark.parametrize("ggml_type", [2, 14, 39, 20, 23], ids=["Q4_0", "Q6_K", "MXFP4", "IQ4_NL", "IQ4_XS"])
def test_pieces_of_one_format_pack_as_their_merged_weight(ggml_type):
    """q/k/v packed side by side are the tiles of the merged weight (the last piece may end in a partial block;
    pieces whose blocks would straddle two are merged first)."""
    for rows in ((32, 16, 21), (20, 16, 16)):
        pieces = [from_gguf_blocks(random_blocks(ggml_type, r, 512, r), ggml_type) for r in rows]
        want = numpy_tiles(quant.merge(pieces))
        assert np.array_equal(quant.pack_merged(pieces).tiles.numpy(), want)


def test_a_part_of_the_wrong_shape_is_refused():
    parts = from_gguf_blocks(random_blocks(12, 16, 256, 1), 12)
    bad = quant.QuantParts(parts.fmt, parts.codes, parts.d[:, :0], parts.m, parts.source, parts.s, parts.mi)
    with pytest.raises(ValueError, match="expected"):
        quant.pack(bad)


@pytest.mark.parametrize("ggml_type", [3, 14], ids=["Q4_1", "Q6_K"])
def test_packing_allocates_only_the_tiles(ggml_type):
    """Counted, not timed (tracemalloc sees numpy's buffers): the layout in numpy went through whole-array
    temporaries (codes as int16, high-bit planes as uint64) several times the tiles' size, and merged pieces
    were first copied into one weight's codes (a byte a weight)."""
    import tracemalloc

    parts = from_gguf_blocks(random_blocks(ggml_type, 512, 2048, 7), ggml_type)
    pieces = [from_gguf_blocks(random_blocks(ggml_type, r, 2048, r), ggml_type) for r in (256, 64, 64)]
    quant.pack(from_gguf_blocks(random_blocks(ggml_type, 16, 256, 7), ggml_type))  # the library loaded first
    for pack in (lambda: quant.pack(parts), lambda: quant.pack_merged(pieces)):
        tracemalloc.start()
        try:
            tiles = pack().tiles
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 1.05 * tiles.numel() + (64 << 10), (peak, tiles.numel())
