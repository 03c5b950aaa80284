"""The quantized matmul against oneDNN's dense one at the row counts of batched steps and prefill chunks, per GGML
type, on one decoder layer of a real shape (issue 27 item 5).

Each type's weights are random blocks made byte by byte (random codes, small float16 scales), packed as the
loader packs a GGUF's; dense is oneDNN over the same weights dequantized (float32, and bfloat16 as
--dtype bfloat16 holds them). Kernels:
- q-f32: the quantized kernel, float32 activations, the file's exact weights (direct route up to a few rows,
  the panel GEMM above);
- q-bf16: the same weights with bfloat16 activations (AMX where the CPU has it, else AVX-512 BF16 vdpbf16ps),
  what --dtype bfloat16 runs from the kernel choice's row count on;
- q-dot: the same weights with float32 activations rounded to 16-bit integers per group of 32 (the dot route:
  block_dot in passes of a few rows), for the types the route runs;
- q-i8: the same with the activations rounded to 8-bit integers per group of 32 (the int8 route, qmm_i8.c),
  for the types it runs;
- q-i8x2: the int8 route in two passes of 8-bit codes (x ~ d1 q1 + d1 / 254 q2: the 16-bit route's step, two
  byte products per weight byte);
- dense-f32 / dense-bf16: oneDNN, the weight packed once.
One thread, the fastest of `--repeat` runs in thread CPU time (so that another process taking the core does not
count: the figures stand on a shared machine), each run after reading a buffer larger than the caches unless
--warm: in a step every layer's weights come from memory.

    .venv/bin/python -m benchmarks.kernels.panel_gemm  # 1B shapes, Q4_0 Q4_1 Q8_0 Q4_K Q6_K
    .venv/bin/python -m benchmarks.kernels.panel_gemm --shape 135m --types Q4_0 --rows 8,64
    .venv/bin/python -m benchmarks.kernels.panel_gemm --cpu-target x86-64-v3           # the AVX2 class
    .venv/bin/python -m benchmarks.kernels.panel_gemm --shape nemotron-h-8b --types BF16  # a bf16 folder as stored
    .venv/bin/python -m benchmarks.kernels.panel_gemm --matrices 4096x21504 --types BF16 --rows 512,2048
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

if __name__ == "__main__":  # before torch loads: the class to build and measure (cpu_target.py)
    from benchmarks import cpu_target

    cpu_target.select()

import numpy as np
import torch

from benchmarks.common import cpu_line
from pagedllm.model.formats.gguf_quants import GGML_TYPES, block_shape, from_gguf_blocks
from pagedllm.model.kernels import quant_linear as quant
from pagedllm.model.kernels.onednn_linear import linear, pack

SHAPES = {  # one decoder layer's matmuls (out x in): qkv, o, gate_up, down
    "1b": [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)],  # Llama-3.2-1B
    "135m": [(960, 576), (576, 576), (3072, 576), (576, 1536)],  # SmolLM2-135M, the default model
    "8b": [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)],  # Llama-3.1-8B
    # Nemotron-H-8B: a Mamba2 layer's in / out projections, an attention layer's qkv / o, the MLP's up / down
    "nemotron-h-8b": [(17504, 4096), (4096, 8192), (5120, 4096), (4096, 4096), (21504, 4096), (4096, 21504)],
}
F16_AT = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0], "Q4_K": [0, 2], "Q5_K": [0, 2]}
F16_AT |= {"Q6_K": [208], "Q2_K": [80, 82], "Q3_K": [108]}


def random_weight(name: str, n: int, k: int, seed: int) -> quant.QuantWeight:
    """A packed weight of GGML type `name`: random bytes, its float16 scale fields small finite numbers."""
    ggml_type = next(t for t, s in GGML_TYPES.items() if s == name)
    rng = np.random.default_rng(seed)
    if name in ("F16", "BF16"):  # the values themselves: random bytes would hold NaNs and infinities
        w = torch.from_numpy(rng.normal(0, 0.02, (n, k)).astype(np.float32))
        raw = w.to(torch.float16 if name == "F16" else torch.bfloat16).view(torch.uint8).numpy()
        return quant.pack(from_gguf_blocks(raw.reshape(n, -1), ggml_type))
    per, nbytes = block_shape(ggml_type)
    raw = rng.integers(0, 256, (n, k // per, nbytes), dtype=np.uint8)
    for at in F16_AT[name]:
        raw[..., at : at + 2] = rng.normal(0, 0.01, (n, k // per, 1)).astype(np.float16).view(np.uint8)
    return quant.pack(from_gguf_blocks(raw.reshape(n, -1), ggml_type))


def best_ms(fns: list, tries: int, evict: torch.Tensor | None) -> float:
    """The fastest of `tries` runs of all of `fns` in turn, in this thread's CPU time."""
    for fn in fns:
        fn()
    best = float("inf")
    for _ in range(tries):
        if evict is not None:
            evict.sum()
        t = time.thread_time()
        for fn in fns:
            fn()
        best = min(best, time.thread_time() - t)
    return best * 1e3


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="1b", choices=sorted(SHAPES))
    p.add_argument("--matrices", default=None, help="OUTxIN,... in place of --shape's (e.g. 4096x21504: one matrix)")
    p.add_argument("--types", default="Q4_0,Q4_1,Q8_0,Q4_K,Q6_K")
    p.add_argument("--rows", default="8,16,64,256")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--warm", action="store_true", help="leave the weights in the cache between runs")
    cpu_target.add_argument(p)
    a = p.parse_args()
    torch.set_num_threads(1)
    print(f"CPU: {cpu_line()}; bfloat16 kernel: {quant.bf16_kernel()}; torch {torch.__version__}; 1 thread")
    evict = None if a.warm else torch.zeros(64 << 18)  # 64 MiB: twice an L3 of 32 MiB
    rows, shapes, dense = [int(r) for r in a.rows.split(",")], SHAPES[a.shape], {}
    if a.matrices:
        shapes = [(int(n), int(k)) for n, k in (m.split("x") for m in a.matrices.split(","))]
    flops = {r: 2 * r * sum(n * k for n, k in shapes) for r in rows}
    print(f"ms for {shapes}; ratio = quantized / dense of the same activation dtype; q-bf16 GFLOPS")
    for name in a.types.split(","):
        ws = [random_weight(name, n, k, i) for i, (n, k) in enumerate(shapes)]
        for w in ws:
            w.amx_min_rows = 1  # bfloat16 activations take the bfloat16 kernel at every row count
        for r in rows:
            xs = [torch.randn(r, w.k) for w in ws]
            xb = [x.bfloat16() for x in xs]
            if r not in dense:  # the same dequantized weights for every type: random codes of any format
                ds = [quant.qrows(w, torch.arange(w.n)) for w in ws]
                dense[r] = {}
                for dt, xx, dd in (("f32", xs, ds), ("bf16", xb, [d.bfloat16() for d in ds])):
                    fns = [lambda x=x, d=d, p=pack(d): linear(x, d, packed=p) for x, d in zip(xx, dd)]
                    dense[r][dt] = best_ms(fns, a.repeat, evict)
            qf = best_ms([lambda x=x, w=w: quant.qlinear(x, w) for x, w in zip(xs, ws)], a.repeat, evict)
            line = f"{name:5}{r:5} rows: q-f32 {qf:8.2f} dense-f32 {dense[r]['f32']:8.2f} ({qf / dense[r]['f32']:.2f}x)"
            if all(w.fmt in quant.DOT_FORMATS for w in ws):
                dots = [dataclasses.replace(w, dot=True) for w in ws]
                qd = best_ms([lambda x=x, w=w: quant.qlinear(x, w) for x, w in zip(xs, dots)], a.repeat, evict)
                line += f" | q-dot {qd:8.2f} ({qd / dense[r]['f32']:.2f}x)"
            if all(w.fmt in quant.I8_FORMATS for w in ws):
                i8s = [dataclasses.replace(w, i8_min_rows=1) for w in ws]
                qi = best_ms([lambda x=x, w=w: quant.qlinear(x, w) for x, w in zip(xs, i8s)], a.repeat, evict)
                line += f" | q-i8 {qi:8.2f} ({qi / dense[r]['f32']:.2f}x)"
                i8s = [dataclasses.replace(w, i8_passes=2) for w in i8s]
                qi = best_ms([lambda x=x, w=w: quant.qlinear(x, w) for x, w in zip(xs, i8s)], a.repeat, evict)
                line += f" | q-i8x2 {qi:8.2f} ({qi / dense[r]['f32']:.2f}x)"
            if quant.bf16_kernel() is not None:
                qb = best_ms([lambda x=x, w=w: quant.qlinear(x, w) for x, w in zip(xb, ws)], a.repeat, evict)
                line += f" | q-bf16 {qb:8.2f} dense-bf16 {dense[r]['bf16']:8.2f} ({qb / dense[r]['bf16']:.2f}x)"
                line += f" {flops[r] / qb / 1e6:.0f} / {flops[r] / dense[r]['bf16'] / 1e6:.0f} GFLOPS"
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
