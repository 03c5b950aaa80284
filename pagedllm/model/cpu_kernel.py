"""The CPU kernels (csrc/*.c: decode attention, quantized matmuls, the fused decode step): built on first use
with the system C compiler into one library.

Why plain C files behind ctypes rather than a torch C++ extension: they compile in seconds (no torch headers),
need nothing at install time, and ctypes releases the GIL while they run. The library is built for the host
CPU (-march=native) into ~/.cache/pagedllm/kernels, keyed by the sources, the compiler and the CPU, so a machine
builds it once. Where no compiler works, `load()` returns None: attention stays on the portable torch path and
quantized weights are dequantized to the dense path. PAGEDLLM_ATTENTION=torch forces torch attention.

Compiling and linking are two steps on purpose: linking a shared library with -ffast-math makes GCC add a
constructor that turns on flush-to-zero for the whole process when the library loads; compiled with -ffast-math
but linked without it, only the kernel's own arithmetic is affected. Only attention gets -ffast-math: the
matmuls must sum in a fixed order (batch invariance), so nothing there may be reassociated.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch  # before the kernel loads, so its libgomp resolves to the one torch has already loaded

import pagedllm.model.kv_quant as kv_quant

log = logging.getLogger("pagedllm.model")

CSRC = Path(__file__).parent / "csrc"
# (source, extra compile flags)
SOURCES = [("paged_attention.c", ["-ffast-math"]), ("quant_matmul.c", []), ("model_step.c", [])]
COMPILE = ["-O3", "-march=native", "-fno-math-errno", "-fPIC", "-Wno-psabi"]  # psabi: 64-byte vectors on AVX2
LINK = ["-shared"]
OPENMP = ["-fopenmp"]  # without OpenMP the same source builds a single-threaded kernel


def _cache_dir() -> Path:
    root = os.environ.get("PAGEDLLM_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "pagedllm")
    return Path(root) / "kernels"


def _host_id(cc: list[str]) -> str:
    """What a -march=native build depends on: the machine, its CPU features, the compiler's version."""
    parts = [platform.machine()]
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            keys = ("flags", "Features", "CPU part", "model name")
            parts += sorted({line.strip() for line in f if line.startswith(keys)})
    except OSError:
        parts.append(platform.processor())
    try:
        parts.append(subprocess.run([*cc, "--version"], capture_output=True, text=True, timeout=30).stdout)
    except (OSError, subprocess.SubprocessError):
        pass
    return "\n".join(parts)


def _build(cc: list[str], openmp: bool) -> Path:
    extra = OPENMP if openmp else []
    key_src = b"".join(p.read_bytes() for p in sorted(CSRC.glob("*.[ch]")))
    key_src += " ".join([*cc, *COMPILE, *LINK, *extra, str(SOURCES), _host_id(cc)]).encode()
    lib = _cache_dir() / f"pagedllm_kernels-{hashlib.sha256(key_src).hexdigest()[:16]}.so"
    if lib.exists():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
        objs, out = [], Path(tmp) / lib.name
        run: dict[str, Any] = dict(check=True, capture_output=True, text=True, timeout=300)
        for name, flags in SOURCES:
            objs.append(str(Path(tmp) / (name + ".o")))
            subprocess.run([*cc, *COMPILE, *flags, *extra, "-c", str(CSRC / name), "-o", objs[-1]], **run)
        subprocess.run([*cc, *LINK, *extra, *objs, "-o", str(out), "-lm"], **run)
        os.replace(out, lib)  # atomic: concurrent builders never see a half-written library
    return lib


@lru_cache(maxsize=1)
def load() -> ctypes.CDLL | None:
    """The compiled kernels, or None (with one log line saying why) when they cannot be built here."""
    cc = shlex.split(os.environ.get("CC", "")) or [shutil.which("cc") or shutil.which("gcc") or ""]
    if not cc[0]:
        log.warning(
            "no C compiler found: decode attention uses the portable torch path (slower) and quantized "
            "weights are dequantized"
        )
        return None
    lib, why = None, ""
    for openmp in (True, False):
        try:
            lib = ctypes.CDLL(str(_build(cc, openmp)))
        except (OSError, subprocess.SubprocessError) as e:
            why = (getattr(e, "stderr", "") or str(e)).strip()[:500]
            continue
        if not openmp:
            log.warning("the CPU kernels were built without OpenMP (single-threaded): %s", why)
        break
    if lib is None:
        log.warning("could not build the CPU kernels, using the torch path: %s", why)
        return None
    _declare(lib)
    return lib


def _declare(lib: ctypes.CDLL) -> None:
    """Argument types of every entry point, so that ctypes converts Python ints the way C expects."""
    p, i, i64, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
    signatures = {
        "paged_decode_attention": [p] * 6 + [i] * 6 + [i64, f, i, i],
        "qmm_f32": [p] * 4 + [i] * 8,
        "qrows_f32": [p, p, i, p, i, i, i],
        "qmm_amx": [p] * 4 + [i] * 8,
        "qmm_amx_available": [],
        "model_step": [p, p, p, i],
    }
    for name, args in signatures.items():
        fn = getattr(lib, name)
        fn.restype = ctypes.c_int
        fn.argtypes = args


def attention_lib() -> ctypes.CDLL | None:
    """The kernels for attention, unless PAGEDLLM_ATTENTION=torch asks for the portable path."""
    if os.environ.get("PAGEDLLM_ATTENTION", "").lower() == "torch":
        return None
    return load()


ERRORS = {
    -1: "out of memory",
    -2: "bad sizes",
    -3: "a context length outside the block table",
    -4: "a block id outside the cache",
}


def decode_attention(
    lib: ctypes.CDLL,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query per sequence. q: [S, H, D]; caches [blocks, block_size, KVH, D] (D + D / 16 bytes quantized); returns
    [S, H, D] in q's dtype."""
    S, H, D = q.shape
    num_blocks, bs, kvh, _ = k_cache.shape
    if not (
        supports(q, k_cache, v_cache)
        and kv_quant.head_dim(k_cache) == D
        and block_tables.dim() == 2
        and block_tables.shape[0] == S
        and context_lens.shape == (S,)
        and block_tables.dtype == context_lens.dtype == torch.int64
        and block_tables.is_contiguous()
        and context_lens.is_contiguous()
    ):
        raise ValueError("decode_attention: tensors do not match the kernel's layout")
    qf = q.float().contiguous()
    out = torch.empty_like(qf)
    rc = lib.paged_decode_attention(
        out.data_ptr(),
        qf.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_tables.data_ptr(),
        context_lens.data_ptr(),
        S,
        H,
        kvh,
        D,
        bs,
        block_tables.shape[1],
        num_blocks,
        scale,
        kv_quant.KINDS[k_cache.dtype],
        torch.get_num_threads(),
    )
    if rc != 0:
        raise RuntimeError(f"paged_decode_attention failed: {ERRORS.get(rc, rc)}")
    return out.to(q.dtype)


def supports(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether the kernel can take these tensors: on CPU, K and V caches alike, contiguous, of a kind it reads
    (float32, bfloat16, or quantized: kv_quant.py)."""
    return (
        q.device.type == "cpu"
        and k_cache.dtype in kv_quant.KINDS
        and v_cache.shape == k_cache.shape
        and v_cache.dtype == k_cache.dtype
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
    )
