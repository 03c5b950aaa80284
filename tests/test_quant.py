"""Quantized weights: the formats against gguf's own dequantizer, each kernel against the dense matmul it
replaces, the fused C step against the torch path and against transformers, and the --quantization flag.

Tolerances: the float32 kernels dequantize to exactly the stored values and differ from a float64 matmul only
by float32 summation (relative 1e-5 of the output scale); the AMX kernel rounds its inputs to bfloat16, so it is
compared with a float64 product of the bfloat16-rounded inputs (relative 1e-3: float32 accumulation order).
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from kernel_helpers import needs_kernel, random_parts
from model_helpers import all_logits

from pagedllm.engine import EngineConfig
from pagedllm.errors import UserError
from pagedllm.model import ModelRunner, SeqChunk, load_model
from pagedllm.model.formats.gguf_quants import from_gguf_blocks
from pagedllm.model.fused_step import PHASES, i8_kinds
from pagedllm.model.kernels import cpu_kernel
from pagedllm.model.kernels import quant_linear as quant
from pagedllm.model.kernels.quant_linear import bf16_kernel, pack, qlinear, qrows, quantize_rtn

LIB = cpu_kernel.load()
pytestmark = needs_kernel  # where a compiler exists, a kernel that fails to build fails these tests


@pytest.mark.parametrize("ggml_type", [2, 3, 8], ids=["Q4_0", "Q4_1", "Q8_0"])
def test_stored_blocks_dequantize_to_exactly_the_files_values(ggml_type):
    """gguf's dequantizer (what transformers uses) is the reference; the kernel's rows must equal it bit for bit
    (every other type: test_gguf_types.py)."""
    import gguf

    from devkit.ggml_blocks import random_blocks

    raw = random_blocks(ggml_type, 40, 96, ggml_type, scale=0.02)
    ref = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(ggml_type)).astype(np.float32))
    parts = from_gguf_blocks(raw, ggml_type)
    assert torch.equal(parts.dequantize(), ref)
    assert torch.equal(qrows(pack(parts), torch.arange(40)), ref)


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
@pytest.mark.parametrize("n,k", [(16, 32), (40, 96), (7, 64), (960, 576)])
@pytest.mark.parametrize("rows", [1, 3, 6, 7, 64, 200])
def test_float32_kernel_matches_dense_matmul(fmt, n, k, rows):
    parts = random_parts(fmt, n, k, n + k)
    w, wd = pack(parts), parts.dequantize().double()
    g = torch.Generator().manual_seed(rows)
    x, b = torch.randn(rows, 2 * k, generator=g)[:, ::2], torch.randn(n, generator=g)  # a strided view, as after split
    ref = F.linear(x.double(), wd, b.double())
    scale = ref.abs().max().item()
    torch.testing.assert_close(qlinear(x, w, b).double(), ref, atol=1e-5 * scale, rtol=0)
    out = torch.randn(rows, n, generator=g)
    acc = out.double() + F.linear(x.double(), wd)
    qlinear(x, w, out=out, accumulate=True)
    torch.testing.assert_close(out.double(), acc, atol=1e-5 * scale, rtol=0)


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_float32_kernel_rows_do_not_depend_on_the_batch(fmt):
    """Direct (few rows) and panel (many rows) paths sum every output in the same order: bit-identical rows."""
    w = pack(random_parts(fmt, 100, 192, 3))
    x = torch.randn(64, 192, generator=torch.Generator().manual_seed(0))
    full = qlinear(x, w)
    for i in (0, 5, 63):
        assert torch.equal(qlinear(x[i : i + 1], w)[0], full[i])
        assert torch.equal(qlinear(x[i : i + 7], w)[0], full[i])


@pytest.mark.skipif(bf16_kernel() is None, reason="no AMX or AVX-512 BF16 on this CPU")
@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
@pytest.mark.parametrize("n,k", [(16, 32), (40, 96), (7, 64), (576, 1536)])
@pytest.mark.parametrize("rows", [16, 17, 33, 100])
def test_amx_kernel_matches_bfloat16_matmul(fmt, n, k, rows):
    parts = random_parts(fmt, n, k, n * k)
    g = torch.Generator().manual_seed(rows)
    x, b = torch.randn(rows, k, generator=g).bfloat16(), torch.randn(n, generator=g)
    ref = F.linear(x.double(), parts.dequantize().bfloat16().double(), b.double())
    w = pack(parts)
    w.amx_min_rows = 1
    got = qlinear(x, w, b)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), ref, atol=1e-2 * ref.abs().max().item(), rtol=0)  # bf16 output
    out, xf, w = torch.empty(rows, n), x.float(), pack(parts)  # float32 out: the kernel's own precision
    quant._lib().qmm_amx(
        out.data_ptr(), xf.data_ptr(), w.tiles.data_ptr(), b.data_ptr(), rows, n, k, k, n, quant.FORMATS[fmt], 0, 2
    )
    torch.testing.assert_close(out.double(), ref, atol=1e-3 * ref.abs().max().item(), rtol=0)


@pytest.mark.skipif(bf16_kernel() is None, reason="no AMX or AVX-512 BF16 on this CPU")
@pytest.mark.parametrize("fmt", ["q8_0", "bf16"])
def test_bfloat16_kernel_at_long_k_in_blocks_of_rows_and_passes(fmt):
    """K 8256 (passes of 128 groups over a pair's panel: 128, 128, 2) and 300 rows (more than a pass's 256 rows
    and a block of rows of x at that K): the product is bfloat16 arithmetic's, and a row's bits are those it gets
    alone, whatever block and pass it fell in (row 299 is the last block's; K 8256 leaves a pass of 2 groups)."""
    n, k, rows = 40, 8256, 300
    assert quant._lib().qmm_bf16_row_block(rows, k) < rows
    if fmt == "bf16":
        dense = torch.randn(n, k, generator=torch.Generator().manual_seed(3)).bfloat16()
        w = pack(from_gguf_blocks(dense.view(torch.uint8).numpy().reshape(n, -1), 30))
        ref_w = dense.double()
    else:
        parts = random_parts(fmt, n, k, 5)
        w, ref_w = pack(parts), parts.dequantize().bfloat16().double()
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(4)).bfloat16().float()
    b = torch.randn(n, generator=torch.Generator().manual_seed(6))

    def product(xs: torch.Tensor) -> torch.Tensor:
        out, m = torch.empty(xs.shape[0], n), xs.shape[0]
        fmt = quant.FORMATS[w.fmt]
        status = quant._lib().qmm_amx(
            out.data_ptr(), xs.data_ptr(), w.tiles.data_ptr(), b.data_ptr(), m, n, k, k, n, fmt, 0, 2
        )
        assert status == 0
        return out

    full = product(x)
    ref = F.linear(x.double(), ref_w, b.double())
    torch.testing.assert_close(full.double(), ref, atol=1e-4 * ref.abs().max().item(), rtol=0)
    for i in (0, 255, 256, 299):
        assert torch.equal(product(x[i : i + 1].contiguous())[0], full[i])


