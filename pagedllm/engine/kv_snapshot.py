"""A consistent copy of the KV cache's state, for people to look at: the block pool, who holds which block, the queues.

It must be taken on the engine thread between two steps (`AsyncLLMEngine.run_on_engine`, or directly by an
in-process caller such as `bench sweep`): it copies plain lists out of the live structures, so the caller can lay
it out, serialise and draw it while the engine goes on. Nothing here runs unless someone asks for a picture, so
the engine pays nothing while nobody watches.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from pagedllm.engine.stats import recurrent_state_stats


@dataclass
class RequestState:
    request_id: str
    status: str  # running | waiting | preempted (waiting again, its KV dropped)
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int  # prompt tokens the prefix cache served when the request was first admitted
    kv_tokens: int  # tokens it has KV slots for (0 while waiting)
    num_preemptions: int
    block_ids: list[int] = field(default_factory=list)  # its block table, without the skipped entries
    skipped_blocks: int = 0  # leading table entries given back to the pool: out of the sliding window
    group_blocks: list[int] = field(default_factory=list)  # blocks it holds in each KV-cache group


@dataclass
class KVSnapshot:
    time: float  # wall-clock seconds when taken
    step: int  # engine steps run so far
    allocation: str  # paged | contiguous
    block_size: int
    num_blocks: int
    prefix_caching: bool
    ref_cnt: list[int]  # per block id, as the pool has it (a block held but in no table would show)
    hashed_ids: list[int]  # the blocks registered in the prefix cache (full ones, held or free) ...
    hashes: list[bytes]  # ... and their keys, in the same order
    evict_order: list[int] | None  # free blocks still caching a prefix, next evicted first (None: not copied)
    requests: list[RequestState]  # every running request, then the head of the waiting queue
    num_waiting: int  # every waiting request, also those past the listed head
    # The engine's cumulative counters: prefix_cache_queries, prefix_cache_hits (tokens), num_preemptions,
    # prompt_tokens, generation_tokens.
    counters: dict[str, int] = field(default_factory=dict)
    kv_cache_dtype: str = "float32"  # what a cached value is stored as (--kv-cache-dtype, resolved)
    # The KV-cache groups, each with its own block tables: {"window": int | None, "layers": [...], "frees_blocks":
    # bool, "blocks": blocks the running requests hold in it}
    kv_groups: list[dict] = field(default_factory=list)
    # A hybrid model's state slots and checkpoints (stats.RecurrentStateStats's fields, with its "mixer" and
    # "slots_free"); None without linear-attention layers
    recurrent_state: dict | None = None
    # The blocks that hold a hybrid model's recurrent-state checkpoint (kv/state_slots.py), free or held by a hit
    checkpoint_ids: list[int] = field(default_factory=list)


def take_snapshot(
    engine: Any, max_waiting: int = 64, memo: BlockTokens | None = None, evict_order: bool = True
) -> KVSnapshot:
    """Copy the pool, the block tables and the queues; call it on the engine thread, between steps.

    Its cost is one pass over the pool's ref counts plus the cached and held blocks: `max_waiting` bounds the copy
    of the waiting queue (a benchmark may queue thousands), `evict_order=False` skips the walk of the free queue
    (a map that aggregates blocks into cells does not show it), and `memo`, when given, learns the tokens of the
    full blocks that became held since the last snapshot (see BlockTokens).
    """
    kv, sched = engine.kv, engine.scheduler
    pool = kv.pool
    if memo is not None:
        memo.record(engine)
    running = [_request_state(r, kv) for r in sched.running]
    waiting = [_request_state(r, kv) for r in itertools.islice(sched.waiting, max_waiting)]
    order = [b.block_id for b in pool.free_queue if b.block_hash is not None] if evict_order else None
    counters = {
        "prefix_cache_queries": kv.prefix_stats.queries,
        "prefix_cache_hits": kv.prefix_stats.hits,
        "num_preemptions": sched.num_preemptions,
        "prompt_tokens": engine.prompt_tokens,
        "generation_tokens": engine.generation_tokens,
    }
    return KVSnapshot(
        time=time.time(),
        step=engine.num_steps,
        allocation=engine.config.kv_allocation,
        block_size=kv.block_size,
        num_blocks=pool.num_blocks,
        prefix_caching=kv.enable_caching,
        ref_cnt=[b.ref_cnt for b in pool.blocks],
        hashed_ids=[b.block_id for b in pool.cached.values()],
        hashes=list(pool.cached),
        evict_order=order,
        requests=running + waiting,
        num_waiting=len(sched.waiting),
        counters=counters,
        kv_cache_dtype=str(engine.kv_dtype).removeprefix("torch."),
        kv_groups=_groups(engine, running),
        recurrent_state=_recurrent_state(engine),
        checkpoint_ids=_checkpoint_ids(kv),
    )


def _checkpoint_ids(kv: Any) -> list[int]:
    rs = getattr(kv, "recurrent", None)
    ck = None if rs is None else rs.checkpoints
    return [] if ck is None else ck.block_ids()


def _recurrent_state(engine: Any) -> dict | None:
    rs = recurrent_state_stats(engine.kv)
    if rs is None:
        return None
    mixer = getattr(getattr(engine, "model_config", None), "recurrent_mixer", "gated_deltanet")
    return {"mixer": mixer, **asdict(rs), "slots_free": rs.slots - rs.slots_used}


def _groups(engine: Any, running: list[RequestState]) -> list[dict]:
    layout = getattr(engine, "kv_layout", None)
    if layout is None:
        return []
    return [
        {
            "window": g.window,
            "layers": list(g.layers),
            "frees_blocks": g.window is not None,
            "blocks": sum(r.group_blocks[i] for r in running if i < len(r.group_blocks)),
        }
        for i, g in enumerate(layout.groups)
    ]


def _request_state(req: Any, kv: Any) -> RequestState:
    skipped = kv.num_skipped_blocks(req.request_id)
    return RequestState(
        req.request_id,
        req.status.value,
        len(req.prompt_token_ids),
        req.num_output_tokens,
        req.num_cached_tokens,
        kv.req_tokens.get(req.request_id, 0),
        req.num_preemptions,
        kv.get_block_ids(req.request_id)[skipped:],
        skipped,
        kv.group_block_counts(req.request_id),
    )


class BlockTokens:
    """The tokens of full, cached blocks, learnt from the requests that held them while someone watched.

    The pool keeps only a block's hash, so a block that went back to the free queue with its prefix still cached
    could not say what it holds. Each snapshot records, per running request, the full blocks registered since the
    last one (a table only grows at its end, so that is a few blocks, not the pool); entries whose hash the pool no
    longer caches are dropped once there are more than blocks in the pool.
    """

    def __init__(self) -> None:
        self.by_hash: dict[bytes, list[int]] = {}
        self.done: dict[str, int] = {}  # request id -> leading blocks of its table already recorded

    def record(self, engine: Any) -> None:
        kv = engine.kv
        bs = kv.block_size
        done = {}
        for rid, blocks in kv.req_blocks.items():
            req = engine.requests.get(rid)
            full = min(len(blocks), kv.req_tokens.get(rid, 0) // bs) if req is not None else 0
            for i in range(self.done.get(rid, 0), full):
                if blocks[i].block_hash is not None:
                    self.by_hash.setdefault(blocks[i].block_hash, req.all_token_ids[i * bs : (i + 1) * bs])
            done[rid] = full
        self.done = done
        if len(self.by_hash) > kv.pool.num_blocks:
            cached = kv.pool.cached
            self.by_hash = {h: t for h, t in self.by_hash.items() if h in cached}


@dataclass
class BlockDetail:
    block_id: int
    ref_cnt: int
    block_hash: str | None  # full hex
    evict_rank: int | None  # 0: the next block a new allocation takes; None: not a free block caching a prefix
    holders: list[str]  # request ids whose block table holds it
    token_ids: list[int]  # the tokens whose KV it holds ([] if unknown: freed before anyone watched)
    text: str


def block_detail(engine: Any, block_id: int, memo: BlockTokens | None = None) -> BlockDetail:
    """One block's holders and tokens (decoded), for a click on the page; call it on the engine thread."""
    kv = engine.kv
    bs = kv.block_size
    block = kv.pool.blocks[block_id]
    holders: list[str] = []
    tokens: list[int] = []
    for rid, blocks in kv.req_blocks.items():
        for i, b in enumerate(blocks):
            if b is block:
                holders.append(rid)
                req = engine.requests.get(rid)
                if not tokens and req is not None:
                    tokens = req.all_token_ids[i * bs : min((i + 1) * bs, kv.req_tokens.get(rid, 0))]
    if not tokens and block.block_hash is not None and memo is not None:
        tokens = memo.by_hash.get(block.block_hash, [])
    rank = None
    if block.ref_cnt == 0 and block.block_hash is not None:
        order = (b.block_id for b in kv.pool.free_queue if b.block_hash is not None)
        rank = next((i for i, bid in enumerate(order) if bid == block_id), None)
    text = engine.tokenizer.decode(tokens, skip_special_tokens=False) if tokens else ""
    return BlockDetail(
        block_id, block.ref_cnt, block.block_hash.hex() if block.block_hash else None, rank, holders, list(tokens), text
    )
