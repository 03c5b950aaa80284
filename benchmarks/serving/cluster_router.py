"""The prefix router's costs, for sizing it to many replicas (docs/architecture.md, "Past one machine").

Prints, on this CPU: the hashing a request costs the router (the chained sha256 block hashes of its first blocks,
the same the KV cache computes), the time to rank replicas for a request, and the router's memory per million
cached blocks (one index entry per block a replica holds).

    python -m benchmarks.serving.cluster_router [--replicas 100] [--blocks 1000000]
"""

from __future__ import annotations

import argparse
import random
import time
import tracemalloc

from pagedllm.cluster.routing import PrefixIndex, choose, prefix_keys


def per_call_us(fn, repeat: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - t0) / repeat * 1e6


def hashing(block_size: int) -> None:
    rng = random.Random(0)
    for tokens, cap in ((256, 64), (1024, 64), (4096, 64), (4096, 256)):
        ids = [rng.randrange(49152) for _ in range(tokens)]
        us = per_call_us(lambda: prefix_keys(ids, block_size, cap), 300)
        n = min(cap, (tokens - 1) // block_size)
        print(
            f"hash {tokens:5d}-token prompt, first {cap:3d} blocks max: {n:3d} blocks, {us:8.1f} us "
            f"({us / n:.2f} us/block)"
        )


def build_index(replicas: int, blocks: int, block_size: int, capacity: int | None) -> tuple[PrefixIndex, list]:
    """`blocks` cached blocks over `replicas` replicas: chains of 16 blocks (a 256-token shared prefix), each
    held by one replica, a tenth also by a second one (a hot prefix)."""
    rng = random.Random(1)
    index, chains = PrefixIndex(capacity), []
    ids = [f"replica-{i}" for i in range(replicas)]
    for rid in ids:
        index.add_replica(rid)
    stored = 0
    while stored < blocks:
        chain = prefix_keys([rng.randrange(49152) for _ in range(16 * block_size + 1)], block_size, 64)
        owners = rng.sample(ids, 2 if rng.random() < 0.1 else 1)
        for rid in owners:
            index.insert(rid, chain)
        stored += len(chain) * len(owners)
        chains.append(chain)
    return index, chains


def memory(replicas: int, blocks: int, block_size: int) -> None:
    for capacity in (None, blocks // replicas):
        tracemalloc.start()
        index, chains = build_index(replicas, blocks, block_size, capacity)
        held, _ = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        keys = chains[0] + prefix_keys(list(range(200)), block_size, 64)
        ids = index.replicas()
        match_us = per_call_us(lambda: index.match(keys, ids), 300)
        load = {rid: 0 for rid in ids}
        cached = {rid: index.num_blocks(rid) for rid in ids}
        matches = index.match(keys, ids)
        choose_us = per_call_us(lambda: choose(matches, load, cached, 8), 300)
        mode = "exact (kv-events)" if capacity is None else f"LRU-bounded (prefix, {capacity} blocks/replica)"
        print(
            f"index {mode}: {blocks:,} cached blocks on {replicas} replicas, {len(index._holders):,} distinct: "
            f"{held / 2**20:.0f} MiB = {held / blocks:.0f} bytes per cached block; match {match_us:.0f} us, "
            f"choose {choose_us:.0f} us per request"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=100)
    p.add_argument("--blocks", type=int, default=1_000_000)
    p.add_argument("--block-size", type=int, default=16)
    args = p.parse_args()
    hashing(args.block_size)
    memory(args.replicas, args.blocks, args.block_size)


if __name__ == "__main__":
    main()
