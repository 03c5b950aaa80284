"""Which matmul kernel serves which step sizes on this machine: measured once, not assumed.

Why: the fastest kernel depends on the CPU class, the build and the shapes. The quantized kernels beat oneDNN's
dense float32 on AVX-512 at most row counts, but their portable C build (a CPU with no vector path here) can be
slower than dense; the bfloat16-input kernel (AMX or vdpbf16ps) beats the float32 one only past a row count
that differs per CPU.
So on the first load of a model on a machine, each candidate runs the model's own first-layer matmuls (its
real weights and formats) at a few row counts, with the caches emptied before each run (in a step every
layer's weights come from memory; one layer left in the cache would favour dense, 2-8x the bytes):
- q-f32: the quantized kernel with float32 inputs (the file's exact weight values);
- q-dot: the same weights with the inputs rounded to 16-bit integers (the dot route, at every row count when
  it is on), where the build has vector code for it;
- dense: oneDNN over the same weights dequantized to the model's dtype (what `--quantization none` runs);
- q-bf16: the quantized weights with bfloat16 inputs (AMX, else AVX-512 BF16 dot products: `bf16_kernel()`),
  where the CPU has one and the dtype is bfloat16;
- q-i8: the inputs rounded to 8-bit integers per group of 32 (the int8 route, csrc/qmm_i8.c), where the build
  has vector code for it.
and the choice is kept beside the compiled kernels (their file name already names the CPU, compiler, build
class and sources), keyed by the shapes, formats and dtype, so later loads read it.

What is chosen, against the quantized kernel that runs (q-dot where the dot route is on, at every row count;
q-f32 under --quantized-activations none): the weights stay quantized unless dense is faster for one row (decode
of one sequence, where the bytes read decide and which the quantized path exists for); bfloat16 steps run on
q-bf16 from the smallest row count from which it is measured faster than that kernel at every larger one; and
under --quantized-activations int8, steps run on q-i8 from the smallest row count from which it is measured
faster than whatever would run otherwise at every larger one. Why only on request: it rounds each input to
within 1/254 of its group's largest, inside the bound benchmarks/kernels/dot_accuracy.py states
(docs/benchmarks.md: KL and top-1 agreement over a real prompt set) but not transformers' greedy tokens token
for token. A sequence's result does not depend on the batch except across these thresholds. The measurement is
kept once for both settings; the decision is taken again for the setting a load has. The log line says at which
row counts the quantized kernel chosen is still slower than dense, and where the dot route runs although q-f32
measured faster (the route is one switch for every row count). Dense is never kept beside the quantized weights:
a second copy of the weights would come out of the KV cache.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import stat
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

import pagedllm.model.kernels.cpu_kernel as cpu_kernel
from pagedllm.model.kernels.onednn_linear import linear, pack
from pagedllm.model.kernels.quant_linear import QuantWeight, bf16_kernel, qlinear, qrows

log = logging.getLogger("pagedllm.model")

ROWS = (1, 8, 64, 256)
_told: set[Path | None] = set()  # choices already logged by this process (a sweep loads a model many times)


@dataclass(frozen=True)
class KernelChoice:
    quantized: bool  # keep the weights quantized (False: dequantize to the dense path)
    amx_min_rows: int  # bfloat16 steps of at least this many rows run on q-bf16 (AMX or vdpbf16ps); 0: never
    ms: dict[str, dict[int, float]]  # candidate -> rows -> ms for one layer's matmuls
    build: str  # the kernels' class and vector path, e.g. "x86-64-v3 (avx2)"
    dot: bool = True  # the dot route runs where it was measured (False: --quantized-activations none)
    i8_min_rows: int = 0  # steps of at least this many rows run on q-i8; 0: never
    int8: bool = True  # the int8 route may run (False: --quantized-activations int16 or none)
    kept: bool = False  # quantized although dense measured faster for one row (`decide`'s `stored`)

    @property
    def quantized_kernel(self) -> str:
        """The quantized kernel that runs steps below the q-bf16 threshold: q-dot or q-f32."""
        return "q-dot" if self.dot and "q-dot" in self.ms else "q-f32"

    def kernel_for(self, rows: int) -> str:
        if not self.quantized:
            return "dense"
        if self.i8_min_rows and rows >= self.i8_min_rows:
            return "q-i8"
        if self.amx_min_rows and rows >= self.amx_min_rows:
            return "q-bf16"
        return self.quantized_kernel

    def describe(self) -> str:
        """One log line: which kernel serves which step sizes, and the times that decided it."""
        parts = []
        for r in ROWS:
            times = ", ".join(f"{k} {v[r]:.2f}" for k, v in self.ms.items() if r in v)
            parts.append(f"{r} rows -> {self.kernel_for(r)} ({times} ms)")
        if not self.quantized:
            why = "weights dequantized: dense is faster than this build's quantized kernel for one row"
        elif self.kept:
            why = (
                "weights kept as stored although dense timed faster for one row: "
                "this model's layers (recurrent mixers, per-layer inputs) run at speed on the fused C step only"
            )
        else:
            slower = [
                f"{r} ({self.ms[k][r] / self.ms['dense'][r]:.2f}x)"
                for r in ROWS
                if (k := self.kernel_for(r)) in self.ms
                and "dense" in self.ms
                and r in self.ms[k]
                and self.ms[k][r] > self.ms["dense"][r]
            ]
            why = "weights kept quantized: " + (
                f"slower than dense at rows {', '.join(slower)}" if slower else "not slower than dense at any row count"
            )
            dot_slower = [f"{r} ({self.ms['q-dot'][r] / self.ms['q-f32'][r]:.2f}x)" for r in self._dot_slower()]
            if dot_slower:
                why += f"; the dot route is slower than q-f32 at rows {', '.join(dot_slower)}"
        kind = f", q-bf16 on {bf16_kernel()}" if "q-bf16" in self.ms else ""
        return f"matmul kernels, {self.build}{kind}, measured on the first layer's shapes: {'; '.join(parts)}; {why}"

    def _dot_slower(self) -> list[int]:
        """Row counts the dot route serves although q-f32 measured faster there."""
        if not self.quantized or self.quantized_kernel != "q-dot":
            return []
        return [r for r in ROWS if self.kernel_for(r) == "q-dot" and self.ms["q-dot"][r] > self.ms["q-f32"][r]]


def decide(
    ms: dict[str, dict[int, float]], build: str, dot: bool = True, int8: bool = True, stored: bool = False
) -> KernelChoice:
    """The choice that the measured times `ms` (candidate -> rows -> ms) call for, for the quantized kernel that
    runs (`dot`: the dot route where it was measured; `int8`: the int8 route may run, from where it is faster).
    `stored`: the weights stay as stored whatever dense measured (a model with recurrent layers, loader.py), so the
    row counts from which q-bf16 and q-i8 run are decided as for any quantized model, not left at "never"."""
    run = "q-dot" if dot and "q-dot" in ms else "q-f32"
    dense_faster = "dense" in ms and ms[run][1] > ms["dense"][1]
    quantized = stored or not dense_faster
    amx_min_rows = _from_where_faster(ms, "q-bf16", lambda r: ms[run][r]) if quantized else 0

    def below(r: int) -> float:  # what serves r rows where q-i8 does not
        return ms["q-bf16"][r] if amx_min_rows and r >= amx_min_rows else ms[run][r]

    i8_min_rows = _from_where_faster(ms, "q-i8", below) if quantized and int8 and dot else 0
    return KernelChoice(quantized, amx_min_rows, ms, build, dot, i8_min_rows, int8 and dot, stored and dense_faster)


def _from_where_faster(ms: dict[str, dict[int, float]], kernel: str, other: Callable[[int], float]) -> int:
    """The smallest row count from which `kernel` was measured faster than `other(rows)` at that one and every
    larger one (0: not at the largest; nothing measured for it). One threshold, not a list: a step's kernel
    changes once as its rows grow, so a sequence's result depends on its batch only across it."""
    found = 0
    for r in sorted(ms.get(kernel, {}), reverse=True):
        if ms[kernel][r] >= other(r):
            break
        found = r
    return found


