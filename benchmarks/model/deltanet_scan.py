"""The Gated DeltaNet rule (model/layers/deltanet.py) at a real linear-attention layer's shape: a 256-token prompt
chunk through the chunked scan from a carried state, against the same scan with transformers' triangular solve
(torch.linalg.solve_triangular per chunk, what torch_chunk_gated_delta_rule does) and against the token-by-token
recurrence; and one decode token's batched in-place update for 1 and 8 sequences.

Shape: transformers' Qwen3_5TextConfig defaults (the Qwen3.5 line's DeltaNet: 16 key heads and 32 value heads of
128 dims; the rule sees the keys repeated to 32 heads). float32, as the rule always computes. Each figure is the
median of --repeat calls after one warm-up, on --threads threads; with one thread, in CPU time (process time),
so that a busy machine's waits do not count.

    .venv/bin/python -m benchmarks.model.deltanet_scan
    .venv/bin/python -m benchmarks.model.deltanet_scan --tokens 512 --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from benchmarks.common import cpu_line
from pagedllm.model.layers.deltanet import CHUNK, chunk_gated_delta_rule, recurrent_gated_delta_rule

HEADS, DK, DV = 32, 128, 128


def solve_scan(q, k, v, g, beta, state):
    """The chunked scan with transformers' solve_triangular in place of deltanet.py's inverse (for comparison)."""
    L = q.shape[0]
    pad = (CHUNK - L % CHUNK) % CHUNK
    q, k, v = (F.pad(x.transpose(0, 1), (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x.transpose(0, 1), (0, pad)) for x in (g, beta))
    H, n = q.shape[0], q.shape[1] // CHUNK
    v_beta, k_beta = v * beta[..., None], k * beta[..., None]
    q, k, k_beta, v_beta = (x.reshape(H, n, CHUNK, x.shape[-1]) for x in (q, k, k_beta, v_beta))
    cum = g.reshape(H, n, CHUNK).cumsum(-1)
    upper = torch.ones(CHUNK, CHUNK, dtype=torch.bool).triu(1)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()
    system = k_beta @ k.transpose(-1, -2) * decay
    values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(system, k_beta * cum.exp()[..., None], upper=False, unitriangular=True)
    intra = (q @ k.transpose(-1, -2)) * decay
    q, k = q * cum.exp()[..., None], k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]
    out = torch.empty_like(values)
    for i in range(n):
        v_new = values[:, i] - k_cumdecay[:, i] @ state
        out[:, i] = q[:, i] @ state + intra[:, i] @ v_new
        state = state * chunk_decay[:, i] + k[:, i].transpose(-1, -2) @ v_new
    return out.reshape(H, n * CHUNK, -1)[:, :L].transpose(0, 1), state


def token_loop(q, k, v, g, beta, state):
    s = state.clone()[None]
    return torch.cat(
        [
            recurrent_gated_delta_rule(q[t : t + 1], k[t : t + 1], v[t : t + 1], g[t : t + 1], beta[t : t + 1], s)
            for t in range(q.shape[0])
        ]
    )


def median_ms(fn: Callable[[], object], repeat: int) -> float:
    clock = time.process_time if torch.get_num_threads() == 1 else time.perf_counter
    fn()
    times = []
    for _ in range(repeat):
        t = clock()
        fn()
        times.append(clock() - t)
    return statistics.median(times) * 1e3


def inputs(L: int, seqs: int = 0) -> tuple[torch.Tensor, ...]:
    lead = (seqs,) if seqs else (L,)
    q = F.normalize(torch.randn(*lead, HEADS, DK), dim=-1) * DK**-0.5
    k = F.normalize(torch.randn(*lead, HEADS, DK), dim=-1)
    return q, k, torch.randn(*lead, HEADS, DV), -torch.rand(*lead, HEADS), torch.rand(*lead, HEADS)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(cpu_line())
    clock = "CPU time" if args.threads == 1 else "wall time"
    print(f"one Gated DeltaNet layer's rule: {HEADS} heads of {DK}x{DV}, float32, {args.threads} threads, {clock}")
    q, k, v, g, beta = inputs(args.tokens)
    state = torch.randn(HEADS, DK, DV) * 0.1
    with torch.inference_mode():
        out, _ = chunk_gated_delta_rule(q, k, v, g, beta, state)
        ref, _ = solve_scan(q, k, v, g, beta, state)
        print(f"  chunked scan vs solve_triangular: max |diff| {(out - ref).abs().max().item():.2e}")
        for name, fn in (
            ("chunked scan (deltanet.py)", chunk_gated_delta_rule),
            ("chunked scan, solve_triangular", solve_scan),
        ):
            ms = median_ms(lambda fn=fn: fn(q, k, v, g, beta, state), args.repeat)
            print(f"  prefill {args.tokens} tokens, {name}: {ms:.1f} ms")
        ms = median_ms(lambda: token_loop(q, k, v, g, beta, state), max(1, args.repeat // 5))
        print(f"  prefill {args.tokens} tokens, token-by-token recurrence: {ms:.1f} ms")
        for seqs in (1, 8):
            dq, dk, dv, dg, db = inputs(1, seqs)
            states = torch.randn(seqs, HEADS, DK, DV) * 0.1
            ms = median_ms(lambda: recurrent_gated_delta_rule(dq, dk, dv, dg, db, states), args.repeat * 5)
            print(f"  decode, {seqs} sequences, in-place update: {ms:.3f} ms")


if __name__ == "__main__":
    main()
