"""The compute floor of the throughput workload on this machine, and the memory read bandwidth that bounds one
sequence's decode step.

Counts the floating-point work the workload cannot avoid (every prompt and output token through every matmul
of the model, the LM head once per output token, attention over the real context) and divides it by the best
matmul rate this CPU reaches in torch (the model's own weight shapes, hot caches, the fastest of several
tries). Whatever an engine does about memory, batching or scheduling, it cannot finish in less time than that.
Printing the floor next to measured figures says how much headroom is left and whether a target is physical.

    .venv/bin/python -m benchmarks.kernels.roofline                       # 64 x 256 in / 128 out, float32
    .venv/bin/python -m benchmarks.kernels.roofline --compare results.json  # with compare_throughput.py --out tok/s
    .venv/bin/python -m benchmarks.kernels.roofline --bandwidth  # only the read bandwidth (GB/s, all threads)

A one-sequence decode step reads every weight once, so its matmuls cannot beat (weight bytes) / (read bandwidth);
`read_bandwidth_gbs` measures that bandwidth as a sum over a buffer far larger than the caches (the fastest of
several passes, every thread), and step_profile.py / linear_kernels.py report the matmuls' GB/s against it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.nn.functional as F

from pagedllm.model import load_model_config
from pagedllm.model.kernels.onednn_linear import linear, pack


def matmul_shapes(cfg) -> list[tuple[int, int]]:
    """(out, in) of each matmul in one decoder layer: merged qkv, o, merged gate/up, down."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return [
        (q + 2 * kv, cfg.hidden_size),
        (cfg.hidden_size, q),
        (2 * cfg.intermediate_size, cfg.hidden_size),
        (cfg.hidden_size, cfg.intermediate_size),
    ]


def workload_flops(cfg, n: int, inp: int, out: int) -> dict[str, float]:
    layer_params = sum(o * i for o, i in matmul_shapes(cfg))
    tokens = n * (inp + out)
    linear = 2.0 * layer_params * cfg.num_layers * tokens
    lm_head = 2.0 * cfg.vocab_size * cfg.hidden_size * n * out
    # attention: QK^T and PV, 2 * 2 * heads * head_dim flops per (query, key) pair, causal over the real context
    pairs = n * sum(c for c in range(1, inp + out + 1))
    attention = 4.0 * cfg.num_heads * cfg.head_dim * pairs * cfg.num_layers
    return {"linear": linear, "lm_head": lm_head, "attention": attention}


def best_gflops(cfg, dtype: torch.dtype, rows: int, tries: int = 5) -> float:
    """Best matmul rate over the model's layer shapes at `rows` tokens, hot caches, through both F.linear (MKL)
    and oneDNN with a packed weight (what pagedllm uses on CPU), whichever is faster."""
    best = 0.0
    for o, i in matmul_shapes(cfg):
        x, w = torch.randn(rows, i, dtype=dtype), torch.randn(o, i, dtype=dtype)
        packed = pack(w)
        for fn in (lambda: F.linear(x, w), lambda: linear(x, w, packed=packed)):
            fn()
            for _ in range(tries):
                t = time.perf_counter()
                for _ in range(5):
                    fn()
                dt = (time.perf_counter() - t) / 5
                best = max(best, 2.0 * rows * o * i / dt / 1e9)
    return best


def read_bandwidth_gbs(mib: int = 1024, tries: int = 5) -> float:
    """GB/s of reading a buffer of `mib` MiB (well past the last-level cache) with torch's vectorised sum on all
    threads: the rate a decode step's weight reads can reach at best."""
    buf = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
    buf.sum()  # first touch
    best = float("inf")
    for _ in range(tries):
        t = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t)
    return buf.numel() * 4 / best / 1e9


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model folder or GGUF (default: the default model)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--compare", default=None, help="JSON written by compare_throughput.py --out")
    p.add_argument("--bandwidth", action="store_true", help="only measure the read bandwidth")
    a = p.parse_args()
    if a.bandwidth:
        print(f"read bandwidth: {read_bandwidth_gbs():.1f} GB/s ({torch.get_num_threads()} threads)")
        return 0
    cfg = load_model_config(a.model)
    dtype = getattr(torch, a.dtype)
    flops = workload_flops(cfg, a.num_prompts, a.input_len, a.output_len)
    total = sum(flops.values())
    gflops = max(best_gflops(cfg, dtype, r) for r in (64, 512, 2048))
    floor_s = total / (gflops * 1e9)
    n_out = a.num_prompts * a.output_len
    ceiling = n_out / floor_s
    print(
        f"workload: {a.num_prompts} x {a.input_len} in / {a.output_len} out, {a.dtype}, "
        f"{torch.get_num_threads()} threads"
    )
    for k, v in flops.items():
        print(f"  {k:<10}{v / 1e12:8.2f} TFLOP")
    print(f"  {'total':<10}{total / 1e12:8.2f} TFLOP")
    print(f"best matmul rate here: {gflops:.0f} GFLOP/s (model shapes, hot caches, MKL or packed oneDNN)")
    print(f"floor: {floor_s:.1f} s  ->  at most {ceiling:.0f} output tok/s for any engine on these matmuls")
    if a.compare:
        with open(a.compare) as f:
            results = json.load(f)
        for name, r in results.items():
            tps = r["output_tokens_per_s"]
            print(f"  {name:<14}{tps:7.1f} output tok/s = {tps / ceiling:5.1%} of the ceiling")
        if "transformers" in results:
            need = 3 * results["transformers"]["output_tokens_per_s"]
            print(f"3x transformers would need {need:.0f} output tok/s = {need / ceiling:.0%} of the ceiling")
    return 0


if __name__ == "__main__":
    sys.exit(main())
