"""The block map: what each KV block is, laid out as cells, for every picture of the cache.

One layout, several painters: the server's /v1/kv/blocks route answers `block_map(...)` through its response model
(server/kv_page.py, the same field names) and the /kv page paints its cells on a canvas; `pagedllm bench sweep --plot`
and `pagedllm kv-calc --plot` paint the same `BlockMap` with matplotlib (pagedllm.bench.block_map_plot). So the states,
their colours and the aggregation of a large pool into cells are decided here once, and a painter only maps cells to
rectangles.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np

from pagedllm.engine.kv_snapshot import KVSnapshot

# Block states, in the order of the legend and of each cell's counts. A checkpoint block (a hybrid model's
# recurrent state at a block boundary, laid across pool blocks: kv/state_slots.py) is in no block table; free, it
# counts as free and evictable as a cached block does, held by a hit as used.
STATES = ("free", "cached", "used", "shared", "tail", "reserved", "checkpoint")
FREE, CACHED, USED, SHARED, TAIL, RESERVED, CHECKPOINT = range(len(STATES))
COLORS = {
    "free": "#e8ecef",
    "cached": "#9cc3e6",
    "used": "#3f8f5f",
    "shared": "#d9622b",
    "tail": "#f0b429",
    "reserved": "#b9b3c9",
    "checkpoint": "#8e5ca8",
}
LABELS = {
    "free": "free",
    "cached": "free, still caching a prefix (evictable)",
    "used": "held by one request",
    "shared": "shared by several requests",
    "tail": "a request's last block, partly filled",
    "reserved": "reserved but empty (contiguous allocation)",
    "checkpoint": "a recurrent-state checkpoint's block (hybrid prefix cache; evictable unless a hit holds it)",
}


@dataclass
class Counters:
    """The pool's and the queues' counts at the snapshot (KVCounters in server/kv_page.py says each one)."""

    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_evictable_blocks: int
    num_used_blocks: int
    num_shared_blocks: int
    kv_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    prefix_cache_hit_rate: float
    num_preemptions: int
    prompt_tokens: int
    generation_tokens: int
    slots_allocated: int
    tokens_stored: int
    empty_slots: int
    num_checkpoint_blocks: int


@dataclass
class Cells:
    """What a painter needs per cell: a block, or a run of blocks when the pool does not fit in max_cells."""

    blocks_per_cell: int
    columns: int
    states: list[str]
    colors: dict[str, str]
    labels: dict[str, str]
    state: list[int]  # per cell: an index into `states` (a run's most common one)
    ref: list[int]  # per cell: its block's ref count (a run's highest)
    fill: list[int]  # per cell: token slots that hold a token
    counts: list[list[int]] | None  # per cell of a run, its blocks of each state; None when a cell is one block


@dataclass
class BlockInfo:
    """A block that is not plain free (with `detail`)."""

    block_id: int
    state: str
    ref_cnt: int
    hash: str | None  # first 16 hex digits of the prefix-cache key
    evict_rank: int | None  # 0: evicted next
    tokens: int
    holders: list[int]  # indexes into BlockMap.requests


@dataclass
class RequestRow:
    """A listed request and its block table as runs of equal (state, ref count)."""

    request_id: str
    status: str
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int
    prefix_hit_blocks: int
    kv_tokens: int
    num_preemptions: int
    block_ids: list[int]
    skipped_blocks: int
    row: list[list]  # [state, ref_cnt, blocks], in table order
    slots: int
    empty_slots: int


@dataclass
class BlockMap:
    """The whole picture of one snapshot."""

    time: float
    step: int
    allocation: str
    block_size: int
    num_blocks: int
    prefix_caching: bool
    kv_cache_dtype: str
    kv_groups: list[dict]
    recurrent_state: dict | None  # a hybrid model's state slots and checkpoints (KVSnapshot.recurrent_state)
    counters: Counters
    map: Cells
    blocks: list[BlockInfo] | None
    requests: list[RequestRow]
    requests_omitted: int


@dataclass
class _Tables:
    """Every listed request's block table end to end: one numpy pass over all of them, not one per table."""

    ids: np.ndarray  # held block ids, table after table
    tokens: np.ndarray  # the tokens each of those blocks holds for its request
    starts: np.ndarray  # where each request's table starts in `ids`, and its end (len(requests) + 1 entries)


