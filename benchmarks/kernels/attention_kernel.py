"""The C decode-attention kernel alone, at the W1 decode step's shape on the default model.

64 sequences of ~300 tokens (contexts 300 - s % 17), SmolLM2-135M's heads (9 query heads over 3 KV heads of 64),
blocks of 16 tokens shuffled over the cache, one cache per layer for 30 layers so the step reads from memory as
the real one does (~14 MB per layer in bfloat16, more than L3 holds in all). It calls the kernel's own entry
point (`cpu_kernel.decode_attention`, one query per sequence) on one thread and reports CPU time per layer, the
best of --repeat passes over all the layers: CPU time rather than the clock, so that a figure taken on this
shared machine counts the kernel's own work (memory stalls included) and not the time other processes held the
core. It is a kernel figure; `step_profile.py --batch 64` gives the attention phase of the whole fused step.

    .venv/bin/python -m benchmarks.kernels.attention_kernel                      # bfloat16 cache
    .venv/bin/python -m benchmarks.kernels.attention_kernel --kv-dtype float32 --cpu-target x86-64-v3
"""

from __future__ import annotations

import argparse
import sys
import time

if __name__ == "__main__":  # before torch loads: the class to build and measure (cpu_target.py)
    from benchmarks import cpu_target

    cpu_target.select()

import torch

import pagedllm.model.kernels.cpu_kernel as cpu_kernel
import pagedllm.model.kernels.kv_quant as kv_quant
from benchmarks.common import cpu_line
from pagedllm.kv.sizing import KV_DTYPES


def caches(a, dtype: torch.dtype) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor, torch.Tensor]:
    """One (K, V) cache per layer, the block tables (a random permutation of the blocks) and context lengths."""
    g = torch.Generator().manual_seed(0)
    per_seq = -(-(a.ctx + 1) // a.block_size)
    n = a.seqs * per_seq + 1
    shape = kv_quant.cache_shape(n, a.block_size, a.kv_heads, a.head_dim, dtype)
    kv = []
    for _ in range(a.layers):
        if dtype in (torch.float32, torch.bfloat16):
            kv.append(tuple(torch.randn(shape, generator=g).to(dtype) for _ in range(2)))
        else:  # quantized: random codes with a fixed scale (speed does not depend on the values)
            pair = tuple(torch.randint(0, 100, shape, generator=g, dtype=torch.uint8).view(dtype) for _ in range(2))
            for t in pair:
                t.view(torch.uint8)[..., -2:] = torch.tensor([0x80, 0x3C], dtype=torch.uint8)
            kv.append(pair)
    tables = torch.randperm(n, generator=g)[: a.seqs * per_seq].view(a.seqs, per_seq).contiguous()
    lens = torch.tensor([a.ctx - s % 17 for s in range(a.seqs)], dtype=torch.int64)
    return kv, tables, lens


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kv-dtype", default="bfloat16", choices=list(KV_DTYPES), help="a --kv-cache-dtype name")
    p.add_argument("--seqs", type=int, default=64)
    p.add_argument("--ctx", type=int, default=300)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--repeat", type=int, default=5)
    cpu_target.add_argument(p)
    a = p.parse_args()
    lib = cpu_kernel.load()
    if lib is None:
        raise SystemExit("the C kernels are not built here")
    torch.set_num_threads(1)
    kv, tables, lens = caches(a, kv_quant.kv_cache_dtype(a.kv_dtype, torch.float32)[1])
    q = torch.randn(a.seqs, a.heads, a.head_dim, generator=torch.Generator().manual_seed(1))
    best = float("inf")
    for _ in range(a.repeat):
        t = time.process_time()
        for k, v in kv:
            cpu_kernel.decode_attention(lib, q, k, v, tables, lens, a.head_dim**-0.5)
        best = min(best, time.process_time() - t)
    print(f"CPU: {cpu_line()}")
    print(
        f"decode attention, {a.seqs} sequences x ~{a.ctx} tokens, {a.heads}/{a.kv_heads} heads of {a.head_dim}, "
        f"{a.kv_dtype} cache, blocks of {a.block_size}, one thread: {1e3 * best / a.layers:.3f} ms CPU per layer "
        f"(best of {a.repeat} passes over {a.layers} layers)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
