"""The kernels built for every CPU class this machine can execute (PAGEDLLM_CPU_TARGET), not only for its own.

Why: code that is fast on one class can be scalar on another, and a build only shows which when it is timed
or asked. Each build says which vector path it compiled (`cpu_kernel.isa`); a vector class that fell back to
the portable C loops fails here on any machine that can run that class, and so does a wrong result: every
class's matmul against a float64 reference, bit-identical rows whatever the batch, and (in
test_model_default.py) greedy tokens equal to transformers'.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_helpers import random_parts

from pagedllm.model.kernels import cpu_kernel, kernel_choice
from pagedllm.model.kernels.quant_linear import pack, qlinear

TARGETS = cpu_kernel.runnable_targets()


@pytest.fixture(params=TARGETS)
def target(request, monkeypatch):
    """The kernels of one class, as `cpu_kernel.load()` gives them to the model while the test runs."""
    monkeypatch.setenv("PAGEDLLM_CPU_TARGET", request.param)
    cpu_kernel.load.cache_clear()
    lib = cpu_kernel.load()
    assert lib is not None, f"the {request.param} build failed (see the warning logged)"
    yield request.param, lib
    monkeypatch.delenv("PAGEDLLM_CPU_TARGET")
    cpu_kernel.load.cache_clear()


def _native_isa() -> dict[str, str]:
    flags = cpu_kernel.cpu_flags()
    matmul = "avx512" if "avx512f" in flags else "avx2" if {"avx2", "fma", "f16c"} <= flags else "portable"
    dot = "avx512" if "avx512bw" in flags else "avx2" if matmul == "avx2" else "portable"
    vnni = "avx512_vnni" in flags if dot == "avx512" else "avx_vnni" in flags
    i8 = dot + ("-vnni" if vnni and dot != "portable" else "")
    return {"matmul": matmul, "dot": dot, "i8": i8, "amx": "yes" if {"amx_bf16", "avx512_bf16"} <= flags else "no"}


def test_an_x86_machine_builds_every_class_it_can_run():
    flags = cpu_kernel.cpu_flags()
    if "avx2" in flags:
        assert "x86-64-v3" in TARGETS and "x86-64" in TARGETS
    if "avx512f" in flags and "avx512vl" in flags:
        assert "x86-64-v4" in TARGETS


def test_each_build_says_which_vector_path_it_compiled(target):
    name, lib = target
    isa = cpu_kernel.EXPECTED_ISA.get(name)
    want = _native_isa() if name == "native" else {"matmul": isa, "dot": isa, "i8": isa, "amx": "no"}
    assert cpu_kernel.isa(lib) == want


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
@pytest.mark.parametrize("n,k", [(40, 96), (7, 64), (200, 1536)])
def test_each_build_matches_the_dense_matmul(target, fmt, n, k):
    """Rows 1-3 take the direct path, 7 and 64 the panel (blocked) path; odd column counts clip the stores."""
    parts = random_parts(fmt, n, k, n + k)
    w, wd = pack(parts), parts.dequantize().double()
    g = torch.Generator().manual_seed(n)
    x, b = torch.randn(64, 2 * k, generator=g)[:, ::2], torch.randn(n, generator=g)  # strided rows, as after a split
    ref = F.linear(x.double(), wd, b.double())
    scale = ref.abs().max().item()
    full = qlinear(x, w, b)
    torch.testing.assert_close(full.double(), ref, atol=1e-5 * scale, rtol=0)
    for rows in (1, 2, 3, 7):
        got = qlinear(x[:rows], w, b)
        torch.testing.assert_close(got.double(), ref[:rows], atol=1e-5 * scale, rtol=0)
        assert torch.equal(got, full[:rows]), f"{rows} rows are not bit-identical to the same rows in 64"
    out = torch.randn(3, n, generator=g)
    acc = out.double() + F.linear(x[:3].double(), wd)
    qlinear(x[:3], w, out=out, accumulate=True)
    torch.testing.assert_close(out.double(), acc, atol=1e-5 * scale, rtol=0)


def test_kernel_choice_is_measured_for_each_build(target, tmp_path, monkeypatch):
    """The choice names the build that was timed and is kept per build (the library's file name)."""
    name, lib = target
    built = cpu_kernel.library_path()
    assert built is not None and f"-{name}-" in built.name  # the build's file name names its class
    monkeypatch.setattr(cpu_kernel, "library_path", lambda: tmp_path / built.name)  # keep the choice here
    layer = [pack(random_parts("q4_1", 48, 64, 1)), pack(random_parts("q4_1", 32, 96, 2))]
    choice = kernel_choice.choose(layer, torch.float32)
    assert choice.build == f"{name} build ({cpu_kernel.isa(lib)['matmul']})"
    assert set(choice.ms["q-f32"]) == set(kernel_choice.ROWS)
    assert [f.name.split(".choice-")[0] for f in tmp_path.glob("*.choice-*.json")] == [built.stem]
