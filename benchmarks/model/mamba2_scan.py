"""Mamba2's scan (model/layers/mamba2.py) at a Granite-4.0-H-Tiny-like shape: a prompt chunk through the chunked
SSD scan against the same tokens through the token-by-token recurrence (what a loop over a long prompt would
cost), and one decode token of S sequences updated in one batched call.

Shape (one layer's SSM, random inputs): 48 heads x 64 dims, state size 128, one group (hidden 1536, expand 2);
float32, as the mixer runs its scan. Each figure is the median of --repeat calls after one warm-up.

    .venv/bin/python -m benchmarks.model.mamba2_scan                      # 512 prompt tokens, 8 decoding sequences
    .venv/bin/python -m benchmarks.model.mamba2_scan --tokens 2048 --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.common import cpu_line
from pagedllm.model.layers.mamba2 import chunk_scan, recurrent_step

HEADS, HEAD_DIM, STATE = 48, 64, 128


def _median_ms(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=512, help="prompt tokens of the chunk (default: 512)")
    ap.add_argument("--seqs", type=int, default=8, help="decoding sequences in one step (default: 8)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's own)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    L = args.tokens
    x, b, c = torch.randn(L, HEADS, HEAD_DIM), torch.randn(L, HEADS, STATE), torch.randn(L, HEADS, STATE)
    dt = torch.rand(L, HEADS) * 0.1
    a = dt * -torch.rand(HEADS)
    s0 = torch.zeros(HEADS, HEAD_DIM, STATE)

    def loop() -> None:
        state = s0.clone()[None]
        for t in range(L):
            recurrent_step(x[t : t + 1], dt[t : t + 1], a[t : t + 1], b[t : t + 1], c[t : t + 1], state)

    chunked = _median_ms(lambda: chunk_scan(x * dt[..., None], a, b, c, s0), args.repeat)
    looped = _median_ms(loop, args.repeat)
    S = args.seqs
    states = torch.zeros(S, HEADS, HEAD_DIM, STATE)
    decode = _median_ms(lambda: recurrent_step(x[:S], dt[:S], a[:S], b[:S], c[:S], states), args.repeat)
    print(cpu_line())
    print(f"threads {torch.get_num_threads()}; {HEADS} heads x {HEAD_DIM} x state {STATE}, float32")
    print(
        f"prompt of {L} tokens: chunked SSD scan {chunked:.1f} ms, token-by-token loop {looped:.1f} ms "
        f"({looped / chunked:.1f}x)"
    )
    print(f"decode, {S} sequences in one call: {decode:.2f} ms ({decode / S:.3f} ms a sequence)")


if __name__ == "__main__":
    main()