def _cache_bytes() -> int:
    """Twice the largest CPU cache sysfs names (64 MiB at least, 1 GiB at most): reading that many bytes leaves
    none of a layer's weights in any cache."""
    largest = 0
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = f.read_text().strip().upper()
            largest = max(largest, int(text.rstrip("KMG")) << {"K": 10, "M": 20, "G": 30}.get(text[-1:], 0))
        except (OSError, ValueError):
            continue
    return min(max(2 * largest, 64 << 20), 1 << 30)


def _best_ms(fns: list, tries: int, evict: torch.Tensor) -> float:
    """The fastest of `tries` runs of `fns` (one layer's matmuls) in turn, each run after reading `evict` so that
    the weights come from memory, as in a step, where every layer's weights are new to the caches (one layer
    left in the cache favours dense, whose weights are 2-8x the bytes). The fastest: a run that another
    process interrupted (this machine may be shared) is left out instead of deciding the choice."""
    for fn in fns:
        fn()  # warm-up: first-touch pages, oneDNN primitive creation
    best = float("inf")
    for _ in range(tries):
        evict.sum()
        t = time.perf_counter()
        for fn in fns:
            fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def _dense(w: QuantWeight, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The weight dequantized (every row of it), in `dtype`, with its oneDNN packing."""
    dense = qrows(w, torch.arange(w.n)).to(dtype)
    return dense, pack(dense)


def measure(
    layer: list[QuantWeight], dtype: torch.dtype, build: str, dot: bool = True, int8: bool = True
) -> KernelChoice:
    """Time each candidate on `layer` (one decoder layer's matmul weights) at ROWS and decide. On one thread:
    the kernels split a matmul the same way whatever the thread count, and one thread cannot be held up by
    another that the OS has put aside."""
    dense = [_dense(w, dtype) for w in layer]
    amx = [QuantWeight(w.fmt, w.n, w.k, w.tiles, w.source, amx_min_rows=1) for w in layer]
    on_dot = [dataclasses.replace(w, dot=True) for w in layer]
    on_i8 = [dataclasses.replace(w, i8_min_rows=1) for w in layer]
    ms: dict[str, dict[int, float]] = {k: {} for k in sorted(_candidates(dtype))}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    evict = torch.zeros(_cache_bytes() // 4)
    try:
        for r in ROWS:
            tries = 5 if r < 64 else 2  # the big steps take milliseconds each: fewer tries keep this well under 1 s
            xs = [torch.randn(r, w.k) for w in layer]
            xd = [x.to(dtype) for x in xs]
            ms["q-f32"][r] = _best_ms([lambda x=x, w=w: qlinear(x, w) for x, w in zip(xs, layer)], tries, evict)
            ms["dense"][r] = _best_ms(
                [lambda x=x, d=d, p=p: linear(x, d, packed=p) for x, (d, p) in zip(xd, dense)], tries, evict
            )
            if "q-bf16" in ms:
                ms["q-bf16"][r] = _best_ms([lambda x=x, w=w: qlinear(x, w) for x, w in zip(xd, amx)], tries, evict)
            if "q-dot" in ms:
                ms["q-dot"][r] = _best_ms([lambda x=x, w=w: qlinear(x, w) for x, w in zip(xs, on_dot)], tries, evict)
            if "q-i8" in ms:
                ms["q-i8"][r] = _best_ms([lambda x=x, w=w: qlinear(x, w) for x, w in zip(xs, on_i8)], tries, evict)
    finally:
        torch.set_num_threads(threads)
    return decide(ms, build, dot, int8)


def _cache_file(layer: list[QuantWeight], dtype: torch.dtype) -> Path | None:
    lib_path = cpu_kernel.library_path()
    if lib_path is None:
        return None
    key = json.dumps([[w.fmt, w.n, w.k] for w in layer] + [str(dtype), ROWS])
    return lib_path.with_name(f"{lib_path.stem}.choice-{hashlib.sha256(key.encode()).hexdigest()[:12]}.json")


CANDIDATES = ("q-f32", "dense", "q-bf16", "q-dot", "q-i8")
MAX_FILE_BYTES = 1 << 16  # a kept choice is a few hundred bytes; more is not one of ours
MAX_MS = 3.6e6  # an hour for one layer's matmuls: a time beyond it was not measured


def _build_name() -> str:
    """The build a choice is measured on: its class and the vector path its matmuls compiled with."""
    lib = cpu_kernel.load()
    return f"{cpu_kernel.cpu_target()} build ({cpu_kernel.isa(lib)['matmul']})" if lib is not None else "none"


def _candidates(dtype: torch.dtype) -> set[str]:
    """The kernels `measure` times for `dtype` on this CPU: a kept choice must have timed exactly these."""
    lib = cpu_kernel.load()
    dot = lib is not None and cpu_kernel.isa(lib)["dot"] != "portable"
    i8 = lib is not None and cpu_kernel.isa(lib)["i8"] != "portable"
    return (
        {"q-f32", "dense"}
        | ({"q-bf16"} if dtype == torch.bfloat16 and bf16_kernel() is not None else set())
        | ({"q-dot"} if dot else set())
        | ({"q-i8"} if i8 else set())
    )


def _finite(text: str) -> float:
    """JSON's numbers as floats, but none that is not finite (`NaN`, `Infinity`, `1e400`): no time is."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is not a measured time")
    return value


def _load_bytes(path: Path) -> bytes:
    """The file's bytes, opened without following a link and only when it is a regular file of a kept choice's
    size: a link, a directory or a FIFO planted in its place is refused rather than read (or waited on)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ValueError("not a regular file")
    with os.fdopen(fd, "rb") as f:
        data = f.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:
        raise ValueError(f"larger than {MAX_FILE_BYTES} bytes")
    return data


def _times(raw: Any) -> dict[int, float]:
    """One candidate's times: a time (finite, from 0 to MAX_MS) for every row count of ROWS, nothing else."""
    if not isinstance(raw, dict) or set(raw) != {str(r) for r in ROWS}:
        raise ValueError(f"times for rows {sorted(raw) if isinstance(raw, dict) else raw!r}, not {ROWS}")
    out = {}
    for r in ROWS:
        t = raw[str(r)]
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t <= MAX_MS:
            raise ValueError(f"time {t!r} for {r} rows")
        out[r] = float(t)
    return out


def _parse(data: bytes, dtype: torch.dtype, build: str, dot: bool = True, int8: bool = True) -> KernelChoice:
    """The choice the bytes keep, checked in full: the keys `asdict` writes, the candidates and rows `measure`
    times here, times in range, this build, and the decision that `decide` takes from those times for the
    setting it was kept under (a file of the right shape with another decision in it is not a measurement); then
    decided again for this load's `dot` and `int8`. Raises ValueError otherwise."""
    raw = json.loads(data.decode("utf-8"), parse_float=_finite, parse_constant=_finite)
    if not isinstance(raw, dict) or set(raw) != {f.name for f in dataclasses.fields(KernelChoice)}:
        raise ValueError("not the fields of a kernel choice")
    if type(raw["dot"]) is not bool or type(raw["int8"]) is not bool:
        raise ValueError("dot or int8 is not of its type")
    if not isinstance(raw["ms"], dict) or set(raw["ms"]) != _candidates(dtype):
        raise ValueError(f"candidates {raw['ms'] if not isinstance(raw['ms'], dict) else sorted(raw['ms'])!r}")
    if raw["build"] != build:
        raise ValueError(f"measured on {raw['build']!r}, not {build!r}")
    ms = {k: _times(raw["ms"][k]) for k in CANDIDATES if k in raw["ms"]}
    kept = decide(ms, build, raw["dot"], raw["int8"])
    if raw["quantized"] is not kept.quantized or any(type(raw[k]) is not int for k in ("amx_min_rows", "i8_min_rows")):
        raise ValueError("quantized, amx_min_rows or i8_min_rows is not of its type")
    if (raw["amx_min_rows"], raw["i8_min_rows"], raw["int8"]) != (kept.amx_min_rows, kept.i8_min_rows, kept.int8):
        raise ValueError("its decision is not the one its times call for")
    return decide(ms, build, dot, int8)


def _read(path: Path, dtype: torch.dtype, build: str, dot: bool, int8: bool) -> tuple[KernelChoice | None, str]:
    """The kept choice, or None and why not ("" when there is none yet: the first load on this machine).
    Whatever the file holds, nothing but a valid choice comes back: the caller measures again."""
    try:
        return _parse(_load_bytes(path), dtype, build, dot, int8), ""
    except FileNotFoundError:
        return None, ""
    except (OSError, ValueError, RecursionError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        return None, f"{type(e).__name__}: {e}"[:200]


def _keep(path: Path, choice: KernelChoice) -> None:
    """Write the choice to `path` through a temporary file of this process's own making (mkstemp: a new name,
    O_EXCL, never through a link or a file someone else put there), renamed in place so that a concurrent first
    load reads all of it or none; the temporary file never stays behind. Raises OSError."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    kept = False
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(json.dumps(asdict(choice), allow_nan=False).encode())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)  # replaces a link in its place, never writes through it
        kept = True
    finally:
        if not kept:
            os.unlink(tmp)


def choose(
    layer: list[QuantWeight], dtype: torch.dtype, dot: bool = True, int8: bool = True, stored: bool = False
) -> KernelChoice:
    """The kept choice for these shapes on this machine, or a new measurement (then kept), decided for `dot` (whether
    the dot route runs), `int8` (whether the int8 route may) and `stored` (the weights stay as stored: `decide`).
    A kept file that is not a valid choice (any bytes, a link, a directory) is measured again with one log line:
    a cache never stops the server from starting."""
    path = _cache_file(layer, dtype)
    build = _build_name()
    choice, why = _read(path, dtype, build, dot, int8) if path is not None else (None, "")
    if choice is None:
        choice = measure(layer, dtype, build, dot, int8)
        if path is not None:
            try:
                _keep(path, choice)
                if why:
                    log.warning("the kernel choice in %s was not usable (%s): measured again", path, why)
            except OSError as e:
                why = f"; it was not usable ({why})" if why else ""
                log.warning("could not keep the kernel choice in %s: %s%s", path, e, why)
    if stored and not choice.quantized:
        choice = decide(choice.ms, choice.build, choice.dot, choice.int8, stored=True)
    if path not in _told:
        _told.add(path)
        log.info(choice.describe())
    return choice
