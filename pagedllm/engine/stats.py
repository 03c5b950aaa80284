"""A snapshot of what the engine is doing: the numbers its log lines, /metrics and benchmarks report."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from pagedllm.engine.scheduler import Scheduler
from pagedllm.engine.spec_decode import SpecDecodeStats
from pagedllm.kv.manager import KVCacheManager
from pagedllm.model.layers.moe import ExpertLoad

logger = logging.getLogger("pagedllm")


@dataclass
class AbortLog:
    """The requests an async engine aborted (disconnects, cancellations, shutdown): how many, and the latest ids,
    bounded by the deque (a server that runs for months keeps the last `maxlen`). /v1/kv shows them."""

    total: int = 0
    recent: deque[str] = field(default_factory=lambda: deque(maxlen=256))

    def record(self, request_id: str) -> None:
        self.total += 1
        self.recent.append(request_id)


@dataclass
class KVGroupStats:
    """One KV-cache group (kv_spec.py): layers that attend alike and share a block table per request."""

    window: int | None  # tokens a query of these layers sees; None: full attention
    layers: list[int]
    blocks: int  # blocks the running requests hold in it now (a shared block once)


@dataclass
class RecurrentStateStats:
    """A hybrid model's recurrent state (kv/state_slots.py): a slot per running request beside its blocks, and the
    prefix cache's checkpoints of it at block boundaries."""

    layers: list[int]  # the linear-attention layers (no KV)
    bytes_per_request: int  # one slot: every such layer's conv and recurrent state
    slots: int  # reserved out of the KV budget (at most --max-num-seqs)
    slots_used: int
    checkpoint_blocks_each: int  # pool blocks one checkpoint takes (0: prefix caching off)
    checkpoints: int  # cached now (all their blocks in the pool)
    checkpoint_blocks: int  # pool blocks those take (free, evictable with the KV blocks, unless held)
    checkpoints_held: int  # of those, held by a prefix hit until it is copied
    checkpoint_disk_loads: int  # read back from the disk tier (cumulative)


def kv_group_stats(kv: KVCacheManager) -> list[KVGroupStats]:
    """Each KV-cache group of the manager's layout with the blocks held in it (none without a layout)."""
    if kv.layout is None:
        return []
    held = kv.group_held_blocks()
    if len(held) != len(kv.layout.groups):  # one table for every group's layers (contiguous allocation)
        return [KVGroupStats(None, sorted(x for g in kv.layout.groups for x in g.layers), held[0])]
    return [KVGroupStats(g.window, list(g.layers), n) for g, n in zip(kv.layout.groups, held)]


def recurrent_state_stats(kv: KVCacheManager) -> RecurrentStateStats | None:
    """The state slots and checkpoints of a hybrid model (None without linear-attention layers)."""
    rs = kv.recurrent
    if rs is None:
        return None
    slots, ck = rs.slots, rs.checkpoints
    cached, blocks = ck.counts() if ck is not None else (0, 0)
    return RecurrentStateStats(
        list(kv.layout.recurrent_layers) if kv.layout is not None else [],
        slots.bytes_per_slot,
        slots.num_slots,
        slots.num_slots - slots.num_free,
        ck.blocks_each if ck is not None else 0,
        cached,
        blocks,
        len(ck.holds) if ck is not None else 0,
        rs.disk_loads,
    )


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_blocks: int
    num_free_blocks: int
    num_cached_blocks: int  # free blocks that still hold a cached prefix (reused on a hit, evicted when needed)
    block_size: int
    kv_usage: float  # share of blocks held by requests
    num_stored_tokens: int  # tokens the running requests keep in the cache
    prefix_cache_queries: int  # prompt tokens looked up (cumulative)
    prefix_cache_hits: int  # prompt tokens found in the cache (cumulative)
    num_preemptions: int  # cumulative
    prompt_tokens: int  # prompt tokens computed (cumulative; cached ones excluded)
    generation_tokens: int  # tokens generated (cumulative)
    peak_running: int  # most requests running at once so far
    num_steps: int
    prefix_cache_disk_hits: int = 0  # of those, tokens read back from the disk tier (--kv-offload-dir)
    # Speculative decoding (cumulative, vLLM's spec_decode counters): a draft is one request's drafts in one step.
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = field(default_factory=list)  # [i]: i-th drafts accepted
    # A mixture of experts (cumulative): tokens routed to an expert (a token counts once per expert per sparse
    # layer), and expert weights read (once per expert a step used, per sparse layer: what decode bytes follow)
    moe_expert_tokens: int = 0
    moe_expert_reads: int = 0
    kv_groups: list[KVGroupStats] = field(default_factory=list)
    recurrent_state: RecurrentStateStats | None = None  # a hybrid model's state slots and checkpoints

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def slots_allocated(self) -> int:
        """Token slots in held blocks, used or not (stored / allocated is the share of them in use)."""
        return self.num_used_blocks * self.block_size

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    @property
    def spec_decode_acceptance_rate(self) -> float:
        return (
            self.spec_decode_num_accepted_tokens / self.spec_decode_num_draft_tokens
            if self.spec_decode_num_draft_tokens
            else 0.0
        )


