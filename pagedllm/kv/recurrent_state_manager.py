"""The recurrent-state group of a hybrid model (vLLM v1's MambaManager): the coordinator runs it beside the attention
groups' managers, so the KV manager has no branch of its own for a model with linear-attention, state-space or
short-conv layers.

What it holds is not a block table: a state slot per running request (state_slots.StateSlotPool) and, with prefix
caching, the states at block boundaries (state_slots.StateCheckpoints), each in blocks of the one pool. Its part in
each coordinator call:
- the hit: the longest prefix, within the run of cached blocks of the prefix, after which a checkpoint lies (all
  its blocks cached, or read back from a tier). The coordinator's "longest hit every group can serve" loop then
  ends every group's hit there; the hit it returns is that many null entries (no block is read through a table).
- allocation: the slot (an allocation fails while none is free), and a hold on the hit's checkpoint blocks (their
  count comes out of the free pool as a hit's blocks do) until the engine copies them into the slot (`restore`);
  free gives both back (finished, aborted, preempted).
- a step's commit / rollback: the states at its marks are stored from their staging rows / dropped.
- the step being scheduled: an attention group's hit shares blocks a chunk scheduled earlier in the same step
  computes (registered at allocation), but a state exists only once its step committed; so the block boundaries
  a scheduled chunk fills are pending checkpoints, and a lookup whose hit would end further at one `waits`: the
  scheduler admits it next step, when the checkpoint is there (a burst of prompts sharing a prefix then hits as
  the attention-only twin does, not from scratch).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from pagedllm.kv.block_pool import BlockPool, KVBlock
from pagedllm.kv.connector import KVConnector
from pagedllm.kv.hashing import BlockHash
from pagedllm.kv.single_type_manager import Lookup, SingleTypeKVCacheManager
from pagedllm.kv.state_slots import StateCheckpoints, StateSlotPool

Hashes = Callable[[Any, int], list[BlockHash]]  # a request's prefix hashes within its first n tokens


class RecurrentStateManager(SingleTypeKVCacheManager):
    def __init__(
        self,
        pool: BlockPool,
        block_size: int,
        null_block: KVBlock,
        slots: StateSlotPool,
        checkpoints: StateCheckpoints | None,
        hashes: Hashes,
    ) -> None:
        """`hashes`: the KV manager's prefix hashes of a request (checkpoints are keyed by them, as group 0's
        blocks are)."""
        super().__init__(pool, block_size, 0, null_block)
        self.slots, self.checkpoints, self._hashes = slots, checkpoints, hashes
        self.tiers: list[KVConnector] = []  # where a checkpoint missing from the rows may be read back from
        self.disk_loads = 0  # checkpoints read back from a tier (the disk tier)
        self._hit_key: dict[str, BlockHash] = {}  # request id -> the key its last lookup's hit ends at
        # request id -> the keys after which its chunk scheduled in this step leaves a checkpoint (until it commits)
        self._pending: dict[str, list[BlockHash]] = {}
        self._waits: set[str] = set()  # requests whose last lookup would hit further at a pending checkpoint

    @property
    def mode(self) -> str | None:
        """--mamba-cache-mode of its checkpoints (None: no prefix caching)."""
        return None if self.checkpoints is None else self.checkpoints.mode

    # ---- the coordinator's calls -----------------------------------------------------------------------------
    def keys(self, request_id: str, hashes: Sequence[BlockHash]) -> Sequence[BlockHash]:
        return hashes

    def connect(self, connector: KVConnector) -> None:
        """A tier plugged in behind the KV manager's seam: it keeps a checkpoint's evicted blocks as any block's."""
        self.tiers.append(connector)

    def find_longest_cache_hit(self, keys: Sequence[BlockHash], max_blocks: int, lookup: Lookup) -> list[KVBlock]:
        """Null entries up to the longest prefix, within the cached run, whose state is checkpointed: a state after
        a prefix whose blocks are not cached could never be a hit, so none past the run is looked for (or read)."""
        if self.checkpoints is None:
            return []
        n = self._cached_run(keys, max_blocks, lookup)
        while n and not self._has(keys[n - 1]):
            n -= 1
        return [self.null_block] * n

    def _cached_run(self, keys: Sequence[BlockHash], max_blocks: int, lookup: Lookup) -> int:
        n = 0
        for key in keys[:max_blocks]:
            if lookup(key) is None:
                break
            n += 1
        return n

    def _has(self, key: BlockHash) -> bool:
        """A checkpoint after the prefix `key` is in the pool: it was, or the tiers read its missing blocks back
        (the cached ones held meanwhile, so a read cannot evict them)."""
        assert self.checkpoints is not None
        if self.checkpoints.find(key):
            return True
        parts = self.checkpoints.part_keys(key)
        missing = [p for p in parts if self.pool.get_cached_block(p) is None]
        if not self.tiers or not all(any(c.contains(p) for c in self.tiers) for p in missing):
            return False
        present = [b for p in parts if (b := self.pool.get_cached_block(p)) is not None]
        self.pool.touch(present)
        loaded: list[KVBlock] = []
        try:
            for p in missing:
                block = next((b for c in self.tiers if c.contains(p) and (b := c.load(self.pool, p))), None)
                if block is None:
                    break
                block.published = False  # a state's block: never a KV event
                loaded.append(block)
        finally:
            self.pool.free(reversed(loaded))
            self.pool.free(reversed(present))
        if len(loaded) < len(missing):
            return False
        self.disk_loads += 1
        self.checkpoints.stored[key] = None
        return True

    def note_hit(
        self, request_id: str, keys: Sequence[BlockHash], num_blocks: int, max_blocks: int, lookup: Lookup
    ) -> None:
        """The lookup's hit is `num_blocks` long: its checkpoint is what an allocation holds; under align, where
        the cached run goes further without a checkpoint the request's chunk is cut (the scheduler), so that its
        state there is kept and the next prompt sharing that prefix hits it; where the run passes a checkpoint
        pending in this step, the request `waits`."""
        if num_blocks:
            self._hit_key[request_id] = keys[num_blocks - 1]
        if self.checkpoints is None:
            return
        run = self._cached_run(keys, max_blocks, lookup) if self.mode == "align" or self._pending else 0
        if self.mode == "align" and run > num_blocks:
            self.checkpoints.wanted[request_id] = run * self.block_size
        pending = {k for ks in self._pending.values() for k in ks}
        if any(k in pending for k in keys[num_blocks:run]):
            self._waits.add(request_id)
        else:
            self._waits.discard(request_id)

    def waits(self, request_id: str) -> bool:
        """The request's last lookup would hit further at a checkpoint a chunk scheduled in this step leaves."""
        return request_id in self._waits

    def _hit_blocks(self, request_id: str, new_computed: Sequence[KVBlock]) -> list[KVBlock] | None:
        """The blocks of the checkpoint a hit starts from ([] without a hit; None: evicted since the lookup)."""
        if not new_computed or self.checkpoints is None:
            return []
        return self.checkpoints.blocks(self._hit_key[request_id])

    def can_allocate(self, request_id: str, new_computed: Sequence[KVBlock]) -> bool:
        return self.slots.can_take(request_id) and self._hit_blocks(request_id, new_computed) is not None

    def num_blocks_to_allocate(self, request_id: str, num_tokens: int, new_computed: Sequence[KVBlock]) -> int:
        """The hit's checkpoint blocks that sit in the free queue (held, they leave it)."""
        return sum(b.ref_cnt == 0 for b in self._hit_blocks(request_id, new_computed) or ())

    def save_new_computed_blocks(self, request_id: str, new_computed: Sequence[KVBlock]) -> None:
        """The hit starts from its checkpoint's state: held until copied (`restore`) or the request's free."""
        if new_computed and self.checkpoints is not None:
            self.checkpoints.hold(request_id, self._hit_key[request_id])

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> None:
        self.slots.take(request_id)

    def cache_blocks(self, request_id: str, keys: Sequence[BlockHash], num_full: int) -> tuple[int, list[int]]:
        """Nothing is registered here (checkpoints are stored once their states are written: `checkpoint`, the
        marks); the boundaries the request's scheduled chunk fills are pending until the step ends: all of them
        under all (the marks, and the chunk's end), the last one under align (the chunk's end, if it is one).
        A boundary past the prompt leaves none: a lookup that waits on it finds none a step later, and hits as
        it would have."""
        before = self.num_cached_block.get(request_id, 0)
        if self.checkpoints is not None and num_full > before:
            new = keys[before:num_full] if self.mode == "all" else keys[num_full - 1 : num_full]
            self._pending.setdefault(request_id, []).extend(new)
        self.num_cached_block[request_id] = num_full
        return before, []

    def trim(self, request_id: str, num_tokens: int) -> None:
        """A hybrid model runs no drafts."""

    def free(self, request_id: str) -> None:
        self.slots.free(request_id)
        self._hit_key.pop(request_id, None)
        self._pending.pop(request_id, None)
        self._waits.discard(request_id)
        self.num_cached_block.pop(request_id, None)
        if self.checkpoints is not None:
            self.checkpoints.forget(request_id)

    def commit_step(self) -> None:
        self._pending.clear()
        if self.checkpoints is not None:
            self.checkpoints.written()  # the states at the step's marks, from their staging rows into blocks

    def rollback_step(self) -> None:
        self._pending.clear()
        if self.checkpoints is not None:
            self.checkpoints.drop_unwritten()  # the states at the step's marks were never written

    def reset_prefix_cache(self) -> None:
        if self.checkpoints is not None:
            self.checkpoints.clear()

    # ---- the engine's calls ----------------------------------------------------------------------------------
    def slot(self, request_id: str) -> int | None:
        """The request's state slot (None before its first allocation)."""
        return self.slots.req_to_slot.get(request_id)

    def restore(self, request_id: str) -> bool:
        """Copy the checkpoint a request's prefix hit starts from into its slot (before its first step), once."""
        slot = self.slot(request_id)
        return self.checkpoints is not None and slot is not None and self.checkpoints.restore(request_id, slot)

    def checkpoint(self, request: Any, num_tokens: int) -> bool:
        """Store the request's state after its first `num_tokens` tokens (a block boundary, the state now in its
        slot), to be found by later prefixes; False: not a boundary, no checkpoints, cached already, or too few
        blocks free."""
        slot = self.slot(request.request_id)
        if self.checkpoints is None or slot is None or not num_tokens or num_tokens % self.block_size:
            return False
        return self.checkpoints.store(self._hashes(request, num_tokens)[num_tokens // self.block_size - 1], slot)

    def marks(self, request: Any, start: int, upto: int) -> list[tuple[int, int]]:
        """A prompt chunk from token `start` on: the block boundaries b, start < b <= upto, whose state it should
        leave as a checkpoint (--mamba-cache-mode all), as (b - start, staging row) for the runner
        (SeqChunk.state_marks), stored when the step commits; [] without such checkpoints."""
        ck, bs = self.checkpoints, self.block_size
        if ck is None or ck.mode != "all" or upto < (start // bs + 1) * bs:
            return []
        hashes = self._hashes(request, upto)
        marks = []
        for b in range((start // bs + 1) * bs, upto + 1, bs):
            row = ck.reserve(hashes[b // bs - 1])  # none: cached already (now most recently used), or no row free
            if row is not None:
                marks.append((b - start, row))
        return marks

    def align_cut(self, request_id: str) -> int | None:
        """Under align: where the request's run of cached blocks ends without a checkpoint (its chunk is cut
        there); None in any other mode."""
        return None if self.checkpoints is None or self.mode != "align" else self.checkpoints.wanted.get(request_id, 0)
