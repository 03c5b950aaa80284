"""Recurrent-state slots: the fixed-size state a hybrid model's linear-attention layers keep per request (Gated
DeltaNet's conv and recurrent states, layers/deltanet.py), one slot per running request (vLLM v1's MambaManager
gives a request one state page the same way).

Why slots and not blocks: a request's state does not grow with its tokens, so it needs one place from admission to
the end, not a table. The engine reserves `max_num_seqs` slots' bytes out of the KV budget before it sizes the
block pool (a request can never wait for a slot: the scheduler admits at most max_num_seqs), and the KV manager
hands a slot out at a request's first allocation and takes it back when the request is freed (finished, aborted,
preempted: a preempted request is recomputed from position 0, from a zero state). What a slot holds changes only
when a step commits (RecurrentStep.commit), so a failed step leaves every slot as it was. The prefix cache's copies
of the state (`StateCheckpoints`) are not slots: they live in blocks of the KV pool.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Protocol

from pagedllm.kv.block_pool import BlockPool, KVBlock
from pagedllm.kv.hashing import BlockHash, checkpoint_key


class StateSlotPool:
    def __init__(self, num_slots: int, bytes_per_slot: int = 0) -> None:
        if num_slots < 1:
            raise ValueError(f"a hybrid model needs at least one state slot, got {num_slots}")
        self.num_slots, self.bytes_per_slot = num_slots, bytes_per_slot
        self._free: deque[int] = deque(range(num_slots))
        self.req_to_slot: dict[str, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_take(self, request_id: str) -> bool:
        """The request holds a slot already, or one is free."""
        return request_id in self.req_to_slot or bool(self._free)

    def take(self, request_id: str) -> int:
        """The request's slot, handed out on its first call."""
        slot = self.req_to_slot.get(request_id)
        if slot is None:
            slot = self.req_to_slot[request_id] = self._free.popleft()
        return slot

    def free(self, request_id: str) -> None:
        slot = self.req_to_slot.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)


class StateIO(Protocol):
    """Moves a recurrent state between a state row (every linear layer's conv and recurrent state) and the memory
    of pool blocks (the model runner's K/V tensors of those block ids, as raw bytes)."""

    def state_to_blocks(self, row: int, block_ids: Sequence[int]) -> None: ...

    def blocks_to_state(self, block_ids: Sequence[int], row: int) -> None: ...