def collect_stats(
    kv: KVCacheManager,
    scheduler: Scheduler,
    spec: SpecDecodeStats,
    prompt_tokens: int,
    generation_tokens: int,
    num_steps: int,
    expert_load: ExpertLoad | None = None,
) -> EngineStats:
    """The engine's figures: the scheduler's and the KV manager's, the spec-decode counters, the engine's own and
    the model's expert counters (`expert_load`)."""
    return EngineStats(
        num_running=len(scheduler.running),
        num_waiting=len(scheduler.waiting),
        num_blocks=kv.num_blocks,
        num_free_blocks=kv.num_free_blocks,
        num_cached_blocks=kv.num_cached_blocks,
        block_size=kv.block_size,
        kv_usage=kv.usage,
        num_stored_tokens=kv.num_stored_tokens,
        prefix_cache_queries=kv.prefix_stats.queries,
        prefix_cache_hits=kv.prefix_stats.hits,
        prefix_cache_disk_hits=kv.prefix_stats.disk_hits,
        num_preemptions=scheduler.num_preemptions,
        prompt_tokens=prompt_tokens,
        generation_tokens=generation_tokens,
        peak_running=scheduler.peak_running,
        num_steps=num_steps,
        spec_decode_num_drafts=spec.num_drafts,
        spec_decode_num_draft_tokens=spec.num_draft_tokens,
        spec_decode_num_accepted_tokens=spec.num_accepted_tokens,
        spec_decode_num_accepted_tokens_per_pos=list(spec.accepted_per_pos),
        moe_expert_tokens=int(expert_load.tokens.sum()) if expert_load is not None else 0,
        moe_expert_reads=expert_load.reads[0] if expert_load is not None else 0,
        kv_groups=kv_group_stats(kv),
        recurrent_state=recurrent_state_stats(kv),
    )


class StatsLogger:
    """A "busy" log line every `interval` seconds (0: never), with the tokens/s since the last one."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self._time = time.monotonic()
        self._tokens = 0

    def maybe_log(self, stats: Callable[[], EngineStats]) -> None:
        now = time.monotonic()
        if self.interval <= 0 or now - self._time < self.interval:
            return
        s = stats()
        tokens = s.prompt_tokens + s.generation_tokens
        logger.info(
            "running %d, waiting %d, KV usage %.1f%%, prefix-cache hit rate %.1f%%, preemptions %d, %.1f tokens/s",
            s.num_running,
            s.num_waiting,
            100 * s.kv_usage,
            100 * s.prefix_cache_hit_rate,
            s.num_preemptions,
            (tokens - self._tokens) / (now - self._time),
        )
        if s.spec_decode_num_drafts:
            logger.info(
                "speculative decoding: %d drafts, %d draft tokens, %.1f%% accepted, %.2f tokens per draft",
                s.spec_decode_num_drafts,
                s.spec_decode_num_draft_tokens,
                100 * s.spec_decode_acceptance_rate,
                s.spec_decode_num_accepted_tokens / s.spec_decode_num_drafts,
            )
        self._time, self._tokens = now, tokens
