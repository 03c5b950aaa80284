"""Prefill time of one prompt with and without the int8 route (issue 36, item 2): paired, in one process.

The same GGUF is loaded twice, under --quantized-activations auto (the int8 route from the row count the kernel
choice measured it faster) and int16 (the route before it: 16-bit activations, or q-bf16 past its threshold),
and one prompt of `--tokens` random ids is prefilled in one chunk (the fused step, as a server's first step for
a lone request: the time to the first token, less the scheduler's microseconds), the two loads in alternation,
`--rounds` times; the medians and the ratio of each round's pair are printed. The kernel choice's log line says
which kernel serves which row count.

    .venv/bin/python -m benchmarks.kernels.prefill_ttft                          # the default model
    .venv/bin/python -m benchmarks.kernels.prefill_ttft --cpu-target x86-64-v3   # the AVX2 build
    .venv/bin/python -m benchmarks.kernels.prefill_ttft \
        --model ~/.cache/pagedllm/real-sizes/llama-3.2-1b-random.Q4_0-gguf.gguf
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

if __name__ == "__main__":  # before torch loads: the class to build and measure (cpu_target.py)
    from benchmarks import cpu_target

    cpu_target.select()

import torch

from pagedllm.model import ModelRunner, SeqChunk, load_model


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="GGUF file (default: the default model)")
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--dtype", default="auto")
    cpu_target.add_argument(p)
    a = p.parse_args()
    routes = ("auto", "int16")
    models = {q: load_model(a.model, a.dtype, verbose=False, quantized_activations=q) for q in routes}
    choice = models["auto"].kernel_choice
    blocks = (a.tokens + 15) // 16 + 1
    runners = {q: ModelRunner(m, num_blocks=blocks, block_size=16) for q, m in models.items()}
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(100, models["auto"].config.vocab_size, (a.tokens,), generator=g).tolist()
    times: dict[str, list[float]] = {q: [] for q in routes}
    for r in range(a.rounds + 1):  # round 0: warm-up
        for q in routes if r % 2 else routes[::-1]:
            t = time.perf_counter()
            runners[q].execute([SeqChunk(ids, 0, list(range(blocks)))])
            if r:
                times[q].append(time.perf_counter() - t)
    name = a.model or "the default model"
    kernel = choice.kernel_for(a.tokens) if choice is not None else "?"
    threads = torch.get_num_threads()
    print(f"{name}, {models['auto'].dtype}, {a.tokens}-token prompt, {a.rounds} paired rounds, {threads} threads")
    print(f"  kernel at {a.tokens} rows under auto: {kernel} (int8 from {choice.i8_min_rows if choice else 0} rows)")
    for q in routes:
        print(f"  {q:>6}: median {1e3 * statistics.median(times[q]):8.1f} ms, best {1e3 * min(times[q]):8.1f} ms")
    ratios = [x / y for x, y in zip(times["auto"], times["int16"])]
    print(f"  auto / int16: median of paired ratios {statistics.median(ratios):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
