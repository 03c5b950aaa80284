"""One manager per kind of KV-cache group (vLLM v1's single_type_kv_cache_manager.py): the block tables of one
group's requests, how many blocks a request needs, what a prefix hit is in that group, which blocks it may give
back. The coordinator (coordinator.py) runs one per group over the one block pool.

- `FullAttentionManager`: a request holds every block of its tokens; a hit is the leading run of cached blocks.
- `ContiguousManager`: the baseline without paging (`--kv-allocation contiguous`): max_model_len's blocks
  reserved per request at admission.
- `SlidingWindowManager`: once a block is out of the window of the request's next token it goes back to the pool
  (still cached: evictable, and reusable by a hit) and the table holds the null block there (id 0, never read:
  the kernels start at the window, the torch path gathers only the windows' blocks and masks the rest); a hit
  needs only the blocks inside the window.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pagedllm.kv.block_pool import BlockPool, KVBlock
from pagedllm.kv.connector import KVConnector
from pagedllm.kv.hashing import BlockHash, group_key
from pagedllm.kv.kv_spec import cdiv

Lookup = Callable[[BlockHash], "KVBlock | None"]  # a group key -> its cached block (or a tier's stand-in)


class SingleTypeKVCacheManager:
    """The block tables of one group; what differs per kind is the hit and the blocks given back."""

    def __init__(self, pool: BlockPool, block_size: int, group: int, null_block: KVBlock) -> None:
        self.pool, self.block_size, self.group, self.null_block = pool, block_size, group, null_block
        self.req_to_blocks: dict[str, list[KVBlock]] = {}
        self.num_cached_block: dict[str, int] = {}  # how many of a request's blocks are registered
        self._keys: dict[str, list[BlockHash]] = {}  # a request's prefix hashes as this group's keys (memo)

    def keys(self, request_id: str, hashes: Sequence[BlockHash]) -> Sequence[BlockHash]:
        """This group's pool keys of the prefix `hashes` (group 0's are the hashes themselves)."""
        if self.group == 0:
            return hashes
        known = self._keys.setdefault(request_id, [])
        known.extend(group_key(h, self.group) for h in hashes[len(known) :])
        return known[: len(hashes)]

    def find_longest_cache_hit(self, keys: Sequence[BlockHash], max_blocks: int, lookup: Lookup) -> list[KVBlock]:
        raise NotImplementedError

    def note_hit(
        self, request_id: str, keys: Sequence[BlockHash], num_blocks: int, max_blocks: int, lookup: Lookup
    ) -> None:
        """The request's lookup ended with a hit of `num_blocks` blocks (what its allocation will be given)."""

    def connect(self, connector: KVConnector) -> None:
        """A connector (the disk tier) was plugged in behind the KV manager's seam."""

    def can_allocate(self, request_id: str, new_computed: Sequence[KVBlock]) -> bool:
        """Whatever the group gives a request besides pool blocks is there (a block group needs nothing else)."""
        return True

    def commit_step(self) -> None:
        """The step's writes are done (a block group's registrations are journaled by the KV manager)."""

    def rollback_step(self) -> None:
        """The step failed before its writes were done."""

    def reset_prefix_cache(self) -> None:
        """Forget what the group caches beside the pool's blocks (the pool forgets those)."""

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Give back the blocks no later token reads (none under full attention)."""

    def num_blocks_to_allocate(self, request_id: str, num_tokens: int, new_computed: Sequence[KVBlock]) -> int:
        """Free-pool blocks that growing the table to `num_tokens` slots takes, counting the hit's blocks that
        sit in the free queue (touched, they leave it)."""
        held = len(self.req_to_blocks.get(request_id, ()))
        new = max(0, cdiv(num_tokens, self.block_size) - held - len(new_computed))
        return new + sum(1 for b in new_computed if b is not self.null_block and b.ref_cnt == 0)

    def save_new_computed_blocks(self, request_id: str, new_computed: Sequence[KVBlock]) -> None:
        """Take the hit's blocks: touched, those in the free queue leave it, so no fresh allocation evicts them."""
        self.pool.touch([b for b in new_computed if b is not self.null_block])
        self.req_to_blocks.setdefault(request_id, []).extend(new_computed)

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> None:
        """Fresh blocks up to `num_tokens` slots (checked to fit already), after every group saved its hit."""
        held = self.req_to_blocks.setdefault(request_id, [])
        new = cdiv(num_tokens, self.block_size) - len(held)
        if new > 0:
            held.extend(self.pool.allocate(new))

    def cache_blocks(self, request_id: str, keys: Sequence[BlockHash], num_full: int) -> tuple[int, list[int]]:
        """Register the request's blocks up to `num_full` (full of real tokens) under their keys: (how many were
        registered before, the indices registered now). A null entry, or a block whose prefix another block
        already holds, is not registered."""
        start = self.num_cached_block.get(request_id, 0)
        if num_full <= start:
            return start, []
        held = self.req_to_blocks[request_id]
        registered = [
            i
            for i in range(start, num_full)
            if held[i] is not self.null_block and self.pool.cache_block(held[i], keys[i])
        ]
        self.num_cached_block[request_id] = num_full
        return start, registered

    def uncache_since(self, request_id: str, before: int) -> None:
        """A failed step's registrations were taken back: the request's count goes back to `before`."""
        if request_id in self.num_cached_block:
            self.num_cached_block[request_id] = before

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Free the blocks past the first `num_tokens` slots (rejected drafts only: never registered)."""
        blocks = self.req_to_blocks.get(request_id)
        keep = cdiv(num_tokens, self.block_size)
        if blocks is not None and len(blocks) > keep:
            self.pool.free(reversed(blocks[keep:]))
            del blocks[keep:]

    def free(self, request_id: str) -> None:
        """The tail first: the least likely to be shared, so evicted first."""
        blocks = self.req_to_blocks.pop(request_id, [])
        self.pool.free([b for b in reversed(blocks) if b is not self.null_block])
        self.num_cached_block.pop(request_id, None)
        self._keys.pop(request_id, None)

    def num_skipped_blocks(self, request_id: str) -> int:
        """Leading entries of the request's table that went back to the pool."""
        return 0