def _tables(snap: KVSnapshot) -> _Tables:
    n = len(snap.requests)
    lens = np.fromiter((len(r.block_ids) for r in snap.requests), dtype=np.int64, count=n)
    starts = np.concatenate(([0], np.cumsum(lens))).astype(np.int64)
    ids = np.fromiter(
        itertools.chain.from_iterable(r.block_ids for r in snap.requests), dtype=np.int64, count=int(starts[-1])
    )
    skipped = np.fromiter((r.skipped_blocks for r in snap.requests), dtype=np.int64, count=n)
    position = np.arange(len(ids)) - np.repeat(starts[:-1], lens) + np.repeat(skipped, lens)
    kv_tokens = np.repeat(np.fromiter((r.kv_tokens for r in snap.requests), dtype=np.int64, count=n), lens)
    return _Tables(ids, np.clip(kv_tokens - snap.block_size * position, 0, snap.block_size), starts)


def _classify(snap: KVSnapshot, tables: _Tables) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per block: its ref count, its state (an index into STATES) and how many of its slots hold a token.

    Ref counts and hashes say free / cached / used / shared, the snapshot's checkpoint ids `checkpoint`; the block
    tables say which slots are filled, so a request's partly filled last block is `tail`, and a contiguous
    request's blocks past its tokens `reserved`.
    """
    ref = np.asarray(snap.ref_cnt, dtype=np.int64)
    state = np.full(snap.num_blocks, FREE, dtype=np.int64)
    fill = np.zeros(snap.num_blocks, dtype=np.int64)
    cached = np.zeros(snap.num_blocks, dtype=bool)
    cached[np.asarray(snap.hashed_ids, dtype=np.int64)] = True
    state[(ref == 0) & cached] = CACHED
    fill[(ref == 0) & cached] = snap.block_size
    state[ref == 1] = USED
    state[ref > 1] = SHARED
    checkpoint_ids = np.asarray(snap.checkpoint_ids, dtype=np.int64)
    state[checkpoint_ids] = CHECKPOINT
    fill[checkpoint_ids] = 0  # a state's bytes, not tokens
    ids, tokens = tables.ids, tables.tokens
    fill[ids] = tokens
    state[ids[tokens == 0]] = RESERVED
    state[ids[(tokens > 0) & (tokens < snap.block_size)]] = TAIL
    return ref, state, fill


def grid(num_blocks: int, max_cells: int) -> tuple[int, int, int]:
    """(blocks per cell, cells, columns): one block per cell while they fit, else equal runs of blocks.

    About twice as wide as tall, so a page and a picture show the pool as one block of cells.
    """
    per_cell = max(1, math.ceil(num_blocks / max(1, max_cells)))
    cells = math.ceil(num_blocks / per_cell)
    columns = min(128, max(8, round(math.sqrt(2 * cells))))
    return per_cell, cells, columns


def block_map(snap: KVSnapshot, max_cells: int = 8192, detail: bool = False) -> BlockMap:
    """The whole picture (the server answers it as KVBlocksResponse, server/kv_page.py).

    The map is what a painter needs per cell (state, ref count, filled slots, and the state counts of a cell that
    aggregates blocks); `detail` adds a record per block that is not plain free (hash, eviction rank, holders),
    which the page does not poll for: it asks /v1/kv/blocks/{id} about the one block under the mouse.
    """
    tables = _tables(snap)
    ref, state, fill = _classify(snap, tables)
    return BlockMap(
        time=snap.time,
        step=snap.step,
        allocation=snap.allocation,
        block_size=snap.block_size,
        num_blocks=snap.num_blocks,
        prefix_caching=snap.prefix_caching,
        kv_cache_dtype=snap.kv_cache_dtype,
        kv_groups=snap.kv_groups,
        recurrent_state=snap.recurrent_state,
        counters=_counters(snap, state, fill),
        map=_cells(snap.num_blocks, max_cells, ref, state, fill),
        blocks=_blocks(snap, state, fill) if detail else None,
        requests=[_request(r, row, snap.block_size) for r, row in zip(snap.requests, _row_runs(tables, ref, state))],
        requests_omitted=snap.num_waiting - sum(r.status != "running" for r in snap.requests),
    )


def _cells(num_blocks: int, max_cells: int, ref: np.ndarray, state: np.ndarray, fill: np.ndarray) -> Cells:
    """Per cell: its (most common) state, highest ref count and filled slots; state counts if it holds a run."""
    per_cell, cells, columns = grid(num_blocks, max_cells)
    if per_cell == 1:
        return Cells(per_cell, columns, list(STATES), COLORS, LABELS, state.tolist(), ref.tolist(), fill.tolist(), None)
    cell_of = np.arange(num_blocks) // per_cell
    counts = np.bincount(cell_of * len(STATES) + state, minlength=cells * len(STATES)).reshape(cells, len(STATES))
    runs = np.zeros((2, cells * per_cell), dtype=np.int64)  # the last cell may be short: pad with free blocks
    runs[0, :num_blocks], runs[1, :num_blocks] = ref, fill
    by_cell = runs.reshape(2, cells, per_cell)
    return Cells(
        per_cell,
        columns,
        list(STATES),
        COLORS,
        LABELS,
        state=counts.argmax(axis=1).tolist(),
        ref=by_cell[0].max(axis=1).tolist(),
        fill=by_cell[1].sum(axis=1).tolist(),
        counts=counts.tolist(),
    )


def _counters(snap: KVSnapshot, state: np.ndarray, fill: np.ndarray) -> Counters:
    c = snap.counters
    ref = np.asarray(snap.ref_cnt, dtype=np.int64)
    checkpoint = state == CHECKPOINT
    evictable = (state == CACHED) | (checkpoint & (ref == 0))
    held = (state >= USED) & ~evictable
    used = int(held.sum())
    slots = int((held & ~checkpoint).sum()) * snap.block_size  # a held checkpoint's block has no token slots
    stored = int(fill[held].sum())
    queries, hits = c.get("prefix_cache_queries", 0), c.get("prefix_cache_hits", 0)
    return Counters(
        num_running=sum(r.status == "running" for r in snap.requests),
        num_waiting=snap.num_waiting,
        num_free_blocks=int(((state == FREE) | evictable).sum()),
        num_evictable_blocks=int(evictable.sum()),
        num_used_blocks=used,
        num_shared_blocks=int((state == SHARED).sum()),
        kv_usage=used / snap.num_blocks,
        prefix_cache_queries=queries,
        prefix_cache_hits=hits,
        prefix_cache_hit_rate=hits / queries if queries else 0.0,
        num_preemptions=c.get("num_preemptions", 0),
        prompt_tokens=c.get("prompt_tokens", 0),
        generation_tokens=c.get("generation_tokens", 0),
        slots_allocated=slots,
        tokens_stored=stored,
        empty_slots=slots - stored,
        num_checkpoint_blocks=int(checkpoint.sum()),
    )


def _blocks(snap: KVSnapshot, state: np.ndarray, fill: np.ndarray) -> list[BlockInfo]:
    """One entry per block that is not plain free: its ref count, short hash, eviction rank and holders."""
    holders: dict[int, list[int]] = {}
    for i, r in enumerate(snap.requests):
        for b in r.block_ids:
            holders.setdefault(b, []).append(i)
    rank = {b: i for i, b in enumerate(snap.evict_order or ())}
    hashes = dict(zip(snap.hashed_ids, snap.hashes))
    out = []
    for b in np.flatnonzero(state != FREE).tolist():
        h = hashes.get(b)
        out.append(
            BlockInfo(
                block_id=b,
                state=STATES[state[b]],
                ref_cnt=snap.ref_cnt[b],
                hash=h.hex()[:16] if h is not None else None,
                evict_rank=rank.get(b),
                tokens=int(fill[b]),
                holders=holders.get(b, []),
            )
        )
    return out


def _row_runs(tables: _Tables, ref: np.ndarray, state: np.ndarray) -> list[list[list]]:
    """Each block table as runs of equal (state, ref count): [state, ref_cnt, blocks], in table order.

    A table of thousands of blocks is then a few runs (shared prefix, own blocks, tail), cheap to send and draw.
    """
    ids, starts = tables.ids, tables.starts
    key = state[ids] * (1 << 32) + ref[ids]
    cut = np.ones(len(ids), dtype=bool)
    cut[1:] = key[1:] != key[:-1]
    cut[starts[:-1][starts[:-1] < len(ids)]] = True  # a run never spans two tables
    run_starts = np.flatnonzero(cut)
    runs = list(
        zip(
            [STATES[k] for k in state[ids[run_starts]].tolist()],
            ref[ids[run_starts]].tolist(),
            np.diff(np.append(run_starts, len(ids))).tolist(),
        )
    )
    edges = np.searchsorted(run_starts, starts).tolist()
    return [[list(run) for run in runs[a:b]] for a, b in zip(edges[:-1], edges[1:])]


def expand_row(row: list[list]) -> list[tuple[str, int]]:
    """Runs back to one (state, ref count) per block of the table."""
    return [(state, ref) for state, ref, n in row for _ in range(n)]


def _request(r, row: list[list], block_size: int) -> RequestRow:
    slots = len(r.block_ids) * block_size
    stored = r.kv_tokens - r.skipped_blocks * block_size  # the skipped blocks' tokens went back with them
    return RequestRow(
        request_id=r.request_id,
        status=r.status,
        prompt_tokens=r.prompt_tokens,
        output_tokens=r.output_tokens,
        cached_tokens=r.cached_tokens,
        prefix_hit_blocks=r.cached_tokens // block_size if r.block_ids else 0,
        kv_tokens=r.kv_tokens,
        num_preemptions=r.num_preemptions,
        block_ids=list(r.block_ids),
        skipped_blocks=r.skipped_blocks,
        row=row,
        slots=slots,
        empty_slots=slots - stored if r.block_ids else 0,
    )
