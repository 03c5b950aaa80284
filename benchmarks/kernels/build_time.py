"""How long each C kernel source takes to compile, per CPU class: the kernel build is the wait of a first load on
a machine and a large share of the test suite's time (tests/test_cpu_targets.py builds every class).

Each source of csrc/ is compiled alone, one after another, with cpu_kernel.py's flags for the class; the figure
is the compiler's CPU time (user + system, from the children's rusage), which a busy machine disturbs far less
than the wall time, printed next to it. cpu_kernel.py compiles the sources side by side, so a class's build
waits about as long as its slowest file (on enough cores). `--csrc` measures another checkout's sources (the
files there, with this checkout's flags: a file this checkout does not list gets only the common flags).

    .venv/bin/python -m benchmarks.kernels.build_time                                  # native and x86-64-v3
    .venv/bin/python -m benchmarks.kernels.build_time --targets native,x86-64-v4,x86-64-v3,x86-64
    .venv/bin/python -m benchmarks.kernels.build_time --csrc ../other/pagedllm/model/kernels/csrc
"""

from __future__ import annotations

import argparse
import os
import resource
import shlex
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from benchmarks.common import cpu_line
from pagedllm.model.kernels import cpu_kernel


def compile_seconds(cc: list[str], source: Path, target: str, out: Path) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of compiling one source for `target` as cpu_kernel.py does."""
    extra = dict(cpu_kernel.SOURCES).get(source.name, [])
    cmd = [*cc, *cpu_kernel.COMPILE, f"-march={cpu_kernel.TARGETS[target]}", *extra, *cpu_kernel.OPENMP]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run([*cmd, "-c", str(source), "-o", str(out)], check=True, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime, wall


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--targets", default="native,x86-64-v3", help=f"of {', '.join(cpu_kernel.TARGETS)}")
    p.add_argument("--csrc", type=Path, default=cpu_kernel.CSRC, help="the folder of the sources to compile")
    args = p.parse_args()
    cc = shlex.split(os.environ.get("CC", "")) or [shutil.which("cc") or shutil.which("gcc") or "cc"]
    print(cpu_line())
    print(subprocess.run([*cc, "--version"], capture_output=True, text=True).stdout.splitlines()[0])
    sources = sorted(args.csrc.glob("*.c"))
    print(f"{'target':10} {'source':20} {'CPU s':>7} {'wall s':>7}")
    with tempfile.TemporaryDirectory() as tmp:
        for target in args.targets.split(","):
            slowest = 0.0
            for source in sources:
                cpu, wall = compile_seconds(cc, source, target, Path(tmp) / (source.name + ".o"))
                slowest = max(slowest, cpu)
                print(f"{target:10} {source.name:20} {cpu:7.1f} {wall:7.1f}", flush=True)
            print(f"{target:10} {'slowest file':20} {slowest:7.1f}")


if __name__ == "__main__":
    main()
