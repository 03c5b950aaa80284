"""csrc/moe.c through moe_kernel.MoeExperts: a MoE layer's routed experts run from their quantized tiles.

Against a float64 torch reference built from the experts' weights as gguf dequantizes them (quant's dequantizer
equals gguf's: test_gguf_types), per weight format (Q4_0, Q8_0, Q4_K, Q6_K, F16, IQ4_NL, IQ4_XS), route (float32
activations, and the dot route's 16-bit ones) and CPU class (native, x86-64-v4, x86-64-v3, portable): at 1, 3, 16
and 70 rows, with routings that leave one expert without rows and give another every row (so both the direct and
the panel routes serve some expert). Each token's result is bit-identical whatever else is in the step (fewer rows,
the rows in another order), the expert load counts the rows routed to each expert, and the activations (SwiGLU,
GeGLU, gpt-oss's clamped SwiGLU with expert biases) are transformers' formulas. The opt-in int8 route (8-bit
activations for an expert's matmul of at least MoeLayer.i8_min_rows rows) against the float32 route, within its
stated tolerance; the bfloat16 route (vdpbf16ps, for --dtype bfloat16 steps from a row count) against a reference
of its rounded numbers, and bit-identical across row counts from that count on.
"""

from __future__ import annotations

from dataclasses import replace
from functools import cache

import pytest
import torch
import torch.nn.functional as F
from kernel_helpers import needs_kernel

from devkit.ggml_blocks import random_blocks
from pagedllm.model.formats.gguf_quants import from_gguf_blocks
from pagedllm.model.kernels import cpu_kernel
from pagedllm.model.kernels.moe_kernel import MoeExperts, stack
from pagedllm.model.kernels.quant_linear import I8_FORMATS

pytestmark = needs_kernel

TYPES = {"Q4_0": 2, "Q8_0": 8, "Q4_K": 12, "Q6_K": 14, "F16": 1, "IQ4_NL": 20, "IQ4_XS": 23}  # GGML type numbers
GGML_TYPES = {**TYPES, "BF16": 30}  # and the bfloat16 route's own
EXPERTS, TOPK, HIDDEN, FFN = 6, 2, 256, 256  # K formats need K % 256 == 0 for both matmuls
ROWS = (1, 3, 16, 70)


@pytest.fixture(scope="module", params=cpu_kernel.runnable_targets())
def target(request):
    """One class's kernels, as `cpu_kernel.load()` gives them while the module's tests of that class run."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDLLM_CPU_TARGET", request.param)
        cpu_kernel.load.cache_clear()
        assert cpu_kernel.load() is not None, f"the {request.param} build failed (see the warning logged)"
        yield request.param
    cpu_kernel.load.cache_clear()


@cache
def _weights(type_name: str) -> tuple[list, list, torch.Tensor, torch.Tensor]:
    """Random experts of one GGML type, stacked as a 3-D tensor's are (one buffer), and their float64 values."""
    t = GGML_TYPES[type_name]
    gu = [from_gguf_blocks(random_blocks(t, 2 * FFN, HIDDEN, 10 + e), t) for e in range(EXPERTS)]
    dn = [from_gguf_blocks(random_blocks(t, HIDDEN, FFN, 50 + e), t) for e in range(EXPERTS)]
    wgu = torch.stack([p.dequantize() for p in gu]).double()
    wdn = torch.stack([p.dequantize() for p in dn]).double()
    return stack(gu), stack(dn), wgu, wdn


def _experts(type_name: str, dot: bool, **kwargs) -> MoeExperts:
    gu, dn, _, _ = _weights(type_name)
    for w in gu + dn:
        w.dot = dot
    return MoeExperts(gu, dn, **kwargs)


def _routing(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row routed to expert 1 (at a random choice position) and to one of the others; expert 0 to none."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack(
        [torch.cat([torch.tensor([1]), 2 + torch.randperm(EXPERTS - 2, generator=g)[: TOPK - 1]]) for _ in range(rows)]
    )
    ids = torch.stack([r[torch.randperm(TOPK, generator=g)] for r in ids])
    return ids, torch.softmax(torch.randn(rows, TOPK, generator=g), -1)