@pytest.mark.parametrize("bits", [8, 4])
def test_round_to_nearest_is_within_half_a_step(bits):
    w = torch.randn(48, 128, generator=torch.Generator().manual_seed(bits)) * 0.05
    parts = quantize_rtn(w, bits)
    step = torch.from_numpy(parts.d.astype(np.float32)).repeat_interleave(32, 1)
    err = (parts.dequantize() - w).abs()
    assert (err <= step / 2 + 1e-3 * step + 1e-7).all()  # + the float16 rounding of d and m
    assert err.max() > 0  # it did quantize


# ---- whole models on tiny checkpoints ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from model_helpers import make_tiny_hf

    folder = str(tmp_path_factory.mktemp("tiny_qwen2"))
    return folder, make_tiny_hf("qwen2_bias", folder)  # GQA, q/k/v biases


def _rtn_reference(hf, bits: int):
    """transformers' model with every weight replaced by what --quantization int<bits> makes of it."""
    import copy

    ref = copy.deepcopy(hf)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if p.dim() == 2 and p.shape[1] % 32 == 0:
                b = 8 if "embed" in name or "lm_head" in name else bits
                p.copy_(quantize_rtn(p, b).dequantize())
    return ref


@pytest.mark.parametrize("bits", [8, 4])
def test_rtn_quantized_model_matches_transformers_on_the_same_weights(tiny, bits):
    """The fused C step (prefill chunks + decodes) against transformers on the dequantized weights, float32."""
    folder, hf = tiny
    ours = load_model(folder, "float32", verbose=False, quantization=f"int{bits}")
    assert ours.quantization == f"int{bits}" and ours.weight_bytes < ours.dense_weight_bytes / 3
    ref = _rtn_reference(hf, bits)
    runner = ModelRunner(ours, num_blocks=32, block_size=8)
    assert runner.fused is not None
    seq = [random.Random(bits).randrange(3, 256) for _ in range(40)]
    with torch.inference_mode():
        want = ref(torch.tensor([seq])).logits[0]
    got = all_logits(runner, [SeqChunk(seq[:25], 0, list(range(31, 26, -1)))])[0]  # reversed block ids
    got = torch.cat(
        [got] + [runner.execute([SeqChunk([t], 25 + i, list(range(31, 26, -1)))]) for i, t in enumerate(seq[25:])]
    )
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kv_dtype,i8_rows", [(torch.float32, 0), (torch.bfloat16, 0), (torch.float32, 8)])
def test_fused_step_matches_the_torch_path(tiny, kv_dtype, i8_rows):
    """The fused C step against the torch modules, step by step; with `i8_rows`, matmuls of at least that many
    rows take the int8 route on both paths (steps of 26 and 17 rows; 3, below it)."""
    folder, _ = tiny
    ours = load_model(folder, "float32", verbose=False, quantization="int8")
    for w in ours.model.quant_weights():
        w.i8_min_rows = i8_rows
    fused, plain = (ModelRunner(ours, 40, 8, kv_dtype, fused=f) for f in (True, False))
    assert fused.fused is not None and plain.fused is None
    rng = random.Random(5)
    seqs = [[rng.randrange(3, 256) for _ in range(n)] for n in (9, 30, 3)]
    tables = [list(range(10 * i + 9, 10 * i, -1)) for i in range(3)]
    for step in (
        [SeqChunk(seqs[0], 0, tables[0]), SeqChunk(seqs[1][:17], 0, tables[1])],
        [SeqChunk([5], 9, tables[0]), SeqChunk(seqs[1][17:], 17, tables[1]), SeqChunk(seqs[2], 0, tables[2])],
        [SeqChunk([6], 10, tables[0]), SeqChunk([7], 30, tables[1]), SeqChunk([8], 3, tables[2])],
    ):
        a, b = all_logits(fused, step), all_logits(plain, step)
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="cannot hold"):
        fused.execute([SeqChunk([1] * 20, 0, [1])])
    with pytest.raises(RuntimeError, match="out of range"):
        fused.execute([SeqChunk([10**6], 0, [1])])


