"""The block pool: every KV block, its ref count and hash, an LRU free queue and the prefix-cache index.

A freed block keeps its hash and contents, so a later request with the same prefix can take it back
("touch") for free; a fresh allocation takes the least recently freed block and only then drops its hash.
All operations are O(1) per block: the free queue is a doubly linked list threaded through the blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from pagedllm.kv.events import AllBlocksCleared, KVEventLog
from pagedllm.kv.hashing import BlockHash


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None  # set once the block is full and registered in the prefix cache
    published: bool = True  # its hash is in the KV events (a kv_blend segment's is not: no prompt prefix has it)
    prev_free: KVBlock | None = field(default=None, repr=False)
    next_free: KVBlock | None = field(default=None, repr=False)


class FreeBlockQueue:
    """Free blocks in eviction order: the head is the least recently freed, taken first."""

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        self._head = KVBlock(-1)  # sentinels, so no operation has to special-case an empty list
        self._tail = KVBlock(-1)
        self._head.next_free, self._tail.prev_free = self._tail, self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def append(self, block: KVBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        last.next_free, block.prev_free = block, last
        block.next_free, self._tail.prev_free = self._tail, block
        self.num_free += 1

    def remove(self, block: KVBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None, f"block {block.block_id} is not free"
        prev.next_free, nxt.prev_free = nxt, prev
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def popleft(self) -> KVBlock:
        block = self._head.next_free
        if block is None or block is self._tail:
            raise RuntimeError("no free KV block")
        self.remove(block)
        return block

    def __iter__(self):
        block = self._head.next_free
        while block is not None and block is not self._tail:
            yield block
            block = block.next_free


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[BlockHash, KVBlock] = {}
        self.num_free_cached = 0  # free blocks that still hold a registered prefix (evictable, reusable)
        self.events: KVEventLog | None = None  # set to publish what enters and leaves the prefix cache
        # Called with a free block that still caches a prefix just before it is reused for other tokens (its K/V
        # are intact): the disk tier's chance to keep it.
        self.on_evict: Callable[[KVBlock], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    @property
    def usage(self) -> float:
        """Share of blocks held by running requests (free blocks that still cache a prefix count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        return self.cached.get(block_hash) if self.enable_caching else None

    def allocate(self, n: int) -> list[KVBlock]:
        if n > self.num_free_blocks:
            raise RuntimeError(f"asked for {n} KV blocks, {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            if (
                self.on_evict is not None
                and block.block_hash is not None
                and self.cached.get(block.block_hash) is block
            ):
                self.on_evict(block)
            self.uncache(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference to cached blocks; a free one leaves the free queue (it is no longer evictable)."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
                self.num_free_cached -= block.block_hash is not None
            block.ref_cnt += 1

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop a reference to each block, in the given order: blocks freed first are evicted first."""
        for block in blocks:
            assert block.ref_cnt > 0, f"double free of block {block.block_id}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)
                self.num_free_cached += block.block_hash is not None

    def cache_block(self, block: KVBlock, block_hash: BlockHash, published: bool = True) -> bool:
        """Register a block in use under its chained hash, unless another block already holds that prefix;
        True if it was registered. `published`: whether its leaving is a KV event (its caller publishes its
        BlockStored, with the tokens; a kv_blend segment's block is in neither)."""
        if not self.enable_caching or block.block_hash is not None or block_hash in self.cached:
            return False
        assert block.ref_cnt > 0, f"block {block.block_id} is free: only blocks in use are registered"
        block.block_hash, block.published = block_hash, published
        self.cached[block_hash] = block
        return True

    def uncache(self, block: KVBlock) -> None:
        """Drop a block's prefix: it is being reused for other tokens, or its K/V were never written."""
        if block.block_hash is None:
            return
        if self.cached.get(block.block_hash) is block:
            del self.cached[block.block_hash]
            if self.events is not None and block.published:
                self.events.removed([block.block_hash])
        block.block_hash = None
        if block.ref_cnt == 0:
            self.num_free_cached -= 1

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (e.g. after new weights); blocks in use keep their contents. Published as one
        AllBlocksCleared, not a BlockRemoved per block."""
        events, self.events = self.events, None
        try:
            for block in list(self.cached.values()):
                self.uncache(block)
        finally:
            self.events = events
        if events is not None:
            events.record(AllBlocksCleared())
