"""Micro-benchmark of ModelRunner.execute on the default model: a 64-sequence decode step and a 256-token prefill.

Usage: python benchmarks/model_step.py [--dtypes bfloat16,float32] [--seqs 64] [--ctx 300] [--iters 10]
Prints milliseconds per step (median) and the implied tokens/s.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from pagedllm.kv import cdiv
from pagedllm.model import ModelRunner, SeqChunk, load_model


def bench(dtype: str, seqs: int, ctx: int, prefill: int, iters: int, block_size: int) -> None:
    loaded = load_model(None, dtype=dtype)
    per_seq = cdiv(ctx + iters + 2, block_size)
    runner = ModelRunner(loaded, num_blocks=seqs * per_seq + 64, block_size=block_size)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, loaded.config.vocab_size, (seqs, ctx), generator=g).tolist()
    order = torch.randperm(runner.num_blocks, generator=g).tolist()
    tables = [order[i * per_seq : (i + 1) * per_seq] for i in range(seqs)]
    # fill the contexts (prefill in groups of 8 sequences)
    for i in range(0, seqs, 8):
        runner.execute([SeqChunk(ids[j], 0, tables[j]) for j in range(i, min(seqs, i + 8))])
    times = []
    for it in range(iters):
        chunks = [SeqChunk([5], ctx + it, tables[j]) for j in range(seqs)]
        t = time.perf_counter()
        runner.execute(chunks)
        times.append(time.perf_counter() - t)
    dec = statistics.median(times[1:] if len(times) > 2 else times)
    ptimes = []
    table = order[seqs * per_seq : seqs * per_seq + -(-prefill // block_size)]
    p_ids = torch.randint(3, loaded.config.vocab_size, (prefill,), generator=g).tolist()
    for _ in range(max(3, iters // 3)):
        t = time.perf_counter()
        runner.execute([SeqChunk(p_ids, 0, table)])
        ptimes.append(time.perf_counter() - t)
    pre = statistics.median(ptimes[1:])
    print(
        f"{dtype:9s} decode {seqs} seqs @ ~{ctx} ctx: {dec * 1e3:7.1f} ms/step = {seqs / dec:7.0f} tok/s | "
        f"prefill {prefill} tokens: {pre * 1e3:7.1f} ms = {prefill / pre:7.0f} tok/s",
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=300)
    ap.add_argument("--prefill", type=int, default=256)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--block-size", type=int, default=16)
    a = ap.parse_args()
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}")
    for dt in a.dtypes.split(","):
        bench(dt, a.seqs, a.ctx, a.prefill, a.iters, a.block_size)


if __name__ == "__main__":
    main()