@pytest.mark.parametrize("kind", ["qkv", "o", "gate_up", "down"])
def test_the_int8_route_on_one_kind_of_matmul_on_both_paths(tiny, kind):
    """The int8 route for one kind of matmul only (the torch path chooses per weight, the fused step per kind:
    fused_step.i8_kinds, from the same weights): the paths agree, and the route is taken there and only there
    (the logits move from the 16-bit route's, and less than with every matmul on the int8 route)."""
    folder, _ = tiny
    ours = load_model(folder, "float32", verbose=False, quantization="int8", quantized_activations="int8")
    chosen = {id(w) for w in ours.model.weights_by_kind()[kind]}
    seq = [random.Random(7).randrange(3, 256) for _ in range(20)]

    def logits(selected, fused: bool) -> torch.Tensor:
        for w in ours.model.quant_weights():
            w.i8_min_rows = 8 if selected is None or id(w) in selected else 0
        runner = ModelRunner(ours, 8, 8, fused=fused)
        assert (runner.fused is not None) == fused
        return all_logits(runner, [SeqChunk(seq, 0, [3, 1, 2])])[0]

    got = logits(chosen, True)
    assert i8_kinds(ours.model) == 1 << PHASES.index(kind)
    torch.testing.assert_close(got, logits(chosen, False), atol=1e-4, rtol=1e-4)
    int16, int8 = logits(set(), True), logits(None, True)
    assert 0 < (got - int16).abs().max() < (int8 - int16).abs().max()


