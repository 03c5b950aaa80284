"""What the benchmarks share: where the repository and the anchors' set-up scripts are, the CPU line every figure
names, vLLM's environment and a server's readiness check. Nothing here imports torch at import time:
`cpu_target.select()` must run before torch loads."""

from __future__ import annotations

import os
import platform
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the repository
# ../shared/anchors (the anchors' set-up, README there) beside the checkout, or two levels up from a worktree
ANCHOR_SCRIPTS = str(
    next(
        (p for p in (ROOT.parent / "shared" / "anchors", ROOT.parents[1] / "shared" / "anchors") if p.is_dir()),
        ROOT.parent / "shared" / "anchors",
    )
)


def cpu_line() -> str:
    """The CPU model and the flags that decide the kernels (AVX2, AVX-512, AVX-512 BF16, AMX)."""
    name, flags = platform.processor(), set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    keys = ["avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_int8"]
    import torch

    from pagedllm.model.kernels import cpu_kernel

    lib, target = cpu_kernel.load(), cpu_kernel.cpu_target()
    build = f"kernels: {target} build ({cpu_kernel.isa(lib)['matmul'] if lib else 'none'})"
    capped = f", torch capped to {os.environ['ATEN_CPU_CAPABILITY']}" if "ATEN_CPU_CAPABILITY" in os.environ else ""
    return f"{name}; {' '.join(k for k in keys if k in flags)}; {torch.get_num_threads()} threads; {build}{capped}"


def vllm_env(cmd: str) -> list[str]:
    """A bash command line with vLLM's environment (both cores bound, as the anchors README does). VLLM_PYTHONPATH,
    when set, is vLLM's PYTHONPATH alone (packages its venv lacks, e.g. the torchvision its Qwen3.5 model imports;
    anchors README), so that they never reach pagedllm's processes."""
    return [
        "bash",
        "-c",
        f"export ANCHORS={os.environ['ANCHORS']} "
        f"VLLM_CPU_OMP_THREADS_BIND=${{VLLM_CPU_OMP_THREADS_BIND:-0-1}}; "
        'if [ -n "$VLLM_PYTHONPATH" ]; then export PYTHONPATH="$VLLM_PYTHONPATH"; fi; '
        f"source {ANCHOR_SCRIPTS}/vllm-env.sh; {cmd}",
    ]


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    import httpx

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/v1/models", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(2)
    raise SystemExit(f"no server at {url} after {timeout:.0f} s")
