"""The block map's data (GET /v1/kv/blocks) against the KV manager's own state, snapshot after snapshot.

A real engine with a 12-block pool runs requests that share a prefix and outgrow the pool, so between steps
there are shared blocks, partly filled tails, a preemption and, at the end, free blocks still caching a prefix.
After every step the laid-out snapshot must validate against the route's pydantic schema and agree with the
pool's ref counts and hashes, the manager's block tables and the scheduler's queues.
"""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest
from engine_helpers import kv_budget

from pagedllm import SamplingParams
from pagedllm.engine import EngineConfig, LLMEngine
from pagedllm.engine.async_engine import AsyncLLMEngine, EngineDeadError
from pagedllm.engine.block_map import STATES, BlockMap, block_map, expand_row, grid
from pagedllm.engine.kv_snapshot import BlockTokens, KVSnapshot, RequestState, block_detail, take_snapshot
from pagedllm.server.kv_page import kv_blocks_json


def engine(model, num_blocks: int, **kw) -> LLMEngine:
    kw.setdefault("max_model_len", 256)
    cfg = EngineConfig(kv_cache_memory=kv_budget(num_blocks), log_stats_interval=0, **kw)
    return LLMEngine(cfg, model)


def check_against_manager(e: LLMEngine, m: BlockMap) -> None:
    """Every field of the map that mirrors engine state equals that state."""
    kv_blocks_json(m)  # the answer the route sends: every field as its model declares
    kv, pool, bs = e.kv, e.kv.pool, e.kv.block_size
    assert m.num_blocks == pool.num_blocks and m.map.blocks_per_cell == 1
    assert [r.request_id for r in m.requests if r.status == "running"] == [r.request_id for r in e.scheduler.running]
    assert [r.request_id for r in m.requests if r.status != "running"] == [r.request_id for r in e.scheduler.waiting]
    listed = {b.block_id: b for b in m.blocks}
    for r in m.requests:
        assert r.block_ids == kv.get_block_ids(r.request_id)
        assert r.kv_tokens == kv.req_tokens.get(r.request_id, 0)
        row = expand_row(r.row)
        assert [ref for _, ref in row] == [pool.blocks[b].ref_cnt for b in r.block_ids]
        assert [state for state, _ in row] == [listed[b].state for b in r.block_ids]
        for i, (b, (state, _)) in enumerate(zip(r.block_ids, row)):  # the states' rule, from the manager
            t = min(bs, max(0, kv.req_tokens[r.request_id] - i * bs))
            ref = pool.blocks[b].ref_cnt
            assert state == ("reserved" if t == 0 else "tail" if t < bs else "shared" if ref > 1 else "used")
    for block in pool.blocks:
        holders = sorted(rid for rid, blocks in kv.req_blocks.items() if block in blocks)
        info = listed.get(block.block_id)
        if info is None:  # plain free: no holder, no cached prefix
            assert block.ref_cnt == 0 and block.block_hash is None and not holders
            continue
        assert info.ref_cnt == block.ref_cnt == len(holders)
        assert info.hash == (block.block_hash.hex()[:16] if block.block_hash else None)
        assert sorted(m.requests[i].request_id for i in info.holders) == holders
        assert (info.state == "shared") == (block.ref_cnt > 1)
        assert (info.state == "cached") == (block.ref_cnt == 0)
    mp = m.map  # the painters' view of the same blocks
    assert mp.counts is None and mp.ref == [b.ref_cnt for b in pool.blocks]
    states = [listed[b].state if b in listed else "free" for b in range(pool.num_blocks)]
    assert [STATES[i] for i in mp.state] == states
    assert mp.fill == [listed[b].tokens if b in listed else 0 for b in range(len(pool.blocks))]
    evictable = [b.block_id for b in pool.free_queue if b.block_hash is not None]
    assert [listed[b].evict_rank for b in evictable] == list(range(len(evictable)))
    c, st = m.counters, e.stats()
    assert c.num_used_blocks == kv.num_used_blocks and c.tokens_stored == st.num_stored_tokens
    assert c.num_free_blocks == kv.num_free_blocks and c.slots_allocated == st.slots_allocated
    assert c.kv_usage == pytest.approx(st.kv_usage) and c.num_running == st.num_running
    assert c.num_evictable_blocks == st.num_cached_blocks
    assert (c.num_preemptions, c.prefix_cache_hits, c.prefix_cache_queries, c.generation_tokens) == (
        st.num_preemptions,
        st.prefix_cache_hits,
        st.prefix_cache_queries,
        st.generation_tokens,
    )


