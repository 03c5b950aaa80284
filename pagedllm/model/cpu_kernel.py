"""The CPU decode-attention kernel (csrc/paged_attention.c): built on first use with the system C compiler.

Why a plain C file behind ctypes rather than a torch C++ extension: it compiles in about a second (no torch
headers), needs nothing at install time, and ctypes releases the GIL while it runs. It is built for the host
CPU (-march=native) into ~/.cache/pagedllm/kernels, keyed by the source, the compiler and the CPU, so a machine
builds it once. Where no compiler works, `load()` returns None and attention stays on the portable torch path;
PAGEDLLM_ATTENTION=torch forces that path.

Compiling and linking are two steps on purpose: linking a shared library with -ffast-math makes GCC add a
constructor that turns on flush-to-zero for the whole process when the library loads; compiled with -ffast-math
but linked without it, only the kernel's own arithmetic is affected.
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

import torch  # before the kernel loads, so its libgomp resolves to the one torch has already loaded

log = logging.getLogger("pagedllm.model")

SOURCE = Path(__file__).parent / "csrc" / "paged_attention.c"
COMPILE = ["-O3", "-march=native", "-ffast-math", "-fPIC"]
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
    key_src = SOURCE.read_bytes() + " ".join([*cc, *COMPILE, *LINK, *extra, _host_id(cc)]).encode()
    lib = _cache_dir() / f"paged_attention-{hashlib.sha256(key_src).hexdigest()[:16]}.so"
    if lib.exists():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
        obj, out = Path(tmp) / "kernel.o", Path(tmp) / lib.name
        run = dict(check=True, capture_output=True, text=True, timeout=120)
        subprocess.run([*cc, *COMPILE, *extra, "-c", str(SOURCE), "-o", str(obj)], **run)
        subprocess.run([*cc, *LINK, *extra, str(obj), "-o", str(out), "-lm"], **run)
        os.replace(out, lib)  # atomic: concurrent builders never see a half-written library
    return lib


@lru_cache(maxsize=1)
def load() -> ctypes.CDLL | None:
    """The compiled kernel, or None (with one log line saying why) when it cannot be built here."""
    if os.environ.get("PAGEDLLM_ATTENTION", "").lower() == "torch":
        return None
    cc = shlex.split(os.environ.get("CC", "")) or [shutil.which("cc") or shutil.which("gcc") or ""]
    if not cc[0]:
        log.warning("no C compiler found: decode attention uses the portable torch path (slower)")
        return None
    lib, why = None, ""
    for openmp in (True, False):
        try:
            lib = ctypes.CDLL(str(_build(cc, openmp)))
        except (OSError, subprocess.SubprocessError) as e:
            why = (getattr(e, "stderr", "") or str(e)).strip()[:500]
            continue
        if not openmp:
            log.warning("the CPU attention kernel was built without OpenMP (single-threaded): %s", why)
        break
    if lib is None:
        log.warning("could not build the CPU attention kernel, using the torch path: %s", why)
        return None
    fn = lib.paged_decode_attention
    fn.restype = ctypes.c_int
    fn.argtypes = ([ctypes.c_void_p] * 6 + [ctypes.c_int] * 6
                   + [ctypes.c_int64, ctypes.c_float, ctypes.c_int, ctypes.c_int])
    return lib


ERRORS = {-1: "out of memory", -2: "bad sizes", -3: "a context length outside the block table",
          -4: "a block id outside the cache"}


def decode_attention(lib: ctypes.CDLL, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """One query per sequence. q: [S, H, D]; caches [blocks, block_size, KVH, D]; returns [S, H, D] in q's dtype."""
    S, H, D = q.shape
    num_blocks, bs, kvh, d = k_cache.shape
    if not (supports(q, k_cache, v_cache) and d == D and block_tables.dim() == 2 and block_tables.shape[0] == S
            and context_lens.shape == (S,) and block_tables.dtype == context_lens.dtype == torch.int64
            and block_tables.is_contiguous() and context_lens.is_contiguous()):
        raise ValueError("decode_attention: tensors do not match the kernel's layout")
    qf = q.float().contiguous()
    out = torch.empty_like(qf)
    rc = lib.paged_decode_attention(
        out.data_ptr(), qf.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
        context_lens.data_ptr(), S, H, kvh, D, bs, block_tables.shape[1], num_blocks, scale,
        int(k_cache.dtype == torch.bfloat16), torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"paged_decode_attention failed: {ERRORS.get(rc, rc)}")
    return out.to(q.dtype)


def supports(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether the kernel can take these tensors: on CPU, K and V caches alike, contiguous, float32 or bfloat16."""
    return (q.device.type == "cpu" and k_cache.dtype in (torch.float32, torch.bfloat16)
            and v_cache.shape == k_cache.shape and v_cache.dtype == k_cache.dtype
            and k_cache.is_contiguous() and v_cache.is_contiguous())
