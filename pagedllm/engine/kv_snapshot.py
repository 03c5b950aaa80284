"""A consistent copy of the KV cache's state, for people to look at: the block pool, who holds which block, the queues.

It must be taken on the engine thread between two steps (`AsyncLLMEngine.run_on_engine`, or directly by an
in-process caller such as `bench sweep`): it copies plain lists out of the live structures, so the caller can lay
it out, serialise and draw it while the engine goes on. Nothing here runs unless someone asks for a picture, so
the engine pays nothing while nobody watches.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any

from pagedllm.engine.stats import EngineStats


@dataclass
class RequestState:
    request_id: str
    status: str  # running | waiting | preempted (waiting again, its KV dropped)
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int  # prompt tokens the prefix cache served when the request was first admitted
    kv_tokens: int  # tokens it has KV slots for (0 while waiting)
    num_preemptions: int
    block_ids: list[int] = field(default_factory=list)  # its block table


@dataclass
class KVSnapshot:
    time: float  # wall-clock seconds when taken
    step: int  # engine steps run so far
    allocation: str  # paged | contiguous
    block_size: int
    num_blocks: int
    prefix_caching: bool
    ref_cnt: list[int]  # per block id
    block_hash: list[bytes | None]  # per block id: the prefix-cache key of a full, registered block
    evict_order: list[int]  # free blocks that still cache a prefix, the next one to be evicted first
    requests: list[RequestState]  # every running request, then the head of the waiting queue
    num_waiting: int  # every waiting request, also those past the listed head
    stats: EngineStats


def take_snapshot(engine: Any, max_waiting: int = 64, memo: BlockTokens | None = None) -> KVSnapshot:
    """Copy the pool, the block tables and the queues; call it on the engine thread, between steps.

    `max_waiting` bounds the copy of the waiting queue (a benchmark may queue thousands); `memo`, when given,
    learns the tokens of the full blocks held now (see BlockTokens).
    """
    kv, sched = engine.kv, engine.scheduler
    pool = kv.pool
    if memo is not None:
        memo.record(engine)
    running = [_request_state(r, kv) for r in sched.running]
    waiting = [_request_state(r, kv) for r in itertools.islice(sched.waiting, max_waiting)]
    return KVSnapshot(
        time=time.time(), step=engine.num_steps, allocation=engine.config.kv_allocation,
        block_size=kv.block_size, num_blocks=pool.num_blocks, prefix_caching=kv.enable_caching,
        ref_cnt=[b.ref_cnt for b in pool.blocks], block_hash=[b.block_hash for b in pool.blocks],
        evict_order=[b.block_id for b in pool.free_queue if b.block_hash is not None],
        requests=running + waiting, num_waiting=len(sched.waiting), stats=engine.stats())


def _request_state(req: Any, kv: Any) -> RequestState:
    return RequestState(req.request_id, req.status.value, len(req.prompt_token_ids), req.num_output_tokens,
                        req.num_cached_tokens, kv.req_tokens.get(req.request_id, 0), req.num_preemptions,
                        kv.get_block_ids(req.request_id))


class BlockTokens:
    """The tokens of full, cached blocks, learnt from the requests that held them while someone watched.

    The pool keeps only a block's hash, so a block that went back to the free queue with its prefix still cached
    could not say what it holds. Each snapshot records the held full blocks it has not seen yet; entries whose
    hash the pool no longer caches are dropped once there are more than blocks in the pool.
    """

    def __init__(self) -> None:
        self.by_hash: dict[bytes, list[int]] = {}

    def record(self, engine: Any) -> None:
        kv = engine.kv
        bs = kv.block_size
        for rid, blocks in kv.req_blocks.items():
            req = engine.requests.get(rid)
            if req is None:
                continue
            for i, block in enumerate(blocks):
                if block.block_hash is not None and block.block_hash not in self.by_hash:
                    self.by_hash[block.block_hash] = req.all_token_ids[i * bs:(i + 1) * bs]
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
    holders, tokens = [], []
    for rid, blocks in kv.req_blocks.items():
        for i, b in enumerate(blocks):
            if b is block:
                holders.append(rid)
                req = engine.requests.get(rid)
                if not tokens and req is not None:
                    tokens = req.all_token_ids[i * bs:min((i + 1) * bs, kv.req_tokens.get(rid, 0))]
    if not tokens and block.block_hash is not None and memo is not None:
        tokens = memo.by_hash.get(block.block_hash, [])
    rank = None
    if block.ref_cnt == 0 and block.block_hash is not None:
        order = (b.block_id for b in kv.pool.free_queue if b.block_hash is not None)
        rank = next((i for i, bid in enumerate(order) if bid == block_id), None)
    text = engine.tokenizer.decode(tokens, skip_special_tokens=False) if tokens else ""
    return BlockDetail(block_id, block.ref_cnt, block.block_hash.hex() if block.block_hash else None, rank,
                       holders, list(tokens), text)
