"""The CPU fast paths against the portable ones they replace: the C decode-attention kernel against the torch
gather + SDPA backend, and oneDNN-packed linear layers against F.linear.

The model-level parity tests (vs transformers) already run through these paths on CPU; here each is checked
alone over the shapes that take different code inside it (head_dim 64 and 128 have their own copies, other
multiples of 8 the generic vector path, others the scalar path; GQA groups; partial last blocks; bfloat16).
"""

from __future__ import annotations

import hashlib
import logging
import os
import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from kernel_helpers import CC, needs_kernel

from pagedllm.model.kernels import cpu_kernel
from pagedllm.model.kernels.onednn_linear import linear, pack
from pagedllm.model.layers.attention import (
    CpuPagedAttention,
    TorchPagedAttention,
    build_metadata,
    make_attention_backend,
)

LIB = cpu_kernel.load()


@needs_kernel
def test_kernel_builds_where_a_compiler_exists():
    assert LIB is not None, f"{CC[0]} exists but the CPU attention kernel did not build (see the warning logged)"


def _case(
    n_seqs: int,
    kv_heads: int,
    group: int,
    head_dim: int,
    block_size: int,
    new_lens: list[int],
    dtype: torch.dtype,
    seed: int,
):
    """Random caches, shuffled block tables, and q/k/v for `new_lens[i]` new tokens after a random history."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    starts = [rng.randrange(0, 70) for _ in range(n_seqs)]
    need = [-(-(s + n) // block_size) for s, n in zip(starts, new_lens)]
    num_blocks = sum(need) + 3
    ids = list(range(1, num_blocks))
    rng.shuffle(ids)
    tables, at = [], 0
    for k in need:
        tables.append(ids[at : at + k])
        at += k
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g).to(dtype)
    v_cache = torch.randn(shape, generator=g).to(dtype)
    T = sum(new_lens)
    q = torch.randn(T, kv_heads * group, head_dim, generator=g).to(dtype)
    k = torch.randn(T, kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(T, kv_heads, head_dim, generator=g).to(dtype)
    meta = build_metadata(new_lens, starts, tables, block_size, torch.device("cpu"))
    return q, k, v, k_cache, v_cache, meta


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts calls into the C kernel, so a test cannot pass by quietly comparing the torch path with itself."""
    calls = []
    real = cpu_kernel.decode_attention

    def spy(*args, **kwargs):
        calls.append(args[1].shape[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(cpu_kernel, "decode_attention", spy)
    return calls


@needs_kernel
@pytest.mark.parametrize("head_dim", [64, 128, 256, 32, 20])  # 256 (128 on AVX2): values in column slices
@pytest.mark.parametrize("kv_heads,group", [(1, 1), (3, 3), (2, 4), (1, 6)])
@pytest.mark.parametrize("block_size", [16, 5, 24])
def test_decode_kernel_matches_torch_backend(head_dim, kv_heads, group, block_size, kernel_calls):
    q, k, v, kc, vc, meta = _case(9, kv_heads, group, head_dim, block_size, [1] * 9, torch.float32, head_dim)
    ref = TorchPagedAttention().forward(q, k, v, kc.clone(), vc.clone(), meta)
    out = CpuPagedAttention(LIB).forward(q, k, v, kc, vc, meta)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    assert kernel_calls == [9]


@needs_kernel
def test_mixed_prefill_and_decode_batch(kernel_calls):
    """Decodes go through the kernel, prefill chunks through SDPA; the outputs land at the right rows."""
    lens = [1, 7, 1, 1, 20, 1]
    q, k, v, kc, vc, meta = _case(len(lens), 3, 3, 64, 16, lens, torch.float32, 1)
    ref = TorchPagedAttention().forward(q, k, v, kc.clone(), vc.clone(), meta)
    out = CpuPagedAttention(LIB).forward(q, k, v, kc, vc, meta)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    assert kernel_calls == [4]


@needs_kernel
@pytest.mark.parametrize("head_dim", [64, 128, 256, 32, 20])
def test_bfloat16_cache(head_dim, kernel_calls):
    q, k, v, kc, vc, meta = _case(8, 3, 3, head_dim, 16, [1] * 8, torch.bfloat16, 2)
    ref = TorchPagedAttention().forward(q.float(), k.float(), v.float(), kc.float(), vc.float(), meta)
    out = CpuPagedAttention(LIB).forward(q, k, v, kc, vc, meta)
    assert out.dtype == torch.bfloat16 and kernel_calls == [8]
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


@needs_kernel
def test_out_of_range_inputs_are_refused():
    """A context past the block table, or a block id past the cache, would read outside it: an error instead."""
    q, _, _, kc, vc, meta = _case(2, 1, 1, 64, 16, [1, 1], torch.float32, 3)
    grp = meta.groups[0]
    too_long = grp.context_lens + grp.block_tables.shape[1] * 16
    with pytest.raises(RuntimeError, match="context length"):
        cpu_kernel.decode_attention(LIB, q, kc, vc, grp.block_tables, too_long, 0.125)
    bad_ids = grp.block_tables.clone()
    bad_ids[1, 0] = kc.shape[0]
    with pytest.raises(RuntimeError, match="block id"):
        cpu_kernel.decode_attention(LIB, q, kc, vc, bad_ids, grp.context_lens, 0.125)
    with pytest.raises(ValueError, match="layout"):
        cpu_kernel.decode_attention(LIB, q, kc, vc, grp.block_tables.int(), grp.context_lens, 0.125)


@needs_kernel
def test_loading_the_kernel_leaves_float_flags_alone():
    """Built with -ffast-math but not linked with it: loading must not turn on flush-to-zero for the process."""
    import subprocess
    import sys

    code = (
        "import torch; from pagedllm.model.kernels import cpu_kernel; assert cpu_kernel.load() is not None; "
        "print(torch.tensor([1e-40]).mul(1.0).item() != 0.0)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "True"


def test_falls_back_without_a_compiler(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("CC", "/bin/false")
    monkeypatch.setenv("PAGEDLLM_CACHE", str(tmp_path))
    cpu_kernel.load.cache_clear()
    try:
        assert cpu_kernel.load() is None
        assert "could not build" in caplog.text
        assert type(make_attention_backend("cpu")) is TorchPagedAttention
    finally:
        cpu_kernel.load.cache_clear()


def _damage(case: str, path: Path, elsewhere: Path) -> None:
    """Put in place of the kept library what a full disk, a cut copy, another version or a hand finds there."""
    data = path.read_bytes()
    if case == "a directory":
        path.unlink()
        path.mkdir()
        return
    if case == "a link to a good copy":
        elsewhere.write_bytes(data)
        path.unlink()
        path.symlink_to(elsewhere)
        return
    body = {
        "truncated": data[: len(data) // 2],
        "empty": b"",
        "a flipped byte": data[:1000] + bytes([data[1000] ^ 1]) + data[1001:],
        "no seal": data[: -len(cpu_kernel.SEAL) - 32],  # what the builds before the seal kept
        "sealed garbage": b"\x7fELF" + bytes(4000),
    }[case]
    if case == "sealed garbage":
        body += hashlib.sha256(body).digest() + cpu_kernel.SEAL
    path.unlink()  # a new file under the name: this process still maps the old one (written over, its pages go,
    path.write_bytes(body)  # and the loader's exit handlers die with SIGBUS)


DAMAGE = ["truncated", "empty", "a flipped byte", "no seal", "sealed garbage", "a directory", "a link to a good copy"]


@needs_kernel
@pytest.mark.parametrize("case", DAMAGE)
def test_a_damaged_kept_library_is_built_again(case, monkeypatch, tmp_path, caplog):
    """Whatever is found under the library's name, it is checked before it is loaded (a truncated library can
    crash dlopen), built again with one log line, and only that name is replaced: nothing is left behind, a
    link is replaced rather than followed, a directory (not ours) is left alone. The "compiler" here copies
    this machine's build, so no test compiles the kernels again."""
    body = cpu_kernel.library_path().read_bytes()[: -len(cpu_kernel.SEAL) - 32]
    builds: list[Path] = []

    def copy_build(cc, flags, extra, out: Path) -> None:
        builds.append(out)
        out.write_bytes(body)

    monkeypatch.setattr(cpu_kernel, "_compile", copy_build)
    monkeypatch.setenv("PAGEDLLM_CACHE", str(tmp_path / "cache"))
    cpu_kernel.load.cache_clear()
    try:
        assert cpu_kernel.load() is not None and len(builds) == 1
        kept = cpu_kernel.library_path()
        assert kept.parent == tmp_path / "cache" / "kernels" and not cpu_kernel._sealed(kept)
        _damage(case, kept, tmp_path / "elsewhere.so")
        cpu_kernel.load.cache_clear()
        caplog.clear()
        lib = cpu_kernel.load()
        assert lib is not None and cpu_kernel.isa(lib) == cpu_kernel.isa(LIB) and len(builds) == 2
        (line,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert "not usable" in line and str(kept) in line
        assert os.listdir(kept.parent) == [kept.name] and cpu_kernel.library_path() == kept  # no build folder
        if case == "a directory":
            assert kept.is_dir() and "could not keep" in line
        else:
            assert not cpu_kernel._sealed(kept)
            cpu_kernel.load.cache_clear()
            assert cpu_kernel.load() is not None and len(builds) == 2  # the new one is used as kept
        if case == "a link to a good copy":
            assert (tmp_path / "elsewhere.so").read_bytes() == body + hashlib.sha256(body).digest() + cpu_kernel.SEAL
    finally:
        cpu_kernel.load.cache_clear()


def test_torch_path_when_asked(monkeypatch):
    monkeypatch.setenv("PAGEDLLM_ATTENTION", "torch")
    cpu_kernel.load.cache_clear()
    try:
        assert cpu_kernel.attention_lib() is None  # the other kernels (quantized matmuls) stay available
        assert type(make_attention_backend("cpu")) is TorchPagedAttention
    finally:
        monkeypatch.delenv("PAGEDLLM_ATTENTION")
        cpu_kernel.load.cache_clear()
    if LIB is not None:
        assert isinstance(make_attention_backend("cpu"), CpuPagedAttention)


@pytest.mark.parametrize("rows", [1, 3, 64, 200])
def test_packed_linear_matches_f_linear(rows):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 40, generator=g)
    b = torch.randn(96, generator=g)
    x = torch.randn(rows, 40, generator=g)
    packed = pack(w)
    if packed is None:
        pytest.skip("oneDNN packing is not available on this CPU / build")
    torch.testing.assert_close(linear(x, w, b, packed), F.linear(x, w, b), atol=1e-4, rtol=1e-5)
    strided = torch.randn(rows, 80, generator=g)[:, ::2]  # a view, as the model passes after a split
    torch.testing.assert_close(linear(strided, w, None, packed), F.linear(strided, w), atol=1e-4, rtol=1e-5)


def test_the_step_structures_come_from_the_header_and_their_sizes_are_checked(monkeypatch):
    """fused_step.py's ctypes structures are read from csrc/model_step.h; a copy that disagrees with the C build
    (a field added on one side only) is a clear error at load, not a step reading the wrong bytes."""
    import ctypes

    lib = cpu_kernel.load()
    structs = cpu_kernel.c_structs("model_step.h")
    assert [f for f, _ in structs["StepLayer"]._fields_][:2] == ["attn_norm", "ffn_norm"]
    cpu_kernel.check_structs(lib)  # the real header agrees with the build
    fields = structs["StepModel"]._fields_[:-1]  # one field short
    short = type("StepModel", (ctypes.Structure,), {"_fields_": fields})
    monkeypatch.setattr(cpu_kernel, "c_structs", lambda header: {"StepModel": short})
    want = f"StepModel is {ctypes.sizeof(structs['StepModel'])} bytes in the C build and {ctypes.sizeof(short)}"
    with pytest.raises(RuntimeError, match=want):
        cpu_kernel.check_structs(lib)


@needs_kernel
def test_the_entry_points_are_declared_from_the_headers_prototypes(tmp_path, monkeypatch):
    """cpu_kernel declares every entry point to ctypes from the headers' prototypes (no hand-kept argument
    lists): the types come out as C has them, neither a comment nor a definition in a header is taken for a
    prototype, a type the reader cannot convert is an error naming it, and a library that lacks a declared
    entry point is refused."""
    import ctypes

    p, i, i64, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
    declared = cpu_kernel.c_functions("quant_matmul.h")
    assert declared["qmm_f32"] == (i, [p] * 4 + [i] * 8)
    assert declared["qcol_bytes"] == (i64, [i, i])
    assert declared["kernel_isa"] == (ctypes.c_char_p, [])
    assert declared["qmm_amx_begin"] == (None, [])
    attention = cpu_kernel.c_functions("paged_attention.h")
    assert attention["paged_decode_attention"] == (i, [p] * 6 + [i] * 6 + [i64, f, i, i64, f, p, i])
    assert "window_start" not in attention  # a static inline definition, not an entry point
    lib = cpu_kernel.load()
    assert lib.qmm_f32.argtypes == [p] * 4 + [i] * 8 and lib.kernel_isa.restype is ctypes.c_char_p

    monkeypatch.setattr(cpu_kernel, "CSRC", tmp_path)
    (tmp_path / "odd.h").write_text("/* int commented(int x); */\nint fine(const float *x,\n  int64_t n);\n")
    assert cpu_kernel.c_functions("odd.h") == {"fine": (i, [p, i64])}
    (tmp_path / "bad.h").write_text("int bad(unsigned x);\n")
    with pytest.raises(TypeError, match="bad.h: bad has a type the reader does not know: 'unsigned'"):
        cpu_kernel.c_functions("bad.h")
    (tmp_path / "bad.h").write_text("int not_in_the_library(void);\n")
    with pytest.raises(AttributeError, match="not_in_the_library"):
        cpu_kernel._declare(lib)
