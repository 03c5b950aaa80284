"""Every common GGML type run as stored: random blocks made byte by byte (random bytes, with the float16 scale
fields set to small finite numbers, MXFP4's E8M0 byte to a matching power of two), gguf's own dequantizer
(`gguf.quants.dequantize`) as the reference.

Per CPU class this machine can run (native, x86-64-v4, x86-64-v3, portable), each built once for the module:
the kernel's weights equal gguf's bit for bit (the embedding lookup returns them), its matmul equals a float64
product with them for 1 and 3 rows (direct route) and 17 and 64 (panel route), and the rows of a small batch
are bit-identical to the same rows in a large one. Then a GGUF written with llama.cpp's kind of type mix
(Q4_K, Q6_K for attn_v / ffn_down / output as Q4_K_M does, and Q5_K / Q5_0 / Q8_0 in another layer) loads
with every matrix quantized, near the file's size, and decodes the same greedy tokens as the same file with
its weights dequantized by gguf.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch
from kernel_helpers import needs_kernel

from devkit.ggml_blocks import random_blocks, widened
from pagedllm.model import ModelRunner, SeqChunk, loader
from pagedllm.model.formats.gguf_quants import GGML_TYPES, block_shape, experts_from_gguf, from_gguf_blocks
from pagedllm.model.kernels import cpu_kernel
from pagedllm.model.kernels import quant_linear as quant

pytestmark = needs_kernel
gguf = pytest.importorskip("gguf")


def reference(raw: np.ndarray, ggml_type: int, k: int) -> np.ndarray:
    return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(ggml_type)).astype(np.float32).reshape(-1, k)


@pytest.fixture(scope="module", params=cpu_kernel.runnable_targets())
def lib(request):
    """One class's kernels, built (or found built) once for the module."""
    built = cpu_kernel.load(request.param)
    assert built is not None, f"the {request.param} build failed (see the warning logged)"
    return built


def _run(lib: ctypes.CDLL, route: str, x: np.ndarray, w: quant.QuantWeight, bias: np.ndarray) -> np.ndarray:
    """x @ w.T + bias through the C entry point `route` (qmm_f32: float32 activations; qmm_dot: the dot route)."""
    out = np.empty((x.shape[0], w.n), np.float32)
    rc = getattr(lib, route)(
        out.ctypes.data, x.ctypes.data, w.tiles.data_ptr(), bias.ctypes.data, x.shape[0], w.n, w.k, w.k, w.n,
        quant.FORMATS[w.fmt], 0, 2,
    )  # fmt: skip
    assert rc == 0, rc
    return out


def _matmul(lib: ctypes.CDLL, x: np.ndarray, w: quant.QuantWeight, bias: np.ndarray) -> np.ndarray:
    return _run(lib, "qmm_f32", x, w, bias)


def _rows(lib: ctypes.CDLL, w: quant.QuantWeight) -> np.ndarray:
    out, ids = np.empty((w.n, w.k), np.float32), np.arange(w.n, dtype=np.int64)
    assert lib.qrows_f32(out.ctypes.data, ids.ctypes.data, w.n, w.tiles.data_ptr(), w.n, w.k, quant.FORMATS[w.fmt]) == 0
    return out


def _check_kernel(lib: ctypes.CDLL, w: quant.QuantWeight, ref: np.ndarray, seed: int) -> None:
    """The stored weights read back exactly; the matmul against float64 at every route; batch invariance."""
    assert np.array_equal(_rows(lib, w), ref)
    rng = np.random.default_rng(seed)
    x, bias = rng.standard_normal((64, w.k)).astype(np.float32), rng.standard_normal(w.n).astype(np.float32)
    want = x.astype(np.float64) @ ref.T.astype(np.float64) + bias
    full = _matmul(lib, x, w, bias)
    tol = 1e-5 * np.abs(want).max()
    for rows in (1, 3, 8, 13, 17, 64):  # direct; panel in blocks of 4 + 4, 7 + 6 (AVX-512) ...
        got = _matmul(lib, x[:rows], w, bias)
        np.testing.assert_allclose(got, want[:rows], atol=tol, rtol=0)
        assert np.array_equal(got, full[:rows]), f"{rows} rows differ from the same rows in 64"


