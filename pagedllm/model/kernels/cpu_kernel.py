"""The CPU kernels (csrc/*.c: decode attention, quantized matmuls, the fused decode step): built on first use
with the system C compiler into one library.

Why plain C files behind ctypes rather than a torch C++ extension: they compile in seconds (no torch headers),
need nothing at install time, and ctypes releases the GIL while they run. The library is built for the host
CPU (-march=native) into ~/.cache/pagedllm/kernels, keyed by the sources, the compiler and the CPU, so a machine
builds it once. Where no compiler works, `load()` returns None: attention stays on the portable torch path and
quantized weights are dequantized to the dense path. PAGEDLLM_ATTENTION=torch forces torch attention.

PAGEDLLM_CPU_TARGET (native, x86-64-v4, x86-64-v3, x86-64) builds for a CPU class instead of this CPU, so that
one machine can run, test and time the code another class gets (an AVX-512 machine runs the AVX2 build too).
The library says which vector path each of its kernels was compiled with (`isa()`): a build of a vector class
that silently fell back to the portable C path is caught by the tests instead of being shipped as slow.

Compiling and linking are two steps on purpose: linking a shared library with -ffast-math makes GCC add a
constructor that turns on flush-to-zero for the whole process when the library loads; compiled with -ffast-math
but linked without it, only the kernel's own arithmetic is affected. Only attention gets -ffast-math: the
matmuls must sum in a fixed order (batch invariance), so nothing there may be reassociated.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import logging
import os
import platform
import re
import shlex
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import torch  # before the kernel loads, so its libgomp resolves to the one torch has already loaded

import pagedllm.model.kernels.kv_quant as kv_quant

log = logging.getLogger("pagedllm.model")

CSRC = Path(__file__).parent / "csrc"
# (source, extra compile flags)
SOURCES = [
    ("paged_attention.c", ["-ffast-math"]),
    ("qmm_f32.c", []),
    ("qmm_dot.c", []),
    ("qmm_i8.c", []),
    ("qmm_bf16.c", []),
    ("quant_pack.c", []),
    ("model_step.c", []),
    ("moe.c", []),
    ("lora.c", []),
    ("recurrent.c", []),
]
COMPILE = ["-O3", "-fno-math-errno", "-fPIC", "-Wno-psabi"]  # psabi: 64-byte vectors on AVX2
LINK = ["-shared"]
OPENMP = ["-fopenmp"]  # without OpenMP the same source builds a single-threaded kernel
# CPU classes: the -march of each, and the /proc/cpuinfo flags a CPU needs to run that build (x86-64-v3 is
# Haswell / Zen 1 and later: AVX2, FMA, F16C; x86-64-v4 adds AVX-512 F/BW/CD/DQ/VL; x86-64 is the portable C).
TARGETS = {"native": "native", "x86-64-v4": "x86-64-v4", "x86-64-v3": "x86-64-v3", "x86-64": "x86-64"}
_NEEDS = {
    "x86-64-v3": {"avx2", "fma", "f16c", "bmi2", "movbe"},
    "x86-64-v4": {"avx2", "fma", "f16c", "bmi2", "movbe", "avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"},
    "x86-64": set(),
}
# What a build of each class must report (`isa()["matmul"]`); a native build reports what the CPU has.
EXPECTED_ISA = {"x86-64-v4": "avx512", "x86-64-v3": "avx2", "x86-64": "portable"}


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_target() -> str:
    """The class to build for: PAGEDLLM_CPU_TARGET, default native."""
    target = os.environ.get("PAGEDLLM_CPU_TARGET", "").strip() or "native"
    if target not in TARGETS:
        raise ValueError(f"PAGEDLLM_CPU_TARGET={target!r}: use one of {', '.join(TARGETS)}")
    return target


def runnable_targets() -> list[str]:
    """The classes this machine can execute (always native; the x86-64 levels on an x86 CPU that has them)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return ["native"]
    flags = cpu_flags()
    return ["native"] + [t for t, need in _NEEDS.items() if need <= flags]


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


SEAL = b"PLKSUM01"  # after the library: the sha256 of every byte before it, then these 8 bytes
MISSING = "missing"
MAX_LIBRARY_BYTES = 1 << 26  # a build is a few hundred KiB; a file past 64 MiB is not one


