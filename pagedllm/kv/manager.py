"""KV-cache managers: who holds which blocks, and how a request grows.

Two policies share one interface so the engine can measure them side by side:
- `PagedKVCacheManager` (PagedAttention): a request holds ceil(tokens / block_size) blocks per KV-cache group,
  grows by one block when its last one is full, and shares full prefix blocks with other requests through the
  prefix cache. It is vLLM v1's KVCacheManager: a coordinator (coordinator.py) over one manager per group
  (single_type_manager.py: full attention, sliding window) on one block pool, so a model that mixes sliding and
  full layers gives its sliding groups' old blocks back while the full group keeps its own (kv_spec.py).
  The disk tier and kv_blend's segment store plug in behind one seam (connector.py).
- `ContiguousKVCacheManager` (the baseline paging is measured against, "one big locker each"): at admission a
  request reserves room for max_model_len tokens, rounded up to whole blocks, and shares nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from pagedllm.kv.block_pool import BlockPool, KVBlock
from pagedllm.kv.connector import KVConnector
from pagedllm.kv.coordinator import GroupBlocks, KVCacheCoordinator
from pagedllm.kv.hashing import BlockHash, extra_key, hash_full_blocks
from pagedllm.kv.kv_spec import KVCacheLayout, cdiv
from pagedllm.kv.recurrent_state_manager import RecurrentStateManager
from pagedllm.kv.single_type_manager import ContiguousManager, SingleTypeKVCacheManager, make_single_type_manager
from pagedllm.kv.state_slots import StateCheckpoints, StateSlotPool

logger = logging.getLogger("pagedllm")

__all__ = ["KVCacheBlocks", "cdiv"]


class KVRequest(Protocol):
    """What a manager needs to know of a request (the engine's Request satisfies it)."""

    request_id: str
    all_token_ids: list[int]  # prompt + generated so far
    num_computed_tokens: int  # tokens whose KV is already in the cache
    cache_salt: str | None  # extra hash key: requests with different salts never share blocks
    lora_int_id: int  # and its LoRA adapter (0: the base model)


@dataclass
class TokenRequest:
    """The smallest KVRequest: for tools and tests that ask a manager what token sequences would hold and share,
    without an engine (`pagedllm rag bench --count-only` counts cache hits this way)."""

    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int = 0
    cache_salt: str | None = None
    lora_int_id: int = 0


class KVCacheBlocks:
    """A prefix hit: per KV-cache group, its blocks (vLLM's KVCacheBlocks). Read as a sequence it is group 0's
    blocks, which is the whole hit of a model of one group."""

    def __init__(self, groups: GroupBlocks) -> None:
        self.groups = groups

    @staticmethod
    def empty(num_groups: int) -> KVCacheBlocks:
        return KVCacheBlocks([[] for _ in range(num_groups)])

    def __len__(self) -> int:
        return len(self.groups[0])

    def __iter__(self) -> Iterator[KVBlock]:
        return iter(self.groups[0])

    def __getitem__(self, i: Any) -> Any:  # an index or a slice, as a list's
        return self.groups[0][i]

    def __bool__(self) -> bool:
        return bool(self.groups[0])


@dataclass
class PrefixCacheStats:
    """Counted in tokens, as vLLM's prefix_cache_queries / prefix_cache_hits."""

    queries: int = 0
    hits: int = 0
    disk_hits: int = 0  # tokens of `hits` read back from the disk tier (counted when read)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    """The shared bookkeeping; subclasses decide how many blocks a request needs and what it may share."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool) -> None:
        if block_size < 1:
            raise ValueError(f"block size must be at least 1, got {block_size}")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_tokens: dict[str, int] = {}  # tokens each request has slots for (stored or about to be)
        self.prefix_stats = PrefixCacheStats()
        self.peak_used_blocks = 0  # the most blocks requests held at once (a memory figure: docs/benchmarks.md)
        self.layout: KVCacheLayout | None = None  # the model's KV-cache groups and recurrent layers (kv_spec.py)
        # a hybrid model's recurrent-state slots and checkpoints (None without recurrent layers)
        self.recurrent: RecurrentStateManager | None = None
        # What a table holds for a block that fell out of a window: not in the pool, never counted or cached.
        # Its id (0) is any valid block for the kernels, which never read it (the torch path masks it out).
        self.null_block = KVBlock(0)
        self.coordinator = KVCacheCoordinator(self._table_managers(), self.pool, block_size)

    def _table_managers(self) -> list[SingleTypeKVCacheManager]:
        """One manager per group with block tables (each subclass its kind), group 0 first."""
        raise NotImplementedError

    def attach_state_slots(self, slots: StateSlotPool, checkpoints: StateCheckpoints | None = None) -> None:
        """A hybrid model: each request also holds a recurrent-state slot while it runs. A prefix hit then needs
        the state where it ends: without `checkpoints` there is none (every hit is 0), with them a hit ends where
        one lies (recurrent_state_manager.py). The state is one more group of the coordinator, after the table
        groups."""
        self.recurrent = RecurrentStateManager(
            self.pool, self.block_size, self.null_block, slots, checkpoints, self._hashes
        )
        self.coordinator.add(self.recurrent)

    def _hashes(self, request: KVRequest, num_tokens: int) -> list[BlockHash]:
        """The chained hashes of the request's full blocks within its first `num_tokens` tokens (none here: no
        prefix cache)."""
        return []

    def _note_peak(self) -> None:
        self.peak_used_blocks = max(self.peak_used_blocks, self.num_used_blocks)

    @property
    def req_blocks(self) -> dict[str, list[KVBlock]]:
        """Request id -> its block table (group 0's, where a model has several groups)."""
        return self.coordinator.managers[0].req_to_blocks

    @property
    def num_groups(self) -> int:
        return 1

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def enable_caching(self) -> bool:
        return self.pool.enable_caching

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Free blocks that still hold a cached prefix."""
        return self.pool.num_free_cached

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_stored_tokens(self) -> int:
        """Distinct tokens the running requests keep in the cache: a shared block's tokens count once.

        Against `num_used_blocks * block_size` (slots allocated) this is the share of slots in use.
        """
        shared = {id(b): b for blocks in self.req_blocks.values() for b in blocks if b.ref_cnt > 1}
        return sum(self.req_tokens.values()) - sum((b.ref_cnt - 1) * self.block_size for b in shared.values())

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

    def get_group_block_ids(self, request_id: str) -> list[list[int]]:
        """The request's block table of each KV-cache group (what the model runner reads, per layer's group)."""
        return [self.get_block_ids(request_id)]

    def held_block_ids(self, request_id: str) -> set[int]:
        """Every block the request holds, in any group (never the null entries)."""
        return set(self.get_block_ids(request_id)[self.num_skipped_blocks(request_id) :])

    def group_block_counts(self, request_id: str) -> list[int]:
        """Blocks the request holds per group (not counting null entries)."""
        return [len(self.held_block_ids(request_id))]

    def group_held_blocks(self) -> list[int]:
        """Per group, the blocks the requests hold in it, a shared one once."""
        return [len({b.block_id for blocks in self.req_blocks.values() for b in blocks})]

    def num_skipped_blocks(self, request_id: str) -> int:
        """Leading entries of the request's table that went back to the pool (out of a sliding window)."""
        return 0

    def get_computed_blocks(self, request: KVRequest) -> tuple[KVCacheBlocks, int]:
        """The longest chain of cached full blocks of a new request's tokens, and how many tokens it covers."""
        return KVCacheBlocks.empty(self.num_groups), 0

    def shorten_hit(self, request: KVRequest, max_tokens: int) -> tuple[KVCacheBlocks, int]:
        """The request's hit of at most `max_tokens` tokens (it keeps logits from there on)."""
        return KVCacheBlocks.empty(self.num_groups), 0

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count a lookup once its request is admitted (a request that waits is looked up again next step)."""
        self.prefix_stats.queries += num_tokens
        self.prefix_stats.hits += num_hit_tokens

    def allocate_slots(
        self,
        request: KVRequest,
        num_new_tokens: int,
        new_computed_blocks: KVCacheBlocks | Sequence[KVBlock] = (),
        num_lookahead_tokens: int = 0,
    ) -> bool:
        """Make room for `num_new_tokens` more tokens after the computed ones, and `num_lookahead_tokens` after
        those (speculative drafts, not in `all_token_ids`: never registered in the prefix cache); all or nothing.

        False means the pool is too full: nothing changed and the scheduler may preempt and retry.
        """
        raise NotImplementedError

    def trim(self, request: KVRequest, num_tokens: int) -> None:
        """Keep slots for the request's first `num_tokens` tokens only: the rejected drafts' slots are given back
        (so `num_stored_tokens` and later allocations see only real tokens)."""
        if request.request_id in self.req_tokens:
            self.req_tokens[request.request_id] = num_tokens

    def free(self, request: KVRequest) -> None:
        """Return a finished, aborted or preempted request's blocks (and state slot), every group's the tail of
        its chain first.

        The tail goes first because it is the least likely to be shared: when memory runs short, the eviction
        order (least recently freed first) then drops a prompt's last blocks before its first ones.
        """
        self.req_tokens.pop(request.request_id, None)
        self.coordinator.free(request.request_id)

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()

    def commit_step(self) -> None:
        """The step's K/V are written: the blocks it registered in the prefix cache are now really cached."""

    def rollback_step(self) -> dict[str, list[KVBlock]]:
        """The step failed before its K/V were written: unregister the blocks it registered (else a later request
        would be served their never-written contents) and return them per request."""
        return {}

    def add_connector(self, connector: KVConnector) -> None:
        """Only the paged manager keeps blocks a connector (the disk tier) could hold (the config refuses any
        other)."""
        raise ValueError(f"{type(self).__name__} has no prefix cache for a connector")

    def offload_cached(self) -> None:
        """The engine went idle: the connectors (a disk tier) may write what they lack; this one has none."""

    def cache_computed(self, request: KVRequest, num_tokens: int) -> None:
        """Register the full blocks of the request's first `num_tokens` tokens (after a rolled-back step ran)."""