@pytest.mark.parametrize("ggml_type", sorted(GGML_TYPES), ids=[GGML_TYPES[t] for t in sorted(GGML_TYPES)])
def test_every_type_runs_with_the_files_exact_values(lib, ggml_type):
    k = 512 if block_shape(ggml_type)[0] == 256 else 96  # 37 columns: two full blocks of 16 and a clipped one
    raw = random_blocks(ggml_type, 37, k, ggml_type)
    ref = reference(raw, ggml_type, k)
    parts = from_gguf_blocks(raw, ggml_type)
    assert np.array_equal(parts.dequantize().numpy(), ref)
    w = quant.pack(parts)
    assert w.tiles.numel() == -(-37 // 16) * quant.col_bytes(w.fmt, k)  # Python's layout is the C library's
    _check_kernel(lib, w, ref, ggml_type)
    _check_bf16_kernel(lib, w, ref, ggml_type)


def _bf16(a: np.ndarray) -> np.ndarray:
    """float32 rounded to bfloat16 (nearest even), as float64."""
    return torch.from_numpy(np.ascontiguousarray(a, np.float32)).bfloat16().double().numpy()


def _check_bf16_kernel(lib: ctypes.CDLL, w: quant.QuantWeight, ref: np.ndarray, seed: int) -> None:
    """The bfloat16 route (AMX, or vdpbf16ps on AVX-512 BF16): x and the stored weights rounded to bfloat16, sums
    in float32, so within float32 rounding of a float64 product of the rounded values; a row's result does not
    depend on the rows beside it in the 16-row tiles of x. A class without either says so (-6)."""
    rng = np.random.default_rng(seed)
    x, bias = rng.standard_normal((40, w.k)).astype(np.float32), rng.standard_normal(w.n).astype(np.float32)
    out = np.empty((40, w.n), np.float32)

    def run(rows: int, dst: np.ndarray, accumulate: int = 0) -> int:
        args = (x.ctypes.data, w.tiles.data_ptr(), bias.ctypes.data, rows, w.n, w.k, w.k, w.n)
        return lib.qmm_amx(dst.ctypes.data, *args, quant.FORMATS[w.fmt], accumulate, 2)

    if not lib.qmm_bf16_kind():
        assert run(40, out) == -6
        return
    want = _bf16(x) @ _bf16(ref).T + bias
    assert run(40, out) == 0
    np.testing.assert_allclose(out, want, atol=1e-5 * np.abs(want).max(), rtol=0)
    for rows in (1, 7, 9, 16, 17, 33):
        got = np.empty((rows, w.n), np.float32)
        assert run(rows, got) == 0
        assert np.array_equal(got, out[:rows]), f"{rows} rows differ from the same rows in 40"
    again = out.copy()
    assert run(40, again, accumulate=1) == 0
    assert np.array_equal(again, 2 * out)  # added to the output: out + (the same product + bias)


def test_mxfp4_reads_every_scale_byte_as_gguf_does(lib):
    """Each of the 256 E8M0 bytes with every code, through the numpy reader and the kernel's own lookup (the
    embedding lookup returns the weights as the matmul sees them), bit for bit gguf's (the sign of zero too):
    0 and 1 the subnormal scales 2^-128, 2^-127; 255 is 2^127 as llama.cpp and gguf-py read it (not OCP MX's
    NaN), so that its codes of magnitude 2 and more are +-inf there, and here. Then the matmul of the smallest
    scales (subnormal weights) against float64 on the float32 route."""
    rng = np.random.default_rng(39)
    raw = np.empty((16, 16, 17), dtype=np.uint8)  # 16 rows x 16 blocks: every scale byte once
    raw[..., 0] = np.arange(256, dtype=np.uint8).reshape(16, 16)
    low, high = (np.argsort(rng.random((16, 16, 16)), axis=-1) for _ in range(2))  # every code in each half
    raw[..., 1:] = low | high << 4
    raw = raw.reshape(16, -1)
    with np.errstate(over="ignore"):
        ref = reference(raw, 39, 512)
        parts = from_gguf_blocks(raw, 39)
        assert np.array_equal(parts.dequantize().numpy().view(np.uint32), ref.view(np.uint32))
    w = quant.pack(parts)
    assert w.fmt == "mxfp4" and w.nbytes == 512 * 16 * 17 // 32  # 4.25 bits a weight, as the file
    assert np.array_equal(_rows(lib, w).view(np.uint32), ref.view(np.uint32))
    top = ref[15, 15 * 32 : 16 * 32]  # scale byte 255
    assert np.isfinite(top).any() and np.isinf(top).any() and not np.isnan(ref).any()
    small = raw.reshape(16, 16, 17).copy()
    small[..., 0] = rng.integers(0, 4, (16, 16), dtype=np.uint8)
    small = small.reshape(16, -1)
    _check_kernel(lib, quant.pack(from_gguf_blocks(small, 39)), reference(small, 39, 512), 39)


def test_merged_weight_of_mixed_types(lib):
    """q/k/v of a Q4_K_M file (Q4_K, Q4_K, Q6_K) and a Q8_0 piece stay in their own formats in one weight."""
    pieces = [(12, 32), (12, 16), (14, 48), (8, 21)]
    raws = [random_blocks(t, n, 512, i) for i, (t, n) in enumerate(pieces)]
    w = quant.pack_merged([from_gguf_blocks(r, t) for r, (t, _) in zip(raws, pieces)])
    assert w is not None and w.fmt == "mixed" and w.n == 117
    ref = np.concatenate([reference(r, t, 512) for r, (t, _) in zip(raws, pieces)])
    _check_kernel(lib, w, ref, 7)
    _check_bf16_kernel(lib, w, ref, 7)
    inner_odd = [from_gguf_blocks(random_blocks(t, n, 512, 1), t) for t, n in ((12, 20), (14, 16))]
    assert quant.pack_merged(inner_odd) is None  # a type change inside a block of 16 rows: the caller runs dense


@pytest.mark.parametrize(
    "types",
    [(39, 39), (2, 2), (12, 14), (1, 1), (20, 20), (23, 23)],
    ids=["MXFP4", "Q4_0", "Q4_K+Q6_K", "F16", "IQ4_NL", "IQ4_XS"],
)
def test_the_experts_of_3d_tensors_are_slices_of_their_blocks(types):
    """ffn_gate_exps and ffn_up_exps [n_expert, N, K] as stored: expert e's weight is its gate and up merged
    from its slices of the blocks, exactly expert e of gguf's dequantized tensors; the experts lie in one buffer
    at a fixed stride (what a grouped kernel indexes), resident at no more than 1.1x the file's bytes (the
    issue's "experts as stored": IQ4_NL exactly the file's, IQ4_XS 1.015x), and packing holds one expert's plain
    form at a time."""
    import tracemalloc

    n_exp, n, k = 6, 32, 512
    raws = [random_blocks(t, n_exp * n, k, seed).reshape(n_exp, n, -1) for seed, t in enumerate(types)]
    ref = [reference(r.reshape(n_exp * n, -1), t, k).reshape(n_exp, n, k) for r, t in zip(raws, types)]
    lib = cpu_kernel.load()
    experts_from_gguf(raws[:1], types[:1])  # the library loaded first
    tracemalloc.start()
    try:
        weights = experts_from_gguf(raws, list(types))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    size = weights[0].nbytes
    assert n_exp * size <= 1.1 * sum(r.nbytes for r in raws)
    if types == (20, 20):
        assert n_exp * size == sum(r.nbytes for r in raws)
    plain = 2 * n * k * (2 if types[0] == 1 else 1)  # one expert's codes, gate and up
    assert peak < n_exp * size + 1.5 * plain + (64 << 10), (peak, n_exp * size, plain)
    for e, w in enumerate(weights):
        assert w.n == 2 * n and w.nbytes == size and w.tiles.data_ptr() == weights[0].tiles.data_ptr() + e * size
        assert np.array_equal(_rows(lib, w), np.concatenate([r[e] for r in ref]))
    with pytest.raises(ValueError, match="expert tensors"):
        experts_from_gguf([raws[0], raws[1][:2]], list(types))


def _assert_accumulates(
    lib: ctypes.CDLL, route: str, x: np.ndarray, w: quant.QuantWeight, bias: np.ndarray, alone: np.ndarray, rng
) -> None:
    """With its accumulate flag `route` adds x @ w.T + bias (`alone`, computed a row at a time) to what the output
    holds, bit for bit."""
    before = rng.standard_normal((x.shape[0], w.n)).astype(np.float32)
    out = before.copy()
    rc = getattr(lib, route)(
        out.ctypes.data, x.ctypes.data, w.tiles.data_ptr(), bias.ctypes.data, x.shape[0], w.n, w.k, w.k, w.n,
        quant.FORMATS[w.fmt], 1, 2,
    )  # fmt: skip
    assert rc == 0 and np.array_equal(out, before + alone)


def _dot(lib: ctypes.CDLL, x: np.ndarray, w: quant.QuantWeight, bias: np.ndarray) -> np.ndarray:
    return _run(lib, "qmm_dot", x, w, bias)


def rounded_16(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x rounded as the dot route rounds it (csrc qdot_quantize_row, in float32): codes and scale per 32."""
    g = x.reshape(x.shape[0], -1, 32).astype(np.float32)
    amax = np.abs(g).max(-1, keepdims=True)
    inv = np.where(amax > 0, np.float32(32767) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    return np.rint(g * inv), np.where(inv > 0, amax / np.float32(32767), 0).astype(np.float32)


def test_rounding_to_16_bits_is_exact_on_every_class(lib):
    """qdot_quantize_row, vectorized per class, gives the scalar definition's codes, scales and sums exactly:
    round half to even, NaN to 0 and left out of the group's max, an infinite group to scale 0, clamped."""
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((9, 96)) * rng.choice([1e-30, 1e-3, 1.0, 1e30], (9, 3)).repeat(32, 1)).astype(np.float32)
    x[1, :32] = np.float32(0.5) * np.arange(-16, 16)  # inv = 32767 / 8: products whose halves tie
    x[2, 3], x[2, 40], x[2, 70:] = np.nan, np.inf, -0.0
    x[3, :32] = 0
    x[4, 5], x[4, 9] = 3.2e38, -np.inf
    x[5, :] = rng.standard_normal(96).astype(np.float32) * 1e-42  # subnormal inputs
    q, d = np.empty((9, 96), np.int16), np.empty((9, 3), np.float32)
    s = np.empty((9, 6), np.int32)
    for m in range(9):
        lib.qdot_quantize_row(q[m].ctypes.data, d[m].ctypes.data, s[m].ctypes.data, x[m].ctypes.data, 96)
    g = x.reshape(9, 3, 32)
    with np.errstate(invalid="ignore", over="ignore"):
        amax = np.fmax.reduce(np.abs(g), axis=-1, initial=0)  # fmax: NaN left out
        ok = (amax > 0) & (amax <= np.float32(3.0e38))
        inv = np.where(ok, np.float32(32767) / np.where(ok, amax, 1), 0).astype(np.float32)
        v = np.rint(g * inv[..., None])
    want = np.clip(np.where(np.isnan(v), 0, v), -32767, 32767).astype(np.int16)  # subnormal groups: inv = inf
    assert np.array_equal(q.reshape(9, 3, 32), want)
    assert np.array_equal(d, np.where(inv > 0, amax / np.float32(32767), 0).astype(np.float32))
    assert np.array_equal(s, want.reshape(9, 6, 16).astype(np.int32).sum(-1))


@pytest.mark.parametrize("ggml_type", sorted(GGML_TYPES), ids=[GGML_TYPES[t] for t in sorted(GGML_TYPES)])
def test_the_dot_route_is_the_weights_times_the_rounded_activations(lib, ggml_type):
    """16-bit activations: the result is the file's exact weights times x as rounded (a float64 reference), so
    within half a step of each group's scale of the float32 route, for 1-11 rows on every class; a row does not
    depend on the batch (passes of 4 and fewer rows). The types the route does not run take the float32
    direct route, bit for bit."""
    k = 512 if block_shape(ggml_type)[0] == 256 else 96
    raw = random_blocks(ggml_type, 37, k, ggml_type)
    ref = reference(raw, ggml_type, k).astype(np.float64)
    w = quant.pack(from_gguf_blocks(raw, ggml_type))
    rng = np.random.default_rng(ggml_type)
    x, bias = rng.standard_normal((11, k)).astype(np.float32), rng.standard_normal(w.n).astype(np.float32)
    x[1] *= 1e-30  # tiny groups, and an all-zero group (its scale 0), round like the others
    x[2, :32] = 0
    codes, scale = rounded_16(x)
    want = np.einsum("mgk,ngk->mn", codes * scale.astype(np.float64), ref.reshape(w.n, -1, 32)) + bias
    full = _dot(lib, x, w, bias)
    if w.fmt not in quant.DOT_FORMATS:  # the float32 direct route
        assert np.array_equal(full, _matmul(lib, x, w, bias))
        return
    np.testing.assert_allclose(full, want, atol=1e-5 * np.abs(want).max(), rtol=0)
    exact = x.astype(np.float64) @ ref.T + bias
    bound = (np.abs(ref).reshape(w.n, -1, 32).sum(-1) @ (scale[..., 0].T / 2)).T  # [m, n]: half a step a weight
    assert np.all(np.abs(full - exact) <= bound + 1e-5 * np.abs(exact).max())
    for rows in (1, 2, 3, 4, 5, 8, 9):
        assert np.array_equal(_dot(lib, x[:rows], w, bias), full[:rows]), f"{rows} rows differ from 11"


def _dot_weight(kind: str, n: int) -> quant.QuantWeight:
    """A weight of each format the dot route runs: a GGML type's random blocks, or q8m (w = d q + m, int8 q)."""
    if kind == "q8m":
        rng = np.random.default_rng(7)
        g = 13
        d, m = (rng.normal(0, s, (n, g)).astype(np.float16) for s in (0.001, 0.05))
        return quant.pack(quant.QuantParts("q8m", rng.integers(-128, 128, (n, 32 * g)).astype(np.int8), d, m, "test"))
    ggml_type = next(t for t, name in GGML_TYPES.items() if name == kind)
    k = 1280 if block_shape(ggml_type)[0] == 256 else 416  # 40 groups, or 13 (not a multiple of 8)
    return quant.pack(from_gguf_blocks(random_blocks(ggml_type, n, k, ggml_type), ggml_type))


@pytest.mark.parametrize(
    "kind", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "q8m", "Q4_K", "Q5_K", "Q6_K", "MXFP4", "IQ4_NL", "IQ4_XS"]
)
def test_the_dot_route_at_many_rows_is_the_one_row_route_bit_for_bit(lib, kind):
    """Whatever the dot route runs at a row count (block_dot in passes of a few rows, then one of the rest; from
    32 rows on AVX2 and 64 on AVX-512 the panel path: the block's codes widened once, rows in blocks of 32 and
    groups in slices of 8, 13 groups leaving a short slice), each row's result must be the one-row route's bit
    for bit at every row count up to prefill chunks, on every class (VNNI, AVX-512 without it, AVX2), for each
    format the route runs, with a clipped last column block, the bias, and added to the output: a sequence's
    output never depends on the batch."""
    w = _dot_weight(kind, 37)
    assert w.fmt in quant.DOT_FORMATS
    rng = np.random.default_rng(len(kind))
    x, bias = rng.standard_normal((140, w.k)).astype(np.float32), rng.standard_normal(w.n).astype(np.float32)
    x[1] *= 1e-30
    x[2, :32] = 0
    x[3] *= 1e4
    alone = np.concatenate([_dot(lib, x[i : i + 1], w, bias) for i in range(140)])
    for rows in (7, 8, 13, 31, 32, 33, 37, 63, 64, 65, 77, 129, 140):
        got = _dot(lib, x[:rows], w, bias)
        assert np.array_equal(got, alone[:rows]), f"{rows} rows: not the one-row route's result"
    _assert_accumulates(lib, "qmm_dot", x, w, bias, alone, rng)


