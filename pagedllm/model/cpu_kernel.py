"""The CPU decode-attention kernel (csrc/paged_attention.c): built on first use with the system C compiler.

Why a plain C file behind ctypes rather than a torch C++ extension: it compiles in about a second (no torch
headers), needs nothing at install time, and ctypes releases the GIL while it runs. It is built for the host
CPU (-march=native) into ~/.cache/pagedllm/kernels, keyed by the source, compiler and CPU, so a machine
builds it once. Where no compiler works, `load()` returns None and attention stays on the portable torch path;
PAGEDLLM_ATTENTION=torch forces that path.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

import torch

log = logging.getLogger("pagedllm.model")

SOURCE = Path(__file__).parent / "csrc" / "paged_attention.c"
FLAGS = ["-O3", "-march=native", "-ffast-math", "-fPIC", "-shared"]
OPENMP = ["-fopenmp"]  # dropped, leaving a single-threaded kernel, where the compiler has no OpenMP


def _cache_dir() -> Path:
    root = os.environ.get("PAGEDLLM_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "pagedllm")
    return Path(root) / "kernels"


def _cpu_id() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return next((line for line in f if line.startswith("flags")), platform.processor())
    except OSError:
        return platform.processor()


def _build(cc: str, flags: list[str]) -> Path:
    src = SOURCE.read_bytes()
    key = hashlib.sha256(src + " ".join([cc, *flags, _cpu_id()]).encode()).hexdigest()[:16]
    lib = _cache_dir() / f"paged_attention-{key}.so"
    if lib.exists():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
        out = Path(tmp) / lib.name
        subprocess.run([cc, *flags, str(SOURCE), "-o", str(out), "-lm"], check=True, capture_output=True,
                       text=True, timeout=120)
        os.replace(out, lib)  # atomic: concurrent builders never see a half-written library
    return lib


@lru_cache(maxsize=1)
def load() -> ctypes.CDLL | None:
    """The compiled kernel, or None (with one log line saying why) when it cannot be built here."""
    if os.environ.get("PAGEDLLM_ATTENTION", "").lower() == "torch":
        return None
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        log.warning("no C compiler found: decode attention uses the portable torch path (slower)")
        return None
    import torch  # noqa: F401  (loaded first, so the kernel's libgomp resolves to torch's own)

    lib = None
    for flags in (FLAGS + OPENMP, FLAGS):
        try:
            lib = ctypes.CDLL(str(_build(cc, flags)))
            break
        except (OSError, subprocess.SubprocessError) as e:
            detail = (getattr(e, "stderr", "") or str(e)).strip()[:500]
    if lib is None:
        log.warning("could not build the CPU attention kernel, using the torch path: %s", detail)
        return None
    fn = lib.paged_decode_attention
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_int, ctypes.c_int]
    return lib


def decode_attention(lib: ctypes.CDLL, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """One query per sequence. q: [S, H, D]; caches [blocks, block_size, KVH, D]; returns [S, H, D] in q's dtype."""
    S, H, D = q.shape
    _, bs, kvh, _ = k_cache.shape
    qf = q.float().contiguous()
    out = torch.empty_like(qf)
    rc = lib.paged_decode_attention(
        out.data_ptr(), qf.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
        context_lens.data_ptr(), S, H, kvh, D, bs, block_tables.shape[1], scale,
        int(k_cache.dtype == torch.bfloat16), torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"paged_decode_attention failed with code {rc}")
    return out.to(q.dtype)


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the kernel can take these tensors: CPU, contiguous cache, float32 or bfloat16, head_dim <= 512."""
    return (q.device.type == "cpu" and k_cache.is_contiguous() and q.shape[-1] <= 512
            and k_cache.dtype in (torch.float32, torch.bfloat16))
