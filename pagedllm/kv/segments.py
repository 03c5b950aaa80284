"""kv_blend's segment store behind the connector seam (connector.py): a passage's stored blocks, keyed by the
segment hashes of engine/blend.py, live in the same pool as prefix blocks (ref-counted, LRU-evicted, offloaded);
a request holds the ones it will copy until they are copied or the request ends (`request_finished`).

Only a model of one full-attention group serves segments: a passage's blocks then hold every layer's K/V, which
the copy re-rotates as a whole (the engine makes the store only then: `PagedKVCacheManager.one_full_attention_group`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pagedllm.kv.block_pool import BlockPool, KVBlock
from pagedllm.kv.connector import KVConnector
from pagedllm.kv.hashing import BlockHash

Fetch = Callable[[BlockHash], "KVBlock | None"]  # a key not in RAM, read from a tier into a held block (counted)


class SegmentStore(KVConnector):
    def __init__(self, pool: BlockPool, null_block: KVBlock, fetch: Fetch) -> None:
        self.pool, self.null_block, self.fetch = pool, null_block, fetch
        self.holds: dict[str, list[KVBlock]] = {}  # per request, the stored segment blocks it holds
        self.limits: dict[str, int] = {}  # per request, its first copied token: no block from there is a prefix's

    def hold(self, request_id: str, hashes: Sequence[BlockHash]) -> list[KVBlock]:
        """The leading run of `hashes` found in RAM or on a tier, held for the request until `release` or its
        end (so no allocation meanwhile evicts them)."""
        found: list[KVBlock] = []
        for block_hash in hashes:
            block = self.pool.get_cached_block(block_hash)
            if block is not None:
                self.pool.touch([block])
            else:
                block = self.fetch(block_hash)
                if block is None:
                    break
                block.published = False  # a passage's block: not a prefix, in no KV event (block_pool.py)
            found.append(block)
        self.holds.setdefault(request_id, []).extend(found)
        return found

    def release(self, request_id: str, blocks: Sequence[KVBlock]) -> None:
        """Drop the hold on `blocks` (copied now); they stay cached, evictable, LRU last. One entry of the
        request's holds goes per block released: two segments that share a block hold it twice."""
        held = self.holds.get(request_id, [])
        for block in blocks:
            del held[next(i for i, h in enumerate(held) if h is block)]
        self.pool.free(reversed(list(blocks)))

    def pin(self, blocks: Sequence[KVBlock]) -> None:
        """Keep a lookup's hits (cached, maybe free) from eviction while other blocks are taken (a segment read
        from the disk tier) before `allocate_slots` holds them; `unpin` after."""
        self.pool.touch([b for b in blocks if b is not self.null_block])

    def unpin(self, blocks: Sequence[KVBlock]) -> None:
        self.pool.free(reversed([b for b in blocks if b is not self.null_block]))

    def new_blocks(self, hashes: Sequence[BlockHash]) -> list[tuple[int, KVBlock]]:
        """Fresh blocks for the blocks of a segment not stored yet, as (index in `hashes`, block), registered
        under their segment hashes and held once: the caller writes them, then `end_store`s them. Only from free
        blocks (LRU eviction), and none at all when fewer are free than the segment misses, so storing never
        makes a running request wait."""
        missing = [i for i, h in enumerate(hashes) if self.pool.get_cached_block(h) is None]
        if not missing or len(missing) > self.pool.num_free_blocks:
            return []
        blocks = self.pool.allocate(len(missing))
        for i, block in zip(missing, blocks):
            self.pool.cache_block(block, hashes[i], published=False)  # not a prefix: no KV event, as on disk
        return list(zip(missing, blocks))

    def end_store(self, blocks: Sequence[KVBlock], written: bool) -> None:
        """Let go of `new_blocks`' blocks; unless their K/V were `written`, forget their hashes first."""
        if not written:
            for block in blocks:
                self.pool.uncache(block)
        self.pool.free(reversed(list(blocks)))

    def limit(self, request_id: str, num_tokens: int | None) -> None:
        """Register none of the request's blocks past `num_tokens` tokens (its first copied one: copied K/V are an
        approximation a plain request must never read); None: all (a plan without copies)."""
        if num_tokens is None:
            self.limits.pop(request_id, None)
        else:
            self.limits[request_id] = num_tokens

    def cache_limit(self, request_id: str) -> int | None:
        return self.limits.get(request_id)

    def request_finished(self, request_id: str) -> None:
        self.pool.free(reversed(self.holds.pop(request_id, [])))
        self.limits.pop(request_id, None)