def _i8(lib: ctypes.CDLL, x: np.ndarray, w: quant.QuantWeight, bias: np.ndarray) -> np.ndarray:
    return _run(lib, "qmm_i8", x, w, bias)


def rounded_8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x rounded as the int8 route rounds it (csrc qi8_quantize_row, llama.cpp's Q8_0 activations, in float32):
    codes and scale per group of 32."""
    g = x.reshape(x.shape[0], -1, 32).astype(np.float32)
    amax = np.abs(g).max(-1, keepdims=True)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    return np.clip(np.rint(g * inv), -127, 127), np.where(inv > 0, amax / np.float32(127), 0).astype(np.float32)


def test_rounding_to_8_bits_is_exact_on_every_class(lib):
    """qi8_quantize_row, vectorized per class, gives the scalar definition's codes, scales and sums exactly:
    round half to even, NaN to 0 and left out of the group's max, an infinite group to scale 0, clamped."""
    rng = np.random.default_rng(8)
    x = (rng.standard_normal((9, 96)) * rng.choice([1e-30, 1e-3, 1.0, 1e30], (9, 3)).repeat(32, 1)).astype(np.float32)
    x[1, :32] = np.float32(0.5) * np.arange(-16, 16) * np.float32(8 / 127)  # ties at the half steps
    x[2, 3], x[2, 40], x[2, 70:] = np.nan, np.inf, -0.0
    x[3, :32] = 0
    x[4, 5], x[4, 9] = 3.2e38, -np.inf
    q, d, s = np.empty((9, 96), np.int8), np.empty((9, 3), np.float32), np.empty((9, 6), np.int32)
    for m in range(9):
        lib.qi8_quantize_row(q[m].ctypes.data, d[m].ctypes.data, s[m].ctypes.data, x[m].ctypes.data, 96, 1)
    g = x.reshape(9, 3, 32)
    with np.errstate(invalid="ignore", over="ignore"):
        amax = np.fmax.reduce(np.abs(g), axis=-1, initial=0)
        ok = (amax > 0) & (amax <= np.float32(3.0e38))
        inv = np.where(ok, np.float32(127) / np.where(ok, amax, 1), 0).astype(np.float32)
        v = np.rint(g * inv[..., None])
    want = np.clip(np.where(np.isnan(v), 0, v), -127, 127).astype(np.int8)
    assert np.array_equal(q.reshape(9, 3, 32), want)
    assert np.array_equal(d, np.where(inv > 0, amax / np.float32(127), 0).astype(np.float32))
    assert np.array_equal(s, want.reshape(9, 6, 16).astype(np.int32).sum(-1))


@pytest.mark.parametrize("ggml_type", sorted(GGML_TYPES), ids=[GGML_TYPES[t] for t in sorted(GGML_TYPES)])
def test_the_int8_route_is_the_weights_times_the_8_bit_activations(lib, ggml_type):
    """8-bit activations: the result is the file's exact weights times x as rounded to int8 per group (a float64
    reference) up to float32 rounding, so within half a step of each group's scale of the exact product, on
    every class (VNNI, AVX-512 and AVX2 without it, portable). The types the route does not run take the float32
    route, bit for bit."""
    k = 512 if block_shape(ggml_type)[0] == 256 else 96
    raw = random_blocks(ggml_type, 37, k, ggml_type)
    ref = reference(raw, ggml_type, k).astype(np.float64)
    w = quant.pack(from_gguf_blocks(raw, ggml_type))
    rng = np.random.default_rng(ggml_type)
    x, bias = rng.standard_normal((11, k)).astype(np.float32), rng.standard_normal(w.n).astype(np.float32)
    x[1] *= 1e-30
    x[2, :32] = 0
    x[4, 7] = 40  # one large input: the rest of its group round to few steps
    codes, scale = rounded_8(x)
    want = np.einsum("mgk,ngk->mn", codes * scale.astype(np.float64), ref.reshape(w.n, -1, 32)) + bias
    full = _i8(lib, x, w, bias)
    if w.fmt not in quant.I8_FORMATS:
        assert np.array_equal(full, _matmul(lib, x, w, bias))
        return
    np.testing.assert_allclose(full, want, atol=1e-5 * np.abs(want).max(), rtol=0)
    exact = x.astype(np.float64) @ ref.T + bias
    bound = (np.abs(ref).reshape(w.n, -1, 32).sum(-1) @ (scale[..., 0].T / 2)).T
    assert np.all(np.abs(full - exact) <= bound + 1e-5 * np.abs(exact).max())


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0", "q8m", "Q4_K", "Q6_K"])
def test_the_int8_route_gives_each_row_the_same_result_at_any_row_count(lib, kind):
    """The int8 route runs rows in passes of a few (6 with AVX-512, 3 with AVX2, then 4 / 2 / 1 for the rest):
    each row's result is bit for bit the same at every row count, so a sequence's output never depends on the
    batch it shares a step with; with a clipped last column block, the bias, and added to the output; and
    within the tolerance of the float64 product of the weights and the rounded x, with 8-bit codes of every
    sign (q8m: -128 .. 127; without VNNI they run as |w| with x's sign flipped)."""
    w = _dot_weight(kind, 37)
    assert w.fmt in quant.I8_FORMATS
    rng = np.random.default_rng(len(kind) + 1)
    x, bias = rng.standard_normal((70, w.k)).astype(np.float32), rng.standard_normal(w.n).astype(np.float32)
    x[1] *= 1e-30
    x[2, :32] = 0
    x[3] *= 1e4
    alone = np.concatenate([_i8(lib, x[i : i + 1], w, bias) for i in range(70)])
    for rows in (2, 3, 5, 6, 7, 13, 64, 70):
        assert np.array_equal(_i8(lib, x[:rows], w, bias), alone[:rows]), f"{rows} rows: not the one-row result"
    ref = _rows(lib, w).astype(np.float64)
    codes, scale = rounded_8(x)
    want = np.einsum("mgk,ngk->mn", codes * scale.astype(np.float64), ref.reshape(w.n, -1, 32)) + bias
    assert np.all(np.abs(alone - want) <= 1e-5 * np.abs(want).max(axis=1, keepdims=True))  # per row: x[3] is 1e4
    _assert_accumulates(lib, "qmm_i8", x, w, bias, alone, rng)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0", "q8m", "Q4_K", "Q6_K"])
def test_the_two_pass_int8_route_keeps_the_16_bit_step_at_any_row_count(lib, kind):
    """Two passes of 8-bit codes (qmm_i8x2: x ~ d1 q1 + d1 / 254 q2, q2 the rounded residual of q1): each input
    is within d1 / 508 of its value (d1 = its group's max |x| / 127: the 16-bit route's step, 1 / 254 of one
    pass's), so the result is within sum |w| x d1 / 508 per group of the float64 product of the file's exact
    weights and x, on every class (VNNI, AVX2's vpmaddubsw, portable); and each row's result is bit for bit the
    same at every row count (rows run in passes of 3, 2 with AVX2, then 2 / 1), with a clipped last column block,
    the bias, and added to the output."""
    w = _dot_weight(kind, 37)
    rng = np.random.default_rng(len(kind) + 2)
    x, bias = rng.standard_normal((70, w.k)).astype(np.float32), rng.standard_normal(w.n).astype(np.float32)
    x[1] *= 1e-30
    x[2, :32] = 0
    x[3] *= 1e4
    x[4, 7] = 40  # one large input: one pass would round the rest of its group to few steps
    alone = np.concatenate([_run(lib, "qmm_i8x2", x[i : i + 1], w, bias) for i in range(70)])
    for rows in (2, 3, 5, 6, 7, 13, 64, 70):
        got = _run(lib, "qmm_i8x2", x[:rows], w, bias)
        assert np.array_equal(got, alone[:rows]), f"{rows} rows: not the one-row result"
    ref = _rows(lib, w).astype(np.float64)
    exact = x.astype(np.float64) @ ref.T + bias
    step = np.abs(x).reshape(70, -1, 32).max(-1).astype(np.float64) / 127 / 508
    bound = step @ np.abs(ref).reshape(w.n, -1, 32).sum(-1).T
    assert np.all(np.abs(alone - exact) <= bound * 1.01 + 1e-5 * np.abs(exact).max(axis=1, keepdims=True))
    one_pass = np.abs(_i8(lib, x, w, bias) - exact).max()
    assert np.abs(alone - exact)[4:].max() < one_pass / 20  # nearer the exact product than one pass by far
    _assert_accumulates(lib, "qmm_i8x2", x, w, bias, alone, rng)


# ---- a whole model written with llama.cpp's type mix -----------------------------------------------------

HIDDEN, INTER, HEADS, KV_HEADS, LAYERS, VOCAB = 256, 512, 4, 2, 2, 333
_MIX = [  # per layer: tensor -> GGML type (layer 0 as Q4_K_M, layer 1 as other llama.cpp mixes do)
    {"attn_q": 12, "attn_k": 12, "attn_v": 14, "attn_output": 12, "ffn_gate": 12, "ffn_up": 12, "ffn_down": 14},
    {"attn_q": 12, "attn_k": 12, "attn_v": 6, "attn_output": 8, "ffn_gate": 13, "ffn_up": 13, "ffn_down": 14},
]


def _shapes() -> dict[str, tuple[int, int]]:
    q, kv = HEADS * (HIDDEN // HEADS), KV_HEADS * (HIDDEN // HEADS)
    return {
        "attn_q": (q, HIDDEN), "attn_k": (kv, HIDDEN), "attn_v": (kv, HIDDEN), "attn_output": (HIDDEN, q),
        "ffn_gate": (INTER, HIDDEN), "ffn_up": (INTER, HIDDEN), "ffn_down": (HIDDEN, INTER),
    }  # fmt: skip


def write_mixed_gguf(
    path: str, mix: list[dict[str, int]] = _MIX, ends: tuple[int, int] = (12, 14), quantize: bool = False
) -> int:
    """A tiny llama GGUF of random blocks in `mix` (token_embd, output in `ends`), or with `quantize` of random
    weights quantized by gguf's own `gguf.quants.quantize`; returns the bytes of its tensors."""
    w = gguf.GGUFWriter(path, "llama")
    for key, value in (("block_count", LAYERS), ("embedding_length", HIDDEN), ("feed_forward_length", INTER)):
        getattr(w, f"add_{key}")(value)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_context_length(256)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(VOCAB)
    tensors = {"token_embd.weight": (ends[0], (VOCAB, HIDDEN)), "output.weight": (ends[1], (VOCAB, HIDDEN))}
    for i, layer in enumerate(mix):
        tensors |= {f"blk.{i}.{name}.weight": (t, _shapes()[name]) for name, t in layer.items()}
    total, rng = 0, np.random.default_rng(0)
    for seed, (name, (t, (n, k))) in enumerate(tensors.items()):
        if quantize:
            x = rng.normal(0, 0.05, (n, k)).astype(np.float32)
            raw = gguf.quants.quantize(x, gguf.GGMLQuantizationType(t))
        else:
            raw = random_blocks(t, n, k, seed, scale=0.002)
        w.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType(t))
        total += raw.nbytes
    for name in ["output_norm.weight"] + [
        f"blk.{i}.{n}.weight" for i in range(LAYERS) for n in ("attn_norm", "ffn_norm")
    ]:
        w.add_tensor(name, (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
        total += 4 * HIDDEN
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return total


def _greedy(runner: ModelRunner, prompt: list[int], steps: int) -> list[int]:
    seq, table = list(prompt), list(range(8))
    logits = runner.execute([SeqChunk(seq, 0, table)])
    for _ in range(steps):
        seq.append(int(logits[-1].argmax()))
        logits = runner.execute([SeqChunk(seq[-1:], len(seq) - 1, table)])
    return seq[len(prompt) :]


def test_a_q4_k_m_style_file_runs_as_stored_and_decodes_as_gguf_dequantized(tmp_path, monkeypatch):
    path = str(tmp_path / "mix.gguf")
    file_bytes = write_mixed_gguf(path)
    monkeypatch.setattr(loader, "load_tokenizer", lambda _path: None)  # token ids only: no tokenizer in the file
    ours, ref = (loader.load_model(path, "float32", verbose=False, quantization=q) for q in ("gguf", "none"))
    formats = {w.fmt for w in ours.model.quant_weights()}
    assert ours.quantization == "gguf" and formats == {"q4_k", "q5_k", "q6_k", "mixed", "q8_0"}
    assert not any(p.numel() > HIDDEN for p in ours.model.parameters())  # no matrix left dense
    assert ours.weight_bytes <= 1.1 * file_bytes < ref.weight_bytes / 4  # the issue's goal: <= 1.1x the file
    prompt = [5, 17, 200, 3, 99, 42, 7, 311]
    want = _greedy(ModelRunner(ref, 16, 16), prompt, 12)
    fused = ModelRunner(ours, 16, 16)
    assert fused.fused is not None  # the fused C step takes every type through the matmul routes (csrc/qmm_*.c)
    assert _greedy(fused, prompt, 12) == want
    assert _greedy(ModelRunner(ours, 16, 16, fused=False), prompt, 12) == want  # the torch path's linears


def test_an_mxfp4_file_written_by_gguf_runs_at_its_own_size(tmp_path, monkeypatch):
    """Matrices quantized to MXFP4 by gguf-py's own quantizer, as gpt-oss ships its experts: every one kept in
    mxfp4 at 4.25 bits a weight (no widening to bytes), decoding gguf's dequantized file's greedy tokens on the
    fused step (the dot route) and the float32 route's linears."""
    path = str(tmp_path / "mxfp4.gguf")
    file_bytes = write_mixed_gguf(path, [dict.fromkeys(_MIX[0], 39)] * LAYERS, (8, 39), quantize=True)
    monkeypatch.setattr(loader, "load_tokenizer", lambda _path: None)
    ours, ref = (loader.load_model(path, "float32", verbose=False, quantization=q) for q in ("gguf", "none"))
    assert {w.fmt for w in ours.model.quant_weights()} == {"mxfp4", "q8_0"}
    assert ours.weight_bytes <= 1.1 * file_bytes
    prompt = [5, 17, 200, 3, 99, 42, 7, 311]
    want = _greedy(ModelRunner(ref, 16, 16), prompt, 12)
    assert _greedy(ModelRunner(ours, 16, 16), prompt, 12) == want
    assert _greedy(ModelRunner(ours, 16, 16, fused=False), prompt, 12) == want


def test_iq4_files_run_as_stored_and_decode_as_the_widened_route(tmp_path, monkeypatch):
    """A model of IQ4_NL (layer 0, the embedding) and IQ4_XS (layer 1, the output) matrices, as MoE files keep
    their experts: every one held in iq4_nl / iq4_xs at <= 1.1x the file (the widened q8_0 / k8 took ~1.9x), and
    greedy tokens equal to the widened route's and gguf's dequantized file's, on the fused step (the dot route)
    and the float32 route's linears."""
    from pagedllm.model import weights

    path = str(tmp_path / "iq4.gguf")
    file_bytes = write_mixed_gguf(path, [dict.fromkeys(_MIX[0], 20), dict.fromkeys(_MIX[0], 23)], (20, 23))
    monkeypatch.setattr(loader, "load_tokenizer", lambda _path: None)
    ours, ref = (loader.load_model(path, "float32", verbose=False, quantization=q) for q in ("gguf", "none"))
    stored = weights.from_gguf_blocks
    monkeypatch.setattr(weights, "from_gguf_blocks", lambda raw, ggml_type: widened(stored(raw, ggml_type)))
    wide = loader.load_model(path, "float32", verbose=False, quantization="gguf")
    assert {w.fmt for w in ours.model.quant_weights()} == {"iq4_nl", "iq4_xs"}
    assert {w.fmt for w in wide.model.quant_weights()} == {"q8_0", "k8"}
    assert ours.weight_bytes <= 1.1 * file_bytes < wide.weight_bytes / 1.5
    prompt = [5, 17, 200, 3, 99, 42, 7, 311]
    want = _greedy(ModelRunner(ref, 16, 16), prompt, 12)
    assert _greedy(ModelRunner(wide, 16, 16), prompt, 12) == want
    assert _greedy(ModelRunner(ours, 16, 16), prompt, 12) == want
    assert _greedy(ModelRunner(ours, 16, 16, fused=False), prompt, 12) == want
