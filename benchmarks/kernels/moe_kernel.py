"""The routed experts of one MoE layer (csrc/moe.c) at real models' shapes: bytes of the routed experts read per
step against the machine's read bandwidth.

Shapes (random weights, random routing, every expert equally likely):
- qwen3-30b-a3b: hidden 2048, 128 experts, 8 routed, expert ffn 768, Q4_K gate_up and down;
- gpt-oss-20b: hidden 2880, 32 experts, 4 routed, expert ffn 2880. Its file keeps the experts in MXFP4 (4.25
  bits a weight); 2880 is not a multiple of the K formats' 256, so the figure here is Q4_0 (4.5 bits, the same
  route: nibbles, one scale per 32) until the MXFP4 format lands.
The kernel runs both of its routes (float32 activations; dot: rounded to 16 bits), next to the torch loop
over experts that moe.py runs where the kernel does not (torch-loop: one quantized matmul pair per active
expert). At 1 row the step reads the top-k experts' weights; at 64 rows each expert that some row routes to,
once (with 8 of 128 routed per row, 64 rows touch nearly every expert). "GB/s" is those bytes over the time of the call;
the read bandwidth is roofline.py's (a sum over 1 GiB on every thread). Each figure is the median of --repeat
calls after one warm-up, the layer's weights cycled through --layers copies so that each call reads from
memory, not from the cache (a real model's next layer is elsewhere too).

    .venv/bin/python -m benchmarks.kernels.moe_kernel                      # both shapes, 1 and 64 rows, every route
    .venv/bin/python -m benchmarks.kernels.moe_kernel --shapes qwen3-30b-a3b --rows 1 --routes dot
    .venv/bin/python -m benchmarks.kernels.moe_kernel --cpu-target x86-64-v3
    .venv/bin/python -m benchmarks.kernels.moe_kernel --threads 1             # by CPU time: for a busy machine
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

if __name__ == "__main__":  # before torch loads: the class to build and measure (cpu_target.py)
    from benchmarks import cpu_target

    cpu_target.select()

import numpy as np
import torch

from benchmarks.common import cpu_line
from benchmarks.kernels.roofline import read_bandwidth_gbs
from pagedllm.model.kernels.moe_kernel import MoeExperts
from pagedllm.model.kernels.quant_linear import QuantParts, QuantWeight, pack, qlinear

# name: (hidden, experts, routed, ffn, format)
SHAPES = {"qwen3-30b-a3b": (2048, 128, 8, 768, "q4_k"), "gpt-oss-20b": (2880, 32, 4, 2880, "q4_0")}


def random_weight(fmt: str, n: int, k: int, rng: np.random.Generator) -> QuantWeight:
    """A weight of the format with random codes and small scales (the values do not change the speed)."""

    def f16(*shape: int) -> np.ndarray:
        return rng.normal(0, 0.01, shape).astype(np.float16)

    if fmt == "q4_k":
        codes = rng.integers(0, 16, (n, k), dtype=np.uint8)
        s, mi = rng.integers(0, 64, (n, k // 32), dtype=np.int8), rng.integers(0, 64, (n, k // 32), dtype=np.uint8)
        return pack(QuantParts("q4_k", codes, f16(n, k // 256), f16(n, k // 256), "Q4_K", s, mi))
    codes = rng.integers(-8, 8, (n, k), dtype=np.int8)
    return pack(QuantParts("q4_0", codes, f16(n, k // 32), None, "Q4_0"))


def layer(shape: str, seed: int) -> MoeExperts:
    hidden, experts, _, ffn, fmt = SHAPES[shape]
    rng = np.random.default_rng(seed)
    gate_up = [random_weight(fmt, 2 * ffn, hidden, rng) for _ in range(experts)]
    return MoeExperts(gate_up, [random_weight(fmt, hidden, ffn, rng) for _ in range(experts)])


def torch_loop(ex: MoeExperts, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The same layer as moe.py's torch loop runs it (the path before the kernel): per active expert a
    quantized gate_up, silu * up, a quantized down, index_add back."""
    flat = ids.reshape(-1)
    counts = torch.bincount(flat, minlength=len(ex.gate_up))
    order = torch.argsort(flat, stable=True)
    rows, scale = order // ids.shape[1], w.reshape(-1)[order]
    out, at, ffn = torch.zeros_like(x), 0, ex.down[0].k
    for e, n in enumerate(counts.tolist()):
        if n:
            r = rows[at : at + n]
            h = qlinear(x[r], ex.gate_up[e])
            y = qlinear(torch.nn.functional.silu(h[:, :ffn]) * h[:, ffn:], ex.down[e])
            out.index_add_(0, r, y * scale[at : at + n, None])
            at += n
    return out