def _sealed(path: Path) -> str:
    """ "" when `path` is a regular file (not a link) that ends in the digest of all its bytes before the seal,
    else why not (MISSING when nothing is there). Why a digest: a library is loaded into the process, and one
    that was truncated (a full disk, a copy cut short) can crash it with SIGBUS inside dlopen instead of
    failing; the digest is checked before the file is ever mapped. The loader ignores bytes past the ELF's end."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return MISSING
    except OSError as e:
        return f"{type(e).__name__}: {e.strerror}"
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return "not a regular file"
    with os.fdopen(fd, "rb") as f:
        data = f.read(MAX_LIBRARY_BYTES + 1)
    n = len(SEAL) + 32
    if len(data) > MAX_LIBRARY_BYTES or len(data) <= n or data[-len(SEAL) :] != SEAL:
        return f"{len(data)} bytes without a seal"
    if hashlib.sha256(data[:-n]).digest() != data[-n : -len(SEAL)]:
        return "its bytes do not match their digest"
    return ""


def _seal(path: Path) -> None:
    """Append the seal that `_sealed` checks to a library just built."""
    with open(path, "r+b") as f:
        digest = hashlib.sha256(f.read()).digest()
        f.write(digest + SEAL)


def _compile(cc: list[str], compile_flags: list[str], extra: list[str], out: Path) -> None:
    """Compile SOURCES side by side (one compiler per source: the build of a CPU class is the wait of the
    slowest file, not of all of them in a row) and link them into the library `out` (in a folder of its own)."""
    objs = [str(out.parent / (name + ".o")) for name, _ in SOURCES]
    procs = [
        subprocess.Popen(
            [*cc, *compile_flags, *flags, *extra, "-c", str(CSRC / name), "-o", obj],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for (name, flags), obj in zip(SOURCES, objs)
    ]
    failed = None
    for proc in procs:
        try:
            log, _ = proc.communicate(timeout=900)  # minutes on a busy machine
        except subprocess.TimeoutExpired:
            proc.kill()
            log, _ = proc.communicate()
        if proc.returncode and failed is None:
            failed = subprocess.CalledProcessError(proc.returncode, proc.args, output=log, stderr=log)
    if failed is not None:
        raise failed
    run: dict[str, Any] = dict(check=True, capture_output=True, text=True, timeout=900)
    subprocess.run([*cc, *LINK, *extra, *objs, "-o", str(out), "-lm"], **run)


def _open(path: Path) -> ctypes.CDLL:
    """The library at `path` with every entry point declared; OSError when it lacks one or its `kernel_isa`
    cannot be read (a file of other sources under this name): never a half-usable library."""
    lib = ctypes.CDLL(str(path))
    try:
        _declare(lib)
        isa(lib)
    except (AttributeError, ValueError) as e:  # UnicodeDecodeError is a ValueError
        raise OSError(f"{path.name} is not a build of these kernels: {e}") from e
    return lib


def _build(cc: list[str], openmp: bool, target: str) -> tuple[ctypes.CDLL, Path]:
    """The kernels kept for these sources, compiler, CPU and flags, loaded, and their file; built (and kept)
    when none is kept or the kept one is not usable (one log line, whatever is found there). The name is only
    ever replaced (atomically, a link included), never written through; where it cannot be (a directory in its
    place), this process loads its own build and says so."""
    extra = OPENMP if openmp else []
    compile_flags = [*COMPILE, f"-march={TARGETS[target]}"]
    key_src = b"".join(p.read_bytes() for p in sorted(CSRC.glob("*.[ch]")))
    key_src += " ".join([*cc, *compile_flags, *LINK, *extra, str(SOURCES), _host_id(cc)]).encode()
    lib = _cache_dir() / f"pagedllm_kernels-{target}-{hashlib.sha256(key_src).hexdigest()[:16]}.so"
    kept = _kept(lib)
    if isinstance(kept, ctypes.CDLL):
        return kept, lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    with _building(lib):
        kept = _kept(lib)  # another process may have built it while this one waited
        if isinstance(kept, ctypes.CDLL):
            return kept, lib
        return _build_into(cc, compile_flags, extra, lib, kept), lib


def _kept(lib: Path) -> ctypes.CDLL | str:
    """The kept library at `lib`, loaded, or why there is none usable (MISSING when nothing is there)."""
    why = _sealed(lib)
    if not why:
        try:
            return _open(lib)
        except OSError as e:
            why = str(e)
    return why


@contextlib.contextmanager
def _building(lib: Path) -> Iterator[None]:
    """One builder of `lib` at a time on this machine (an advisory lock on a file beside it): processes that start
    at once (a server's replicas, parallel test workers) wait for the first build instead of each compiling the
    same library. Where the lock cannot be taken (a read-only or odd filesystem), each builds its own, as
    before; the kept file is only ever replaced atomically either way."""
    try:
        fd = os.open(lib.parent / (lib.name + ".lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
    except OSError:
        fd = -1
    try:
        if fd >= 0:
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        if fd >= 0:
            os.close(fd)  # releases the lock


def _build_into(cc: list[str], compile_flags: list[str], extra: list[str], lib: Path, why: str) -> ctypes.CDLL:
    """Build the library, keep it at `lib` and load it (`why`: what was wrong with the kept one, if anything)."""
    with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
        out = Path(tmp) / lib.name
        _compile(cc, compile_flags, extra, out)
        _seal(out)
        built = _open(out)  # mapped before the rename: the library loaded is the one just built
        why = "" if why == MISSING else f"the kept one was not usable ({why})"
        try:
            os.replace(out, lib)  # atomic: concurrent builders never see a half-written library
        except OSError as e:
            log.warning("could not keep the CPU kernels in %s (%s)%s: this process uses its own build", lib, e, why)
            return built
    if why:
        log.warning("the CPU kernels in %s were built again: %s", lib, why)
    return built


_paths: dict[str, Path] = {}  # target -> the file `load(target)` names its kernels by


@cache
def load(target: str | None = None) -> ctypes.CDLL | None:
    """The compiled kernels for `target` (default: `cpu_target()`), or None (with one log line saying why) when
    they cannot be built here."""
    target = target or cpu_target()
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
            lib, _paths[target] = _build(cc, openmp, target)
        except (OSError, subprocess.SubprocessError) as e:
            why = (getattr(e, "stderr", "") or str(e)).strip()[:500]
            continue
        if not openmp:
            log.warning("the CPU kernels were built without OpenMP (single-threaded): %s", why)
        break
    if lib is None:
        log.warning("could not build the CPU kernels, using the torch path: %s", why)
        return None
    check_structs(lib)
    return lib


def library_path() -> Path | None:
    """The file of the library `load()` gives (its name names the build), or None where none is built. Where the
    build could not be kept there, the name still keys what is kept beside it (the kernel choice)."""
    return None if load() is None else _paths[cpu_target()]


_CTYPES: dict[str, Any] = {
    "int": ctypes.c_int,
    "int64_t": ctypes.c_int64,
    "float": ctypes.c_float,
    "double": ctypes.c_double,
}


def _c_text(header: str) -> str:
    """csrc/<header> without its comments."""
    return re.sub(r"/\*.*?\*/", "", (CSRC / header).read_text(), flags=re.S)


def _c_type(decl: str, where: str) -> Any:
    """The ctypes type of a C declaration's type (`const float *x`, `int64_t n`, `const char *`): any pointer is
    c_void_p (a char pointer c_char_p, for strings), else int / int64_t / float / double."""
    base = re.match(r"(?:const\s+)?(\w+)", decl.strip())
    if "*" in decl:
        return ctypes.c_char_p if base and base.group(1) == "char" else ctypes.c_void_p
    if base is None or base.group(1) not in _CTYPES:
        raise TypeError(f"{where} has a type the reader does not know: {decl.strip()!r}")
    return _CTYPES[base.group(1)]


@cache
def c_functions(header: str) -> dict[str, tuple[Any, list[Any]]]:
    """The function prototypes of csrc/<header> (`int f(float *out, int n);`, one line or many), as ctypes
    (restype, argtypes): the one declaration of each entry point, read by both sides as the structures are.
    Definitions (a `static inline` body) are not prototypes and are left out."""
    out: dict[str, tuple[Any, list[Any]]] = {}
    proto = r"^[ \t]*((?:const\s+)?\w+[\s*]+?)(\w+)\s*\(([^;{}()]*)\)\s*;"
    for ret, name, args in re.findall(proto, _c_text(header), flags=re.M):
        if ret.split()[0] in ("typedef", "return", "static"):
            continue
        restype = None if ret.strip() == "void" else _c_type(ret, f"{header}: {name}")
        params = [] if args.strip() in ("", "void") else args.split(",")
        out[name] = (restype, [_c_type(re.sub(r"\w+\s*$", "", p), f"{header}: {name}") for p in params])
    return out


def _declare(lib: ctypes.CDLL) -> None:
    """Argument and result types of every entry point the headers declare (c_functions), so that ctypes converts
    Python ints the way C expects; AttributeError where the library lacks one."""
    for header in sorted(p.name for p in CSRC.glob("*.h")):
        for name, (restype, argtypes) in c_functions(header).items():
            fn = getattr(lib, name)
            fn.restype = restype
            fn.argtypes = argtypes


@cache
def c_structs(header: str) -> dict[str, type[ctypes.Structure]]:
    """The `typedef struct { ... } Name;` of csrc/<header> as ctypes structures, field by field: one definition
    of each structure, read by both sides. Knows pointers (any type) and int / int64_t / float / double."""
    out: dict[str, type[ctypes.Structure]] = {}
    for body, name in re.findall(r"typedef struct \{(.*?)\} (\w+);", _c_text(header), flags=re.S):
        fields: list[tuple[str, Any]] = []
        for decl in filter(None, (d.strip() for d in body.split(";"))):
            base, *rest = re.match(r"(?:const\s+)?(\w+)\s+(.*)", decl, flags=re.S).groups()  # type: ignore[union-attr]
            for var in rest[0].split(","):
                ptr, field = var.strip().startswith("*"), var.strip().lstrip("*").strip()
                if not ptr and base not in _CTYPES:
                    raise TypeError(f"{header}: {name}.{field} has a type the reader does not know: {base}")
                fields.append((field, ctypes.c_void_p if ptr else _CTYPES[base]))
        out[name] = type(name, (ctypes.Structure,), {"_fields_": fields})
    return out


STRUCT_HEADERS = {
    "model_step.h": "step_struct_size",
    "moe.h": "moe_struct_size",
    "lora.h": "lora_struct_size",
    "recurrent.h": "rec_struct_size",
}  # header -> its sizeof by name


def check_structs(lib: ctypes.CDLL) -> None:
    """The size check at load: each structure of the headers that Python reads (STRUCT_HEADERS) as ctypes lays
    it out against C's sizeof."""
    for header, fn_name in STRUCT_HEADERS.items():
        sizeof = getattr(lib, fn_name)
        for name, struct in c_structs(header).items():
            c_size = sizeof(name.encode())
            if c_size != ctypes.sizeof(struct):
                raise RuntimeError(
                    f"{header}: {name} is {c_size} bytes in the C build and {ctypes.sizeof(struct)} as read by "
                    "cpu_kernel.c_structs; the reader and the header disagree"
                )


def isa(lib: ctypes.CDLL) -> dict[str, str]:
    """Which vector path each kernel of a built library was compiled with, e.g. {"matmul": "avx2", "dot": "avx2",
    "amx": "no"}: what the compiler saw, not what the CPU has."""
    return dict(kv.split("=", 1) for kv in lib.kernel_isa().decode().split())


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
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query per sequence. q: [S, H, D]; caches [blocks, block_size, KVH, D] (D + 2 bytes quantized); returns
    [S, H, D] in q's dtype. `window`: each query sees only its last `window` positions (itself included);
    `softcap`: scores become softcap * tanh(score / softcap) before the softmax; `sinks` ([H]): one more logit
    per head in the softmax's sum, of a zero value (gpt-oss)."""
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
        and (sinks is None or sinks.shape == (H,))
    ):
        raise ValueError("decode_attention: tensors do not match the kernel's layout")
    qf = q.float().contiguous()
    sink = None if sinks is None else sinks.detach().float().contiguous()
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
        window or 0,
        softcap or 0.0,
        None if sink is None else sink.data_ptr(),
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