class StateCheckpoints:
    """Prefix caching for a hybrid model: copies of a request's recurrent state at block boundaries of its prompt,
    each under the chained hash of the blocks before it (the key of the last full block, as the KV blocks are
    keyed), stored in blocks of the KV pool (vLLM v1 keeps a Mamba state in blocks of the same pool): the state's
    bytes laid across the K/V memory of `blocks_each` blocks, block i cached under `hashing.checkpoint_key(key,
    i)`. A checkpoint exists while all its blocks are cached, so it is evicted with the KV blocks by the pool's one
    LRU (and kept by the disk tier as any evicted block); a prefix hit is then the longest run of cached KV blocks
    that ends where a checkpoint lies: the request starts from a copy of that state. A hit holds its checkpoint's
    blocks (out of the free queue) until the copy is made.

    Where the states come from is `mode` (vLLM's --mamba-cache-mode). "align": the scheduler cuts a hybrid
    request's prompt chunks at block boundaries (and at the prompt's last one, and where its run of cached KV
    blocks ends without a checkpoint: a shared prefix another request computed), and a chunk's state at its end is
    stored from the request's slot; the first prompt of a shared prefix leaves no state at the prefix's end, so the
    second misses its hit. "all": the mixers also emit the state at every block boundary inside a prompt chunk into
    a staging row each (`reserve`; RecurrentStep.marks writes them when the step commits), stored into blocks when
    the KV manager's step commits (`written`), so the first prompt already leaves one at every boundary, at the
    cost of `blocks_each` blocks per block boundary of every prompt (docs/benchmarks.md)."""

    def __init__(
        self,
        pool: BlockPool,
        io: StateIO,
        blocks_each: int,
        block_size: int,
        mode: str = "align",
        staging: Sequence[int] = (),
    ) -> None:
        if mode not in ("align", "all"):
            raise ValueError(f"state checkpoints are taken in mode align or all, not {mode!r}")
        if blocks_each < 1 or blocks_each > pool.num_blocks:
            raise ValueError(f"a state checkpoint of {blocks_each} blocks does not fit {pool.num_blocks} blocks")
        self.pool, self.io, self.blocks_each, self.block_size, self.mode = pool, io, blocks_each, block_size, mode
        self.holds: dict[str, list[KVBlock]] = {}  # request id -> its hit's checkpoint blocks, until copied
        # request id -> the end of its run of cached KV blocks where no checkpoint lies: its chunk is cut there, so
        # the next prompt sharing that prefix hits it
        self.wanted: dict[str, int] = {}
        self.num_staging = len(staging)
        self._staging: deque[int] = deque(staging)
        self.unwritten: dict[BlockHash, int] = {}  # key -> staging row the running step writes (mode all)
        self.stored: dict[BlockHash, None] = {}  # every key stored and maybe still cached (for the counts)

    def part_keys(self, key: BlockHash) -> list[BlockHash]:
        return [checkpoint_key(key, i) for i in range(self.blocks_each)]

    def blocks(self, key: BlockHash) -> list[KVBlock] | None:
        """The checkpoint's blocks (None: it was never stored, or a block of it was evicted)."""
        found = [self.pool.get_cached_block(k) for k in self.part_keys(key)]
        return None if any(b is None for b in found) else found  # type: ignore[return-value]

    def find(self, key: BlockHash) -> bool:
        return self.blocks(key) is not None

    def hold(self, request_id: str, key: BlockHash) -> None:
        """The request's hit starts from `key`'s state: its blocks are held until `restore` (or the request's free)."""
        blocks = self.blocks(key)
        assert blocks is not None, "a hit is held at once after its lookup"
        self.release(request_id)
        self.pool.touch(blocks)
        self.holds[request_id] = blocks

    def restore(self, request_id: str, row: int) -> bool:
        """Copy the request's held checkpoint into state row `row` (its slot) and let go of it; False: none held."""
        blocks = self.holds.get(request_id)
        if blocks is None:
            return False
        self.io.blocks_to_state([b.block_id for b in blocks], row)
        self.release(request_id)
        return True

    def release(self, request_id: str) -> None:
        blocks = self.holds.pop(request_id, None)
        if blocks is not None:
            self.pool.free(reversed(blocks))

    def forget(self, request_id: str) -> None:
        """The request is freed: its hold and its wanted cut go."""
        self.release(request_id)
        self.wanted.pop(request_id, None)

    def store(self, key: BlockHash, row: int) -> bool:
        """Store state row `row` as the checkpoint after `key` in free blocks (the least recently used cached ones
        are evicted for them), registered and freed at once: the most recently used, evictable. False: it is
        cached already (now the most recently used), or too few blocks are free."""
        if self._refresh(key) or self.pool.num_free_blocks < self.blocks_each:
            return False
        blocks = self.pool.allocate(self.blocks_each)
        try:
            self.io.state_to_blocks(row, [b.block_id for b in blocks])
            for block, part in zip(blocks, self.part_keys(key)):
                stale = self.pool.get_cached_block(part)  # a part of an evicted checkpoint, its others gone
                if stale is not None and not stale.ref_cnt:
                    self.pool.uncache(stale)
                self.pool.cache_block(block, part, published=False)  # not a prompt prefix: no KV event
        finally:
            self.pool.free(reversed(blocks))
        self.stored[key] = None
        return True

    def reserve(self, key: BlockHash) -> int | None:
        """A staging row for the state under `key` that the step about to run writes (a block boundary inside a
        prompt chunk, mode "all"), stored when the step commits (`written`) or given back if it fails
        (`drop_unwritten`); None: it is cached already (now the most recently used), reserved, or no row is free."""
        if key in self.unwritten or not self._staging or self._refresh(key):
            return None
        row = self.unwritten[key] = self._staging.popleft()
        return row

    def _refresh(self, key: BlockHash) -> bool:
        """Whether the checkpoint after `key` is cached; if so it is now the most recently used."""
        cached = self.blocks(key)
        if cached is not None:
            self.pool.touch(cached)
            self.pool.free(reversed(cached))
        return cached is not None

    def written(self) -> None:
        """The step committed: the states at its marks are in their staging rows."""
        for key, row in self.unwritten.items():
            self.store(key, row)
        self.drop_unwritten()

    def drop_unwritten(self) -> None:
        self._staging.extend(self.unwritten.values())
        self.unwritten.clear()

    def counts(self) -> tuple[int, int]:
        """(checkpoints cached, pool blocks they take); forgets the keys whose checkpoint was evicted."""
        gone = [k for k in self.stored if not self.find(k)]
        for key in gone:
            del self.stored[key]
        return len(self.stored), len(self.stored) * self.blocks_each

    def block_ids(self) -> list[int]:
        """The pool blocks that hold a checkpoint now: every block of a cached one (free and evictable, or held by
        a hit), and a hit's held blocks (the /kv page shows them as blocks of their own kind)."""
        ids = {b.block_id for key in self.stored for b in self.blocks(key) or ()}
        ids.update(b.block_id for blocks in self.holds.values() for b in blocks)
        return sorted(ids)

    def clear(self) -> None:
        """reset_prefix_cache: the pool forgot the blocks' keys; forget the list of stored ones."""
        self.stored.clear()
