"""`--cpu-target` for the benchmarks: measure the code another CPU class gets, on this machine.

PAGEDLLM_CPU_TARGET builds pagedllm's kernels for a class (cpu_kernel.py). For a side-by-side figure to stand
for that class, everything else in the run must keep to it too: torch's own kernels (ATEN_CPU_CAPABILITY),
oneDNN (ONEDNN_MAX_CPU_ISA) and MKL (MKL_ENABLE_INSTRUCTIONS) are capped to the same instructions, for
pagedllm's dense paths and for the torch-based anchors (transformers, vLLM) alike; llama.cpp has its own build
per class (`LLAMACPP_TARGET=x86-64-v3 setup-llamacpp.sh`). These variables are read when torch loads, so
`select()` runs before anything imports it.
"""

from __future__ import annotations

import os
import sys

TARGETS = ("native", "x86-64-v4", "x86-64-v3", "x86-64")
CAPS = {
    "x86-64-v3": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "x86-64-v4": {
        "ATEN_CPU_CAPABILITY": "avx512",
        "ONEDNN_MAX_CPU_ISA": "AVX512_CORE",
        "MKL_ENABLE_INSTRUCTIONS": "AVX512",
    },
    "x86-64": {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"},
}


def add_argument(parser) -> None:
    parser.add_argument(
        "--cpu-target",
        default="native",
        choices=TARGETS,
        help="the CPU class to build pagedllm's kernels for and to cap torch/oneDNN/MKL to "
        "(x86-64-v3: AVX2 + FMA + F16C, Haswell / Zen 1-3)",
    )


def select(argv: list[str] | None = None) -> str:
    """The --cpu-target of the command line (default native), put in the environment of this process and of
    every process it starts."""
    argv = sys.argv[1:] if argv is None else argv
    target = "native"
    for i, arg in enumerate(argv):
        if arg == "--cpu-target" and i + 1 < len(argv):
            target = argv[i + 1]
        elif arg.startswith("--cpu-target="):
            target = arg.split("=", 1)[1]
    if target not in TARGETS:
        raise SystemExit(f"--cpu-target {target!r}: use one of {', '.join(TARGETS)}")
    if "torch" in sys.modules:
        raise RuntimeError("cpu_target.select() must run before torch is imported")
    os.environ["PAGEDLLM_CPU_TARGET"] = target
    os.environ.update(CAPS.get(target, {}))
    return target