class PagedKVCacheManager(KVCacheManager):
    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        enable_caching: bool = True,
        sliding_window: int | None = None,
        layout: KVCacheLayout | None = None,
    ) -> None:
        """One group per group of `layout` (default: one group, every layer sliding by `sliding_window`, or full)."""
        self.windows = [g.window for g in layout.groups] if layout is not None else [sliding_window]
        super().__init__(num_blocks, block_size, enable_caching)
        self.layout = layout
        self.req_hashes: dict[str, list[BlockHash]] = {}
        # Blocks registered since the last commit_step: (request id, group, its count before, the blocks).
        # Registration happens at allocation, before the model writes the blocks, so that a request scheduled
        # later in the same step (another of n samples) can share them; a failed step must take it back.
        self.step_journal: list[tuple[str, int, int, list[KVBlock]]] = []
        self.connectors: list[KVConnector] = []

    def _table_managers(self) -> list[SingleTypeKVCacheManager]:
        return [
            make_single_type_manager(w, self.pool, self.block_size, g, self.null_block)
            for g, w in enumerate(self.windows)
        ]

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    def attach_state_slots(self, slots: StateSlotPool, checkpoints: StateCheckpoints | None = None) -> None:
        """The connectors plugged in already reach the state's checkpoints too."""
        super().attach_state_slots(slots, checkpoints)
        assert self.recurrent is not None
        for c in self.connectors:
            self.recurrent.connect(c)

    def reset_prefix_cache(self) -> None:
        super().reset_prefix_cache()
        self.coordinator.reset_prefix_cache()

    @property
    def sliding_window(self) -> int | None:
        """The window of a model of one sliding group (None otherwise)."""
        return self.windows[0] if len(self.windows) == 1 else None

    # ---- the seam: connectors ---------------------------------------------------------------------------------
    def add_connector(self, connector: KVConnector) -> None:
        """Plug `connector` in (the engine makes it: the disk tier, kv_blend's segment store); a hybrid model's
        state checkpoints reach it too."""
        self.connectors.append(connector)
        self.coordinator.connect(connector)

    @property
    def one_full_attention_group(self) -> bool:
        """Every layer's K/V in one full-attention table and nothing else (no window, no recurrent state): a
        block then holds a token span of the whole model."""
        return self.windows == [None] and len(self.coordinator.managers) == 1

    def fetch(self, key: BlockHash) -> KVBlock | None:
        """The block of `key` from the first connector that holds it, read into a free block (held once), and
        counted in `prefix_stats.disk_hits`."""
        for c in self.connectors:
            if c.contains(key):
                block = c.load(self.pool, key)
                if block is not None:
                    self.prefix_stats.disk_hits += self.block_size
                    return block
        return None

    def offload_cached(self) -> None:
        for c in self.connectors:
            c.idle(self.pool)

    # ---- lookups ------------------------------------------------------------------------------------------
    def _hashes(self, request: KVRequest, num_tokens: int) -> list[BlockHash]:
        """The chained hashes of the request's full blocks within its first `num_tokens` tokens (memoized)."""
        known = self.req_hashes.get(request.request_id, [])
        if len(known) < num_tokens // self.block_size:
            known = hash_full_blocks(
                request.all_token_ids[:num_tokens],
                self.block_size,
                extra_key(getattr(request, "cache_salt", None), getattr(request, "lora_int_id", 0)),
                known,
            )
            self.req_hashes[request.request_id] = known
        return known

    def get_computed_blocks(self, request: KVRequest) -> tuple[KVCacheBlocks, int]:
        # Never the whole prompt: its last token must be computed to produce the next token's logits.
        return self._lookup(request, (len(request.all_token_ids) - 1) // self.block_size)

    def shorten_hit(self, request: KVRequest, max_tokens: int) -> tuple[KVCacheBlocks, int]:
        return self._lookup(request, min(max_tokens, len(request.all_token_ids) - 1) // self.block_size)

    def _lookup(self, request: KVRequest, max_blocks: int) -> tuple[KVCacheBlocks, int]:
        if not self.enable_caching:
            return KVCacheBlocks.empty(self.num_groups), 0
        hashes = self._hashes(request, max_blocks * self.block_size)[:max_blocks]
        rid, get = request.request_id, self.pool.get_cached_block
        hits = self.coordinator.find_longest_cache_hit(rid, hashes, max_blocks, get)
        if len(hits[0]) < max_blocks and self.connectors:
            if self._load_from_tiers(request, hashes, max_blocks):
                hits = self.coordinator.find_longest_cache_hit(rid, hashes, max_blocks, get)
        self.coordinator.note_hit(rid, hashes, hits, max_blocks, get)
        return KVCacheBlocks(hits), len(hits[0]) * self.block_size

    def _load_from_tiers(self, request: KVRequest, hashes: list[BlockHash], max_blocks: int) -> bool:
        """Read into free blocks what a longer hit needs from the connectors (the disk tier): the hit as if every
        key a connector holds were in RAM, then its blocks that are not, in order, until one fails. The probe's
        RAM blocks and the loaded ones are held meanwhile, so a read cannot evict them; all go back to the free
        queue registered, for the lookup that follows. True if anything was read."""
        tiered = KVBlock(-1)  # stands for a block a connector holds

        def ram_or_tier(key: BlockHash) -> KVBlock | None:
            block = self.pool.get_cached_block(key)
            return block if block is not None else tiered if any(c.contains(key) for c in self.connectors) else None

        probe = self.coordinator.find_longest_cache_hit(request.request_id, hashes, max_blocks, ram_or_tier)
        wanted = sorted((i, g) for g, blocks in enumerate(probe) for i, b in enumerate(blocks) if b is tiered)
        held = [b for blocks in probe for b in blocks if b is not tiered and b is not self.null_block]
        self.pool.touch(held)
        loaded: list[tuple[int, int, KVBlock]] = []
        try:
            for i, g in wanted:
                m = self.coordinator.managers[g]
                block = self.fetch(m.keys(request.request_id, hashes)[i])
                if block is None:
                    break
                loaded.append((i, g, block))
        finally:
            self.pool.free(reversed([b for _, _, b in loaded]))
            self.pool.free(reversed(held))
        for g in sorted({g for _, g, _ in loaded}):
            if self.pool.events is not None:
                self._publish_stored(request, g, hashes, [i for i, gg, _ in loaded if gg == g])
        return bool(loaded)

    # ---- what requests hold ---------------------------------------------------------------------------------
    def num_skipped_blocks(self, request_id: str) -> int:
        return self.coordinator.managers[0].num_skipped_blocks(request_id)

    def get_group_block_ids(self, request_id: str) -> list[list[int]]:
        return [[b.block_id for b in t] for t in self.coordinator.tables(request_id)]

    def held_block_ids(self, request_id: str) -> set[int]:
        return {b.block_id for t in self.coordinator.tables(request_id) for b in t if b is not self.null_block}

    def group_block_counts(self, request_id: str) -> list[int]:
        return [sum(b is not self.null_block for b in t) for t in self.coordinator.tables(request_id)]

    def group_held_blocks(self) -> list[int]:
        null = self.null_block
        return [
            len({id(b) for blocks in m.req_to_blocks.values() for b in blocks if b is not null})
            for m in self.coordinator.table_managers
        ]

    @property
    def num_stored_tokens(self) -> int:
        """Distinct token slots the running requests keep, over every group: a shared block's tokens count once,
        the blocks that fell out of a window not at all."""
        total = 0
        for m in self.coordinator.table_managers:
            tables = m.req_to_blocks
            shared = {id(b): b for blocks in tables.values() for b in blocks if b.ref_cnt > 1}
            skipped = sum(1 for blocks in tables.values() for b in blocks if b is self.null_block)
            total += sum(self.req_tokens.get(rid, 0) for rid in tables) - skipped * self.block_size
            total -= sum((b.ref_cnt - 1) * self.block_size for b in shared.values())
        return total

    # ---- growth -----------------------------------------------------------------------------------------------
    def allocate_slots(
        self,
        request: KVRequest,
        num_new_tokens: int,
        new_computed_blocks: KVCacheBlocks | Sequence[KVBlock] = (),
        num_lookahead_tokens: int = 0,
    ) -> bool:
        rid = request.request_id
        hit = (
            new_computed_blocks.groups
            if isinstance(new_computed_blocks, KVCacheBlocks)
            else [list(new_computed_blocks)] + [[] for _ in range(self.num_groups - 1)]
        )
        self.coordinator.remove_skipped_blocks(rid, request.num_computed_tokens)
        total = request.num_computed_tokens + len(hit[0]) * self.block_size + num_new_tokens
        slots = total + num_lookahead_tokens
        if not self.coordinator.can_allocate(rid, slots, hit):
            return False
        self.coordinator.allocate(rid, slots, hit)
        self.req_tokens[rid] = slots
        self._note_peak()
        if self.enable_caching:  # only blocks full of real tokens: drafts are not known to be the sequence yet
            self._cache_full_blocks(request, total)
        return True

    def trim(self, request: KVRequest, num_tokens: int) -> None:
        """Also free the blocks that held rejected drafts only (never registered: past the real tokens)."""
        super().trim(request, num_tokens)
        self.coordinator.trim(request.request_id, num_tokens)

    def _cache_full_blocks(self, request: KVRequest, num_tokens: int) -> None:
        """Register the blocks that this step fills, so requests scheduled after this one can share them."""
        rid = request.request_id
        limits = [n for c in self.connectors if (n := c.cache_limit(rid)) is not None]  # kv_blend's copies
        num_full = min([num_tokens, *limits]) // self.block_size
        hashes = self._hashes(request, num_tokens)
        for g, before, registered in self.coordinator.cache_blocks(rid, hashes, num_full):
            table = self.coordinator.managers[g].req_to_blocks[rid]
            self.step_journal.append((rid, g, before, [table[i] for i in registered]))
            if self.pool.events is not None:
                self._publish_stored(request, g, hashes, registered)

    def _publish_stored(self, request: KVRequest, group: int, hashes: list[BlockHash], registered: list[int]) -> None:
        """One BlockStored per run of consecutive registered blocks of a group (a block whose prefix another block
        already holds is not registered, and breaks the run), with its parent key and tokens as vLLM publishes
        them; keys are the group's (group 0's are the prefix hashes)."""
        assert self.pool.events is not None
        keys = self.coordinator.managers[group].keys(request.request_id, hashes[: registered[-1] + 1])
        runs: list[list[int]] = []
        for i in registered:
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        bs = self.block_size
        for run in runs:
            a, b = run[0], run[-1] + 1
            self.pool.events.stored(list(keys[a:b]), keys[a - 1] if a else None, request.all_token_ids[a * bs : b * bs])

    def commit_step(self) -> None:
        self.step_journal.clear()
        self.coordinator.commit_step()

    def rollback_step(self) -> dict[str, list[KVBlock]]:
        undone: dict[str, list[KVBlock]] = {}
        self.coordinator.rollback_step()
        for rid, group, before, blocks in reversed(self.step_journal):
            for block in blocks:
                self.pool.uncache(block)
            self.coordinator.managers[group].uncache_since(rid, before)
            undone.setdefault(rid, []).extend(blocks)
        self.step_journal.clear()
        return undone

    def cache_computed(self, request: KVRequest, num_tokens: int) -> None:
        if self.enable_caching and request.request_id in self.req_blocks:
            self._cache_full_blocks(request, num_tokens)

    def free(self, request: KVRequest) -> None:
        super().free(request)
        rid = request.request_id
        for c in self.connectors:
            c.request_finished(rid)
        self.req_hashes.pop(rid, None)


class ContiguousKVCacheManager(KVCacheManager):
    """Reserves max_model_len (in whole blocks) per request at admission, as a system without paging must."""

    def __init__(self, num_blocks: int, block_size: int, max_model_len: int) -> None:
        self.blocks_per_request = cdiv(max_model_len, block_size)
        super().__init__(num_blocks, block_size, enable_caching=False)
        if self.blocks_per_request > num_blocks:
            raise ValueError(
                f"contiguous allocation reserves {self.blocks_per_request} blocks per request "
                f"(max_model_len {max_model_len}), but the KV cache has only {num_blocks}"
            )

    def allocate_slots(
        self,
        request: KVRequest,
        num_new_tokens: int,
        new_computed_blocks: KVCacheBlocks | Sequence[KVBlock] = (),
        num_lookahead_tokens: int = 0,
    ) -> bool:
        assert not new_computed_blocks, "contiguous allocation shares nothing"
        rid = request.request_id
        total = request.num_computed_tokens + num_new_tokens + num_lookahead_tokens
        if total > self.blocks_per_request * self.block_size:
            return False
        if not self.coordinator.can_allocate(rid, total, []):
            return False
        self.coordinator.allocate(rid, total, [])
        self.req_tokens[rid] = total
        self._note_peak()
        return True

    def _table_managers(self) -> list[SingleTypeKVCacheManager]:
        return [ContiguousManager(self.pool, self.block_size, self.null_block, self.blocks_per_request)]


def make_kv_cache_manager(
    allocation: str,
    num_blocks: int,
    block_size: int,
    max_model_len: int,
    enable_prefix_caching: bool,
    layout: KVCacheLayout | None = None,
) -> KVCacheManager:
    """`layout`: the model's KV-cache groups (kv_spec.kv_cache_layout); the paged manager keeps a table per group."""
    if allocation == "paged":
        return PagedKVCacheManager(num_blocks, block_size, enable_prefix_caching, layout=layout)
    if allocation == "contiguous":
        kv = ContiguousKVCacheManager(num_blocks, block_size, max_model_len)
        kv.layout = layout
        return kv
    raise ValueError(f"unknown KV allocation {allocation!r}: choose paged or contiguous")