class FullAttentionManager(SingleTypeKVCacheManager):
    def find_longest_cache_hit(self, keys: Sequence[BlockHash], max_blocks: int, lookup: Lookup) -> list[KVBlock]:
        hits: list[KVBlock] = []
        for key in keys[:max_blocks]:
            block = lookup(key)
            if block is None:
                break
            hits.append(block)
        return hits


class SlidingWindowManager(SingleTypeKVCacheManager):
    def __init__(self, pool: BlockPool, block_size: int, group: int, null_block: KVBlock, window: int) -> None:
        super().__init__(pool, block_size, group, null_block)
        if window < 1:
            raise ValueError(f"sliding window must be at least 1 token, got {window}")
        self.window = window

    def first_useful_block(self, num_computed_tokens: int) -> int:
        """The first block the token after `num_computed_tokens` computed ones still sees (its window's start)."""
        return max(0, (num_computed_tokens - self.window + 1) // self.block_size)

    def find_longest_cache_hit(self, keys: Sequence[BlockHash], max_blocks: int, lookup: Lookup) -> list[KVBlock]:
        """vLLM's sliding-window hit: the rightmost run of cached blocks long enough to cover a window (the blocks
        before it are null: nothing will read them), else the run of cached blocks at the start, however short;
        then null before the first block the next token sees."""
        need = max(cdiv(self.window - 1, self.block_size), 1)
        found = [lookup(k) for k in keys[:max_blocks]]
        hits: list[KVBlock] | None = None
        run = 0
        for i in range(len(found) - 1, -1, -1):
            run = run + 1 if found[i] is not None else 0
            if run >= need:
                hits = [self.null_block] * i + [b for b in found[i : i + run] if b is not None]
                break
        if hits is None:
            hits = [b for b in found[:run] if b is not None]
        skipped = min(self.first_useful_block(len(hits) * self.block_size), len(hits))
        hits[:skipped] = [self.null_block] * skipped
        return hits

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Oldest first into the free queue, so evicted first: a later request that continues this one hits on the
        blocks of its last window (vLLM gives them back newest first)."""
        held = self.req_to_blocks.get(request_id)
        if not held:
            return
        removed: list[KVBlock] = []
        for i in range(min(self.first_useful_block(num_computed_tokens), len(held)) - 1, -1, -1):
            if held[i] is self.null_block:
                break  # the blocks before it went back earlier
            removed.append(held[i])
            held[i] = self.null_block
        self.pool.free(reversed(removed))

    def num_skipped_blocks(self, request_id: str) -> int:
        blocks = self.req_to_blocks.get(request_id, [])
        return next((i for i, b in enumerate(blocks) if b is not self.null_block), len(blocks))


class ContiguousManager(SingleTypeKVCacheManager):
    """A system without paging (the chapter's one big locker per request): a request reserves `blocks_per_request`
    blocks (max_model_len's) when it is first given any, holds them all until it ends, and shares none."""

    def __init__(self, pool: BlockPool, block_size: int, null_block: KVBlock, blocks_per_request: int) -> None:
        super().__init__(pool, block_size, 0, null_block)
        self.blocks_per_request = blocks_per_request

    def find_longest_cache_hit(self, keys: Sequence[BlockHash], max_blocks: int, lookup: Lookup) -> list[KVBlock]:
        return []

    def num_blocks_to_allocate(self, request_id: str, num_tokens: int, new_computed: Sequence[KVBlock]) -> int:
        return 0 if self.req_to_blocks.get(request_id) else self.blocks_per_request

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> None:
        held = self.req_to_blocks.setdefault(request_id, [])
        if not held:
            held.extend(self.pool.allocate(self.blocks_per_request))


def make_single_type_manager(
    window: int | None, pool: BlockPool, block_size: int, group: int, null_block: KVBlock
) -> SingleTypeKVCacheManager:
    if window is None:
        return FullAttentionManager(pool, block_size, group, null_block)
    return SlidingWindowManager(pool, block_size, group, null_block, window)
