"""The quantized matmul on every GGML type pagedllm keeps as stored: ms, bytes read and GB/s per type.

For each type, a weight of a real shape (default 8192 x 2048, the 1B models' gate/up) made of random blocks
(random bytes, small float16 scales), packed as the loader packs it, timed at a few row counts on each route
(float32 activations, and the dot route's 16-bit ones: --quantized-activations): 1 row is a
decode step (bound by the weights' bytes; compare its GB/s with `roofline.py --bandwidth`), 64 rows a prefill
chunk (through the dequantized panel). A 1-row figure cycles through copies of the weight adding up to
--cold-mb, so that every call reads from memory as a decode step does, not from the caches. Also prints the
resident bits a weight against the file's. --widened adds, under IQ4_NL and IQ4_XS, the same weight widened to
byte codes (q8_0 / k8, how they ran before they were kept as stored). --clock cpu times the process's CPU time
instead of the wall clock: with one thread, a shared machine's other jobs then hardly move the figure.

    .venv/bin/python -m benchmarks.kernels.gguf_types                          # every type, rows 1 and 64
    .venv/bin/python -m benchmarks.kernels.gguf_types --types Q4_K,Q6_K --rows 1 --cpu-target x86-64-v3
    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.kernels.gguf_types --types Q4_0,MXFP4 --rows 1,64 \
        --shape 5760x2880 --cold-mb 0 --repeat 100  # gpt-oss-20b's expert gate/up, warm
    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.kernels.gguf_types --types IQ4_NL,IQ4_XS --widened \
        --rows 1,64 --clock cpu  # as stored against the widened q8_0 / k8
"""

from __future__ import annotations

import argparse
import dataclasses
import time

if __name__ == "__main__":  # before torch loads: the class to build and measure (cpu_target.py)
    from benchmarks import cpu_target

    cpu_target.select()

import torch

from devkit.ggml_blocks import random_blocks, widened  # noqa: E402  (the tests' byte-by-byte blocks)
from pagedllm.model.formats.gguf_quants import GGML_TYPES, block_shape, from_gguf_blocks  # noqa: E402
from pagedllm.model.kernels import cpu_kernel  # noqa: E402
from pagedllm.model.kernels import quant_linear as quant


def best_ms(fn, repeat: int, clock=time.perf_counter) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        t = clock()
        fn()
        best = min(best, clock() - t)
    return best * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="8192x2048", help="out x in")
    p.add_argument("--types", default=",".join(GGML_TYPES.values()))
    p.add_argument("--rows", default="1,64")
    p.add_argument(
        "--routes",
        default="f32,dot",
        help="f32: float32 activations; dot: rounded to 16 bits; i8: to 8 bits; i8x2: two passes of 8 bits",
    )
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--cold-mb", type=int, default=512, help="bytes of distinct weights the 1-row timing cycles over")
    p.add_argument("--widened", action="store_true", help="IQ4_NL / IQ4_XS also widened to q8_0 / k8")
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall", help="cpu: the process's CPU time")
    cpu_target.add_argument(p)
    args = p.parse_args()
    n, k = (int(v) for v in args.shape.split("x"))
    rows = [int(r) for r in args.rows.split(",")]
    routes = args.routes.split(",")
    lib = cpu_kernel.load()
    isa, threads = cpu_kernel.isa(lib)["matmul"], torch.get_num_threads()
    print(f"kernels: {cpu_kernel.cpu_target()} build ({isa}); {threads} threads; weight {n} x {k}")
    print(
        f"{'type':7s} {'format':6s} {'file b/w':>8s} {'held b/w':>8s} {'MB':>7s}"
        + "".join(f" {f'{rt} {r} rows ms':>15s} {'GB/s':>6s}" for rt in routes for r in rows)
    )
    by_name = {v: t for t, v in GGML_TYPES.items()}
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    cases = []
    for name in args.types.split(","):
        parts = from_gguf_blocks(random_blocks(by_name[name], n, k, 0), by_name[name])
        cases.append((name, parts))
        if args.widened and parts.fmt != widened(parts).fmt:
            cases.append((name, widened(parts)))
    for name, parts in cases:
        w = quant.pack(parts)
        weights, nbytes = block_shape(by_name[name])
        line = f"{name:7s} {w.fmt:6s} {8 * nbytes / weights:8.2f} {8 * w.nbytes / (n * k):8.2f} {w.nbytes / 1e6:7.1f}"
        copies = [w] + [dataclasses.replace(w, tiles=w.tiles.clone()) for _ in range(args.cold_mb * 10**6 // w.nbytes)]
        for rt in routes:
            i8, passes = int(rt in ("i8", "i8x2")), 2 if rt == "i8x2" else 1
            cs = [dataclasses.replace(c, dot=rt == "dot", i8_min_rows=i8, i8_passes=passes) for c in copies]
            for r in rows:
                x, ws = torch.randn(r, k), cs if r == 1 else cs[:1]
                ms = best_ms(lambda x=x, ws=ws: [quant.qlinear(x, c) for c in ws], args.repeat, clock) / len(ws)
                line += f" {ms:15.3f} {w.nbytes / ms / 1e6:6.1f}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