@pytest.mark.parametrize("block_size,kv_dtype", [(8, torch.float32), (32, torch.float32), (32, torch.bfloat16)])
def test_fused_float32_is_batch_invariant_bit_for_bit(tiny, block_size, kv_dtype):
    """A sequence's logits do not depend on its neighbours or on how its prompt was chunked. With blocks of 32,
    attention reads whole groups of 16 rows, with a bfloat16 cache widened once per block for a chunk's tile."""
    folder, _ = tiny
    loaded = load_model(folder, "float32", verbose=False, quantization="int4")
    runner = ModelRunner(loaded, 40, block_size, kv_dtype)
    rng = random.Random(9)
    seq, other = [rng.randrange(3, 256) for _ in range(30)], [rng.randrange(3, 256) for _ in range(50)]
    t = [list(range(k, k + 7)) for k in (0, 10, 20, 30)]
    alone = all_logits(runner, [SeqChunk(seq, 0, t[0])])[0]
    first = all_logits(runner, [SeqChunk(other, 0, t[1]), SeqChunk(seq[:11], 0, t[2])])
    second = all_logits(runner, [SeqChunk(seq[11:], 11, t[2]), SeqChunk([3], 50, t[1])])
    assert torch.equal(torch.cat([first[1], second[0]]), alone)


def test_quantization_flag_and_its_fallback(tiny, monkeypatch, caplog):
    folder, _ = tiny
    with pytest.raises(UserError, match="--quantization gguf needs a GGUF"):
        load_model(folder, "float32", verbose=False, quantization="gguf")
    with pytest.raises(UserError, match="--quantization"):
        EngineConfig(quantization="fp4")
    assert load_model(folder, "float32", verbose=False).quantization == "none"  # a HF folder: dense by default
    monkeypatch.setattr(cpu_kernel, "load", lambda: None)  # a machine where the kernels cannot be built
    quant._said.clear()
    dense = load_model(folder, "float32", verbose=False, quantization="int8")
    assert dense.quantization == "none" and not dense.model.quant_weights()
    assert "no quantized kernel" in caplog.text


@pytest.mark.skipif(bf16_kernel() is None, reason="no AMX or AVX-512 BF16 on this CPU")
def test_bfloat16_rows_depend_only_on_the_kernel_class(tiny):
    """--dtype bfloat16: steps of the chosen number of rows or more run their matmuls on AMX with bfloat16 inputs,
    fewer rows the float32 kernel; so a sequence's logits depend on the batch only through which side it falls
    on. (The tiny model's own measured choice may never pick AMX: the threshold is set here.)"""
    folder, _ = tiny
    loaded = load_model(folder, "bfloat16", verbose=False, quantization="int8")
    many = 8
    for w in loaded.model.quant_weights():
        w.amx_min_rows = many
    runner = ModelRunner(loaded, 80, 8)
    rng = random.Random(11)
    seqs = [[rng.randrange(3, 256) for _ in range(9)] for _ in range(16)]
    tables = [list(range(5 * i, 5 * i + 5)) for i in range(16)]
    runner.execute([SeqChunk(s, 0, t) for s, t in zip(seqs, tables)])

    def first_row(n: int) -> torch.Tensor:  # sequence 0's next-token logits in a decode step of n sequences
        return runner.execute([SeqChunk([7], 9, tables[i]) for i in range(n)])[0]

    few = many - 1
    assert torch.equal(first_row(1), first_row(few)) and torch.equal(first_row(many), first_row(16))
    assert not torch.equal(first_row(1), first_row(many))