def test_snapshots_agree_with_the_manager_through_sharing_and_preemption(model_fp32):
    e = engine(model_fp32, 12)
    stem = list(range(300, 340))  # 40 tokens: two full blocks every request can share
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)  # 4 x 5 blocks > 12: preemption
    for i in range(4):
        e.add_request(f"s{i}", stem + list(range(1000 + 20 * i, 1005 + 20 * i + i)), params)
    e.add_request("solo", list(range(2000, 2030)), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    memo, seen = BlockTokens(), set()
    while e.has_unfinished_requests():
        e.step()
        m = block_map(take_snapshot(e, memo=memo), detail=True)
        check_against_manager(e, m)
        seen |= {b.state for b in m.blocks} | {r.status for r in m.requests}
        shared = [b for b in m.blocks if b.state == "shared"]
        if shared:
            d = block_detail(e, shared[0].block_id, memo)
            holder = e.requests[d.holders[0]]
            i = e.kv.req_blocks[d.holders[0]].index(e.kv.pool.blocks[d.block_id])
            assert d.token_ids == holder.all_token_ids[i * 16 : (i + 1) * 16] and d.text
    assert {"shared", "tail", "used", "preempted"} <= seen and e.stats().num_preemptions > 0
    m = block_map(take_snapshot(e, memo=memo), detail=True)
    assert m.counters.num_used_blocks == 0 and m.counters.num_evictable_blocks > 0
    first = e.kv.pool.cached[next(iter(e.kv.pool.cached))].block_id
    d = block_detail(e, first, memo)  # freed, but the page saw what it held
    assert d.holders == [] and len(d.token_ids) == 16 and d.evict_rank is not None


def test_the_map_names_the_cache_dtype(model_fp32):
    assert block_map(take_snapshot(engine(model_fp32, 8))).kv_cache_dtype == "float32"
    assert block_map(take_snapshot(engine(model_fp32, 8, kv_cache_dtype="int8"))).kv_cache_dtype == "int8"


def test_contiguous_requests_show_their_reserved_slots(model_fp32):
    e = engine(model_fp32, 40, kv_allocation="contiguous", max_model_len=128)  # 8 blocks reserved per request
    for i, n in enumerate((5, 20, 37)):
        e.add_request(str(i), list(range(400, 400 + n)), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    e.step()
    m = block_map(take_snapshot(e), detail=True)
    check_against_manager(e, m)
    for r in m.requests:
        n = r.kv_tokens
        full, part = divmod(n, 16)
        assert r.slots == 128 and r.empty_slots == 128 - n
        assert [s for s, _ in expand_row(r.row)] == ["used"] * full + ["tail"] * (part > 0) + ["reserved"] * (
            8 - full - (part > 0)
        )
    assert m.counters.empty_slots == sum(128 - r.kv_tokens for r in m.requests)


def synthetic(num_blocks: int, tables: list[list[int]], tokens: list[int]) -> KVSnapshot:
    ref = [0] * num_blocks
    for t in tables:
        for b in t:
            ref[b] += 1
    reqs = [RequestState(f"r{i}", "running", n, 0, 0, n, 0, t) for i, (t, n) in enumerate(zip(tables, tokens))]
    return KVSnapshot(0.0, 0, "paged", 16, num_blocks, True, ref, [], [], None, reqs, 0)


def test_a_100k_block_pool_is_aggregated_into_cells():
    rng = np.random.default_rng(0)
    ids = rng.permutation(100_000)[:30_000].tolist()
    tables = [ids[i : i + 300] for i in range(0, 30_000, 300)]
    snap = synthetic(100_000, tables, [300 * 16 - 5] * len(tables))  # each request's last block has 5 empty slots
    m = block_map(snap, max_cells=8192)  # its cost is benchmarks/kv/page_cost.py's, never a bound here
    per_cell, cells, columns = grid(100_000, 8192)
    assert m.map.blocks_per_cell == per_cell == 13 and len(m.map.counts) == cells <= 8192
    assert len(m.map.state) == len(m.map.ref) == cells and max(m.map.ref) == 1
    totals = np.asarray(m.map.counts).sum(axis=0)
    assert dict(zip(STATES, totals.tolist())) == {
        "free": 70_000,
        "cached": 0,
        "used": 29_900,
        "shared": 0,
        "tail": 100,
        "reserved": 0,
        "checkpoint": 0,
    }
    assert m.blocks is None and sum(m.map.fill) == m.counters.tokens_stored == 100 * (300 * 16 - 5)


def test_run_on_engine_runs_between_steps_on_the_engine_thread():
    class Stepper:
        """Steps take a while and say so; the snapshot function must never see one in progress."""

        def __init__(self):
            self.in_step, self.left, self.threads = False, 30, set()
            self.stepped = threading.Event()  # the first step ran: the engine thread is known

        def has_unfinished_requests(self):
            return self.left > 0

        def step(self):
            self.in_step = True
            self.threads.add(threading.get_ident())
            time.sleep(0.005)
            self.left -= 1
            self.in_step = False
            self.stepped.set()
            return []

        def stats(self):
            return None

    fake = Stepper()
    eng = AsyncLLMEngine(fake)

    def look(e):
        assert not e.in_step and threading.get_ident() in e.threads
        return e.left

    async def main():
        eng.start()
        assert await asyncio.to_thread(fake.stepped.wait, 60)  # not a sleep: a loaded machine starts it late
        return [await eng.run_on_engine(look) for _ in range(5)]

    try:
        lefts = asyncio.run(main())
    finally:
        eng.shutdown()
    assert lefts == sorted(lefts, reverse=True) and len(lefts) == 5
    with pytest.raises(EngineDeadError, match="shut down"):
        asyncio.run(eng.run_on_engine(look))


def test_sweep_pictures_show_each_allocation_at_its_peak(model_fp32, tmp_path):
    from pagedllm.bench.block_map_plot import plot_block_maps
    from pagedllm.bench.sweep import run_engine

    prompts = [list(range(500 + 90 * i, 500 + 90 * i + n)) for i, n in enumerate((20, 70, 35, 50))]
    maps = {}
    for alloc in ("contiguous", "paged"):
        e = engine(model_fp32, 24, kv_allocation=alloc, max_model_len=128)  # contiguous: 8 blocks each, 3 fit
        peaks: list[BlockMap] = []
        res = run_engine(
            e, prompts, 6, np.zeros(len(prompts)), lambda eng, peaks=peaks: peaks.append(block_map(take_snapshot(eng)))
        )
        maps[alloc] = peaks[-1]
        assert peaks[-1].counters.slots_allocated == res["peak_kv_slots_allocated"]
    whole, paged = maps["contiguous"].counters, maps["paged"].counters
    assert whole.num_running == 3 and whole.slots_allocated == 3 * 128 and paged.num_running == 4
    assert paged.empty_slots < 16 * 4 < whole.empty_slots
    plot_block_maps(maps, str(tmp_path / "peak.png"))
    assert (tmp_path / "peak.png").read_bytes()[:4] == b"\x89PNG"
