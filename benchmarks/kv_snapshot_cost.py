"""The /kv page's work per poll, timed in-process on pools of the default size and of 100,000 blocks.

    .venv/bin/python benchmarks/kv_snapshot_cost.py

A real `PagedKVCacheManager` is filled as a busy server's would be (requests of 300 blocks, half of them sharing
a 1,000-token prefix, some finished so that their blocks stay cached in the free queue), then timed:
- `take_snapshot` (with the page's token memo, as the page's poll GET /v1/kv/blocks?max_cells=8192 takes it):
  the part that runs on the engine thread, between two steps; at two polls a second, its share of the engine
  thread is the time x 2;
- `block_map` + `json.dumps`: the part that runs on the server's event loop.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from pagedllm.engine.block_map import block_map
from pagedllm.engine.kv_snapshot import BlockTokens, take_snapshot

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the busy pool the /kv page's test renders
from kv_pool import busy_engine  # noqa: E402 - found through the line above


def timed(fn, repeat: int) -> tuple[float, float, object]:
    """(best, median) seconds of `repeat` calls, and the last result: on a shared machine the best is the code's
    own cost, the median says how much the neighbours added."""
    times, out = [], None
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return min(times), statistics.median(times), out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pools", default="2912,5825,100000",
                   help="pool sizes in blocks (2,912 / 5,825: the default 2 GiB cache of SmolLM2-135M in float32 / "
                        "bfloat16)")
    p.add_argument("--repeat", type=int, default=10)
    args = p.parse_args()
    for num_blocks in (int(x) for x in args.pools.split(",")):
        engine = busy_engine(num_blocks)
        memo = BlockTokens()
        # As the page's poll (GET /v1/kv/blocks?max_cells=8192, no ?detail): no walk of the LRU queue.
        snap_best, snap_med, snap = timed(lambda: take_snapshot(engine, memo=memo, evict_order=False), args.repeat)
        map_best, map_med, m = timed(lambda: block_map(snap), args.repeat)
        json_best, json_med, body = timed(lambda: json.dumps(m, separators=(",", ":")), args.repeat)
        c = m["counters"]
        print(f"{num_blocks:>7,} blocks ({c['num_used_blocks']:,} held, {c['num_shared_blocks']:,} shared, "
              f"{c['num_evictable_blocks']:,} cached-free; {m['map']['blocks_per_cell']} per cell), best / median "
              f"ms: snapshot {1000 * snap_best:.1f} / {1000 * snap_med:.1f} on the engine thread "
              f"({200 * snap_best:.1f}% of it at 2 polls/s); layout {1000 * map_best:.1f} / {1000 * map_med:.1f} + "
              f"JSON {1000 * json_best:.1f} / {1000 * json_med:.1f} on the event loop; {len(body) / 1024:.0f} KiB")


if __name__ == "__main__":
    main()