def test_kernel_choice_from_measured_times():
    """Dense only where it is faster for one row; AMX from the smallest row count it wins at and every larger."""
    from pagedllm.model.kernels.kernel_choice import decide

    q = {1: 0.2, 8: 0.6, 64: 3.0, 256: 12.0}
    assert decide({"q-f32": q, "dense": {1: 0.5, 8: 0.7, 64: 2.0, 256: 8.0}}, "b").quantized
    slow = decide({"q-f32": q, "dense": {1: 0.1, 8: 0.7, 64: 2.0, 256: 8.0}}, "b")
    assert not slow.quantized and slow.kernel_for(1) == slow.kernel_for(256) == "dense"
    amx = {1: 0.4, 8: 0.5, 64: 1.0, 256: 3.0}
    assert decide({"q-f32": q, "q-bf16": amx}, "b").amx_min_rows == 8
    assert decide({"q-f32": q, "q-bf16": {**amx, 8: 0.7}}, "b").amx_min_rows == 64
    assert decide({"q-f32": q, "q-bf16": {**amx, 64: 4.0}}, "b").amx_min_rows == 256  # must win at every larger
    assert decide({"q-f32": q, "q-bf16": {r: 99.0 for r in q}}, "b").amx_min_rows == 0
    choice = decide({"q-f32": q, "q-bf16": amx}, "native build (avx512)")
    assert [choice.kernel_for(r) for r in (1, 7, 8, 300)] == ["q-f32", "q-f32", "q-bf16", "q-bf16"]
    assert "8 rows -> q-bf16" in choice.describe() and "native build (avx512)" in choice.describe()


def test_kernel_choice_decides_for_the_quantized_kernel_that_runs():
    """The dot route is one switch for every row count: the choice compares dense and q-bf16 with the kernel
    that runs (q-dot with the route on, q-f32 under --quantized-activations none), and says where the dot route
    runs although q-f32 measured faster."""
    from pagedllm.model.kernels.kernel_choice import decide

    f32 = {1: 0.2, 8: 0.6, 64: 3.0, 256: 12.0}
    dot = {1: 0.4, 8: 0.5, 64: 2.0, 256: 8.0}  # slower than q-f32 for one row, faster for many
    dense = {1: 0.3, 8: 0.7, 64: 2.5, 256: 10.0}
    ms = {"q-f32": f32, "q-dot": dot, "dense": dense}
    assert not decide(ms, "b", dot=True).quantized  # q-dot (what runs) is slower than dense for one row
    off = decide(ms, "b", dot=False)
    assert off.quantized and [off.kernel_for(r) for r in (1, 256)] == ["q-f32", "q-f32"]
    on = decide({**ms, "dense": {**dense, 1: 0.5}}, "b", dot=True)
    assert on.quantized and on.kernel_for(1) == "q-dot"
    assert "the dot route is slower than q-f32 at rows 1 (2.00x)" in on.describe()
    assert "slower than q-f32" not in off.describe()
    amx = {1: 0.5, 8: 0.55, 64: 2.5, 256: 9.0}  # beats q-f32 from 8 rows, never q-dot
    assert decide({**ms, "q-bf16": amx}, "b", dot=False).amx_min_rows == 8
    assert decide({**ms, "dense": {**dense, 1: 0.5}, "q-bf16": amx}, "b", dot=True).amx_min_rows == 0


def test_kernel_choice_takes_the_int8_route_from_where_it_is_faster_at_every_larger_row_count():
    """q-i8 runs from the smallest row count from which it beats what would run otherwise (q-dot, or q-bf16 past
    its threshold) at every larger one; never under --quantized-activations int16 (int8=False) or none (no dot
    route); the kept file is refused when its i8 threshold is not the one its times call for."""
    from pagedllm.model.kernels.kernel_choice import _candidates, _parse, decide

    ms = {
        "q-f32": {1: 0.2, 8: 0.6, 64: 3.0, 256: 12.0},
        "q-dot": {1: 0.1, 8: 0.5, 64: 2.0, 256: 8.0},
        "dense": {1: 0.3, 8: 0.7, 64: 2.5, 256: 10.0},
        "q-i8": {1: 0.3, 8: 0.4, 64: 2.5, 256: 5.0},  # faster at 8 and 256, not at 64
    }
    on = decide(ms, "b")
    assert on.i8_min_rows == 256 and [on.kernel_for(r) for r in (1, 64, 255, 256, 999)] == [
        "q-dot", "q-dot", "q-dot", "q-i8", "q-i8"
    ]  # fmt: skip
    assert decide({**ms, "q-i8": {**ms["q-i8"], 64: 1.0}}, "b").i8_min_rows == 8
    assert decide(ms, "b", int8=False).i8_min_rows == 0 and decide(ms, "b", dot=False).i8_min_rows == 0
    amx = {1: 0.5, 8: 0.45, 64: 1.5, 256: 4.0}  # q-bf16 from 8 rows, faster than q-i8 at 256
    both = decide({**ms, "q-bf16": amx}, "b")
    assert both.amx_min_rows == 8 and both.i8_min_rows == 0
    assert "256 rows -> q-i8" in on.describe()
    if _candidates(torch.float32) == set(ms):  # a build with vector code for both integer routes
        assert _parse(json.dumps(asdict(on)).encode(), torch.float32, "b") == on
        raw = asdict(on) | {"i8_min_rows": 8}  # not what its times call for
        with pytest.raises(ValueError, match="not the one its times call for"):
            _parse(json.dumps(raw).encode(), torch.float32, "b")