def _act(name: str, g: torch.Tensor, u: torch.Tensor, alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """transformers' activations: SwiGLU, GeGLU (gelu_pytorch_tanh), gpt-oss's GptOssExperts._apply_gate."""
    if name == "silu":
        return F.silu(g) * u
    if name == "gelu_pytorch_tanh":
        return F.gelu(g, approximate="tanh") * u
    g, u = g.clamp(max=limit), u.clamp(-limit, limit)
    return (u + 1) * (g * torch.sigmoid(g * alpha))


def _biases(act: str) -> dict[str, torch.Tensor]:
    """gpt-oss's experts have biases on both matmuls; the others none."""
    if act != "swigluoai":
        return {}
    g = torch.Generator().manual_seed(7)
    return {
        "gate_up_bias": torch.randn(EXPERTS, 2 * FFN, generator=g),
        "down_bias": torch.randn(EXPERTS, HIDDEN, generator=g),
    }


@cache
def _case(type_name: str, act: str, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x, routing and the float64 reference sum_j w_tj (down_e act(gate_up_e x_t + b) + b), one expert at a
    time: the same for every class and route, so computed once. x is scaled so that the gate_up outputs are a
    few units (the activations' interesting range; past 7 for the clamp), whatever the format's scale."""
    _, _, wgu, wdn = _weights(type_name)
    x = torch.randn(ROWS[-1], HIDDEN, generator=torch.Generator().manual_seed(seed))
    x = (x * 3.0 / (wgu.pow(2).mean().sqrt().item() * HIDDEN**0.5)).float()
    ids, w = _routing(ROWS[-1], seed)
    b = _biases(act)
    bgu, bdn = b.get("gate_up_bias", torch.zeros(EXPERTS, 2 * FFN)), b.get("down_bias", torch.zeros(EXPERTS, HIDDEN))
    y = torch.zeros(x.shape[0], HIDDEN, dtype=torch.float64)
    for e in range(EXPERTS):
        t, j = torch.nonzero(ids == e, as_tuple=True)
        h = x[t].double() @ wgu[e].T + bgu[e].double()
        a = _act(act, h[:, :FFN], h[:, FFN:])
        y.index_add_(0, t, w[t, j, None].double() * (a @ wdn[e].T + bdn[e].double()))
    return x, ids, w, y


def _check(type_name: str, dot: bool, act: str = "silu", seed: int = 0) -> None:
    """The reference at every row count; each row bit-identical to itself in 70 rows, alone or in another order;
    y accumulated into `out`; the load counter."""
    ex = _experts(type_name, dot, act=act, **_biases(act))
    x, ids, w, ref = _case(type_name, act, seed)
    full = ex.forward(x, ids, w)
    tol = (3e-4 if dot and type_name != "F16" else 1e-5) * ref.abs().max().item()
    for rows in ROWS:
        got = ex.forward(x[:rows], ids[:rows], w[:rows])
        torch.testing.assert_close(got.double(), ref[:rows], atol=tol, rtol=0)
        assert torch.equal(got, full[:rows]), f"{rows} rows are not bit-identical to the same rows in {ROWS[-1]}"
    perm = torch.randperm(ROWS[-1], generator=torch.Generator().manual_seed(seed))
    assert torch.equal(ex.forward(x[perm], ids[perm], w[perm]), full[perm])
    assert torch.equal(ex.forward(x[5:6], ids[5:6], w[5:6]), full[5:6])
    out = torch.randn(3, HIDDEN)
    acc = out.double() + ref[:3]
    ex.forward(x[:3], ids[:3], w[:3], out=out)
    torch.testing.assert_close(out.double(), acc, atol=tol, rtol=0)
    calls = [ids, *(ids[:r] for r in ROWS), ids[perm], ids[5:6], ids[:3]]  # every call's rows, in order
    assert torch.equal(ex.load, sum(torch.bincount(i.flatten(), minlength=EXPERTS) for i in calls))
    assert ex.load[0] == 0 and ex.load[1] == sum(len(i) for i in calls)  # no rows, and every row


@pytest.mark.parametrize("dot", [False, True], ids=["float32", "dot"])
@pytest.mark.parametrize("type_name", list(TYPES))
def test_the_routed_experts_match_the_dequantized_reference(target, type_name, dot):
    _check(type_name, dot, seed=TYPES[type_name])


@pytest.mark.parametrize("act", ["gelu_pytorch_tanh", "swigluoai"])
def test_each_activation_and_the_expert_biases(target, act):
    """GeGLU, and gpt-oss's clamped SwiGLU with biases on both matmuls (gate / up values on both sides of the
    limit, so the clamp changes the result)."""
    if act == "swigluoai":
        x, ids, _, _ = _case("Q8_0", act, 3)
        h = x.double() @ _weights("Q8_0")[2][1].T
        assert (h.abs() > 7).any() and (h.abs() < 7).any()
    _check("Q8_0", False, act, seed=3)


# The int8 route against the float32 one: each input within half a step of its group's scale (0.4% of the group's
# largest), through both matmuls; up to 1.4e-2 of the largest output measured here, on every class.
I8_TOL = 3e-2


def _i8_experts(type_name: str, min_rows: int) -> MoeExperts:
    """The experts with the int8 route from `min_rows` rows of an expert on (the dot route below it, as the
    loader's --quantized-activations int8 sets them; the cached weights left as they are)."""
    gu, dn, _, _ = _weights(type_name)
    return MoeExperts(*[[replace(w, dot=True, i8_min_rows=min_rows) for w in ws] for ws in (gu, dn)])


@pytest.mark.parametrize("type_name", list(TYPES))
def test_the_int8_route_runs_the_experts_of_its_row_count(target, type_name):
    """--quantized-activations int8: an expert's matmuls of at least i8_min_rows rows round their inputs to 8 bits
    per group of 32 (qmm_i8.c). From one row on, every expert takes it: within I8_TOL of the float32 route (and
    not the dot route's numbers: it ran), each row's result its own whatever the rows beside it, bit for bit; at a
    count no expert reaches, the dot route's result bit for bit; F16 and the IQ4 types, formats the route does not
    run, the dot route's at any count."""
    x, ids, w, _ = _case(type_name, "silu", TYPES[type_name])
    dot = _experts(type_name, True).forward(x, ids, w)
    floats = _experts(type_name, False).forward(x, ids, w)
    on = _i8_experts(type_name, 1)
    full = on.forward(x, ids, w)
    assert torch.equal(_i8_experts(type_name, ROWS[-1] + 1).forward(x, ids, w), dot)
    if _weights(type_name)[0][0].fmt not in I8_FORMATS:
        assert torch.equal(full, dot)
        return
    assert not torch.equal(full, dot)
    err = (full - floats).abs().max().item() / floats.abs().max().item()
    assert err < I8_TOL, f"{type_name}: {err:.2e}"
    for rows in ROWS[:-1]:
        assert torch.equal(on.forward(x[:rows], ids[:rows], w[:rows]), full[:rows]), f"{rows} rows"
    perm = torch.randperm(ROWS[-1], generator=torch.Generator().manual_seed(1))
    assert torch.equal(on.forward(x[perm], ids[perm], w[perm]), full[perm])


# The bfloat16 route against a float64 reference of the same rounded numbers (x and the activations rounded to
# bfloat16, as the route rounds them): what is left is float32 sums in another order and an activation rounded
# on the other side of a bfloat16 step; up to ~3e-3 of the largest output measured here.
BF16_TOL = 1e-2


def _bf16_reference(type_name: str, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """sum_j w_tj down_e(bf16(silu(gate) * up)) of bf16(x), weights rounded to bfloat16, in float64."""
    _, _, wgu, wdn = _weights(type_name)
    r = lambda t: t.to(torch.bfloat16).double()  # noqa: E731
    y = torch.zeros(x.shape[0], HIDDEN, dtype=torch.float64)
    for e in range(EXPERTS):
        t, j = torch.nonzero(ids == e, as_tuple=True)
        h = r(x[t]) @ r(wgu[e]).T
        y.index_add_(0, t, w[t, j, None].double() * (r(_act("silu", h[:, :FFN], h[:, FFN:])) @ r(wdn[e]).T))
    return y


@pytest.mark.parametrize("type_name", ["BF16", "Q4_K"])
def test_the_bfloat16_route_runs_steps_of_its_row_count(target, type_name):
    """--dtype bfloat16 on a CPU with AVX-512 BF16: a step of at least the weights' amx_min_rows rows rounds the
    experts' inputs to bfloat16 and runs vdpbf16ps (bfloat16 weights read as stored, others dequantized per
    column block pair). Within BF16_TOL of the rounded reference, each row's result its own whatever the rows
    beside it (3 to 70 rows, another order), bit for bit; below the threshold, and on a class without the
    instruction (x86-64-v3, portable), the float32 route's result bit for bit."""
    gu, dn, _, _ = _weights(type_name)
    on = MoeExperts(*[[replace(w, amx_min_rows=3) for w in ws] for ws in (gu, dn)])
    x, ids, w, _ = _case(type_name, "silu", 5)
    xb = x.to(torch.bfloat16)
    floats = _experts(type_name, False).forward(xb.float(), ids, w)
    full = on.forward(xb, ids, w, out=torch.zeros(len(x), HIDDEN))
    assert torch.equal(on.forward(xb[:2], ids[:2], w[:2], out=torch.zeros(2, HIDDEN)), floats[:2])
    if not cpu_kernel.load().qmm_bf16_kind():  # this class's build has no vdpbf16ps (bf16_kernel() is the process's)
        assert torch.equal(full, floats)
        return
    assert not torch.equal(full, floats)
    ref = _bf16_reference(type_name, x, ids, w)
    err = (full.double() - ref).abs().max().item() / ref.abs().max().item()
    assert err < BF16_TOL, f"{type_name}: {err:.2e}"
    for rows in ROWS[1:-1]:
        got = on.forward(xb[:rows], ids[:rows], w[:rows], out=torch.zeros(rows, HIDDEN))
        assert torch.equal(got, full[:rows]), f"{rows} rows"
    perm = torch.randperm(ROWS[-1], generator=torch.Generator().manual_seed(2))
    assert torch.equal(on.forward(xb[perm], ids[perm], w[perm], out=torch.zeros(len(x), HIDDEN)), full[perm])


def test_the_bfloat16_route_keeps_a_rows_bits_across_blocks_of_an_experts_rows(target):
    """An expert of 300 rows at K 8,448 (its down projection): more rows than one block of x holds at that K
    (qmm_bf16_row_block), and passes over the inner size. Each row's output is the bits it gets alone, and the
    product is bfloat16 arithmetic's: a block reading another block's rows would break both. (A class without
    vdpbf16ps runs the float32 route, which must hold both too.)"""
    hidden, ffn, rows = 64, 8448, 300
    assert cpu_kernel.load().qmm_bf16_row_block(rows, ffn) < rows
    gen = torch.Generator().manual_seed(7)
    wgu, wdn = torch.randn(2 * ffn, hidden, generator=gen) / 8, torch.randn(hidden, ffn, generator=gen) / 90
    as_bf16 = lambda w: from_gguf_blocks(w.bfloat16().view(torch.uint8).numpy().reshape(w.shape[0], -1), 30)  # noqa: E731
    experts = MoeExperts(*[[replace(q, amx_min_rows=1) for q in stack([as_bf16(m)])] for m in (wgu, wdn)])
    x = torch.randn(rows, hidden, generator=gen).bfloat16()
    ids, w = torch.zeros(rows, 1, dtype=torch.int64), torch.ones(rows, 1)
    full = experts.forward(x, ids, w, out=torch.zeros(rows, hidden))
    r = lambda t: t.to(torch.bfloat16).double()  # noqa: E731
    h = r(x) @ r(wgu).T
    ref = r(_act("silu", h[:, :ffn], h[:, ffn:])) @ r(wdn).T
    err = (full.double() - ref).abs().max().item() / ref.abs().max().item()
    assert err < BF16_TOL, f"{err:.2e}"
    for i in (0, 223, 224, 299):
        assert torch.equal(experts.forward(x[i : i + 1], ids[:1], w[:1], out=torch.zeros(1, hidden))[0], full[i])


def test_experts_are_views_of_one_buffer_and_bad_input_is_named():
    gu, dn, _, _ = _weights("Q4_K")
    assert len({w.tiles.untyped_storage().data_ptr() for w in gu}) == 1
    ex = MoeExperts(gu, dn)
    x, ids, w, _ = _case("Q4_K", "silu", 0)
    with pytest.raises(ValueError, match="expert id out of range"):
        ex.forward(x, torch.full_like(ids, EXPERTS), w)
    with pytest.raises(ValueError, match="ids"):
        ex.forward(x[:, :128], ids, w)
    with pytest.raises(ValueError, match="activation 'relu'"):
        MoeExperts(gu, dn, act="relu")
    with pytest.raises(ValueError, match="differ in shape or format"):
        MoeExperts(gu, [*dn[:-1], gu[0]])
    assert torch.equal(ex.load, torch.zeros(EXPERTS, dtype=torch.int64))  # a refused call counts nothing