def read_gbs(clock, mib: int = 1024, tries: int = 5) -> float:
    """roofline.read_bandwidth_gbs's measure (a sum over 1 GiB, the fastest pass) on `clock`."""
    buf = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
    buf.sum()
    best = float("inf")
    for _ in range(tries):
        t = clock()
        buf.sum()
        best = min(best, clock() - t)
    return buf.numel() * 4 / best / 1e9


def measure(layers: list[MoeExperts], routed: int, rows: int, route: str, repeat: int, clock) -> tuple[float, float]:
    """(median seconds a call, median bytes of the experts it read). route: float32 or dot (the kernel), or
    torch-loop (float32 activations, moe.py's loop over experts)."""
    for ex in layers:
        for w in ex.gate_up + ex.down:
            w.dot = route == "dot"
    hidden, experts = layers[0].hidden, len(layers[0].gate_up)
    per_expert = layers[0].gate_up[0].nbytes + layers[0].down[0].nbytes
    g = torch.Generator().manual_seed(rows)
    times, reads = [], []
    for i in range(repeat + 1):
        ex = layers[i % len(layers)]
        x = torch.randn(rows, hidden, generator=g)
        ids = torch.stack([torch.randperm(experts, generator=g)[:routed] for _ in range(rows)])
        w = torch.softmax(torch.randn(rows, routed, generator=g), -1)
        t = clock()
        torch_loop(ex, x, ids, w) if route == "torch-loop" else ex.forward(x, ids, w)
        if i:
            times.append(clock() - t)
            reads.append(len(ids.unique()) * per_expert)
    return statistics.median(times), statistics.median(reads)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated: {', '.join(SHAPES)}")
    p.add_argument("--rows", default="1,64", help="rows (tokens) per call, comma-separated")
    p.add_argument(
        "--routes",
        default="float32,dot,torch-loop",
        help="float32, dot (16-bit activations), torch-loop (moe.py's loop over experts, for comparison)",
    )
    p.add_argument("--layers", type=int, default=3, help="copies of the layer cycled through (cold caches)")
    p.add_argument("--repeat", type=int, default=15)
    p.add_argument("--threads", type=int, default=0, help="threads (default torch's); 1 times by the thread's CPU time")
    from benchmarks import cpu_target

    cpu_target.add_argument(p)
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    # one thread runs on the calling thread (moe.c's parallel region is off): its CPU time leaves out the time
    # the OS gives other processes, so figures of a busy machine stay comparable
    clock = time.thread_time if a.threads == 1 else time.perf_counter
    print(cpu_line())
    bw = read_gbs(clock) if a.threads == 1 else read_bandwidth_gbs()
    print(f"read bandwidth: {bw:.1f} GB/s ({'thread CPU time' if a.threads == 1 else 'wall time'})")
    print(f"{'shape':15} {'route':8} {'rows':>4} {'ms':>8} {'MB read':>8} {'GB/s':>6} {'of bw':>6} {'tok/s':>8}")
    for shape in a.shapes.split(","):
        _, _, routed, _, _ = SHAPES[shape]
        layers = [layer(shape, seed) for seed in range(a.layers)]
        for route in a.routes.split(","):
            for rows in (int(r) for r in a.rows.split(",")):
                sec, nbytes = measure(layers, routed, rows, route, a.repeat, clock)
                gbs = nbytes / sec / 1e9
                print(
                    f"{shape:15} {route:8} {rows:4d} {sec * 1e3:8.2f} {nbytes / 1e6:8.1f} {gbs:6.1f} "
                    f"{gbs / bw:6.0%} {rows / sec:8.0f}"
                )
        del layers
    return 0


if __name__ == "__main__":
    sys.exit(main())