def test_the_int8_route_is_opt_in(tiny, monkeypatch):
    """--quantized-activations int8 gives every weight of a format the route runs the kernel choice's row count
    (the dot route below it); auto (the default) and int16 never take the route; a bad value names the flag."""
    from pagedllm.model.kernels import kernel_choice

    rows = {1: 1.0, 8: 1.0, 64: 1.0, 256: 1.0}
    ms = {"q-f32": rows, "dense": {**rows, 1: 2.0}, "q-dot": rows, "q-i8": {**rows, 64: 0.5, 256: 0.5}}
    monkeypatch.setattr(
        kernel_choice,
        "choose",
        lambda layer, dtype, dot, int8, stored: kernel_choice.decide(ms, "t", dot, int8, stored),
    )
    folder, _ = tiny
    on = load_model(folder, "float32", verbose=False, quantization="int4", quantized_activations="int8")
    assert on.kernel_choice.i8_min_rows == 64 and on.kernel_choice.kernel_for(64) == "q-i8"
    assert {(w.i8_min_rows, w.dot) for w in on.model.quant_weights()} == {(64, True)}
    for setting in ("auto", "int16"):
        off = load_model(folder, "float32", verbose=False, quantization="int4", quantized_activations=setting)
        assert off.kernel_choice.i8_min_rows == 0 and {w.i8_min_rows for w in off.model.quant_weights()} == {0}
    with pytest.raises(UserError, match="--quantized-activations must be"):
        load_model(folder, "float32", verbose=False, quantization="int4", quantized_activations="int4")


def test_kernel_choice_is_kept_and_measured_again_when_unreadable(tmp_path, monkeypatch):
    from pagedllm.model.kernels import kernel_choice

    monkeypatch.setattr(cpu_kernel, "library_path", lambda: tmp_path / "pagedllm_kernels-test.so")
    layer = [pack(random_parts("q4_1", 32, 64, 5))]
    calls = []
    real = kernel_choice.measure
    monkeypatch.setattr(kernel_choice, "measure", lambda *a: calls.append(1) or real(*a))
    first = kernel_choice.choose(layer, torch.float32)
    assert kernel_choice.choose(layer, torch.float32) == first and len(calls) == 1  # read back, not re-timed
    kept = next(tmp_path.glob("*.choice-*.json"))
    kept.write_text("{not json")
    assert kernel_choice.choose(layer, torch.float32).ms.keys() == first.ms.keys() and len(calls) == 2
    kernel_choice.choose(layer, torch.bfloat16)  # another dtype is another choice
    assert len(calls) == 3
    assert kernel_choice.choose(layer, torch.float32, dot=False).dot is False and len(calls) == 3  # decided again


@pytest.mark.slow
def test_auto_quantization_follows_the_measured_choice(monkeypatch):
    """--quantization auto (the default for a GGUF): quantized where measured faster, dense where not."""
    from pagedllm.model.kernels import kernel_choice

    fast = {1: 0.2, 8: 0.6, 64: 3.0, 256: 12.0}
    for dense_1, want in ((0.5, "gguf"), (0.1, "none")):
        ms = {"q-f32": fast, "dense": {**fast, 1: dense_1}}
        monkeypatch.setattr(
            kernel_choice,
            "choose",
            lambda layer, dtype, dot, int8, stored, ms=ms: kernel_choice.decide(ms, "t", dot, int8, stored),
        )
        loaded = load_model(None, "float32", verbose=False)
        assert loaded.quantization == want and bool(loaded.model.quant_weights()) == (want == "gguf")
        assert loaded.kernel_choice.quantized == (want == "gguf")
