"""KV-cache managers: who holds which blocks, and how a request grows.

Two policies share one interface so the engine can measure them side by side:
- `PagedKVCacheManager` (PagedAttention): a request holds ceil(tokens / block_size) blocks, grows by one block
  when its last one is full, and shares full prefix blocks with other requests through the prefix cache.
- `ContiguousKVCacheManager` (the baseline paging is measured against, "one big locker each"): at admission a
  request reserves room for max_model_len tokens, rounded up to whole blocks, and shares nothing.

With a sliding window (every layer of the model attends to its last `sliding_window` tokens only: Mistral
v0.1), the paged manager works as vLLM's SlidingWindowManager: once a block has fallen out of the window of the
request's next token it goes back to the pool (still cached, so evictable and reusable by a prefix hit) and the
table holds the null block in its place; a prefix hit needs only the blocks inside the window.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from pagedllm.kv.block_pool import BlockPool, KVBlock
from pagedllm.kv.hashing import BlockHash, hash_full_blocks
from pagedllm.kv.offload import DiskKVTier

logger = logging.getLogger("pagedllm")


class BlockIO(Protocol):
    """The KV contents of one block as bytes (the model runner's cache tensors): what the disk tier stores."""

    def read_block(self, block_id: int) -> bytes: ...

    def write_block(self, block_id: int, data: bytes) -> None: ...


class KVRequest(Protocol):
    """What a manager needs to know of a request (the engine's Request satisfies it)."""

    request_id: str
    all_token_ids: list[int]  # prompt + generated so far
    num_computed_tokens: int  # tokens whose KV is already in the cache
    cache_salt: str | None  # extra hash key: requests with different salts never share blocks


@dataclass
class TokenRequest:
    """The smallest KVRequest: for tools and tests that ask a manager what token sequences would hold and share,
    without an engine (`pagedllm rag bench --count-only` counts cache hits this way)."""

    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int = 0
    cache_salt: str | None = None


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


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
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self.req_tokens: dict[str, int] = {}  # tokens each request has slots for (stored or about to be)
        self.prefix_stats = PrefixCacheStats()

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

    def num_skipped_blocks(self, request_id: str) -> int:
        """Leading entries of the request's table that went back to the pool (out of a sliding window)."""
        return 0

    def get_computed_blocks(self, request: KVRequest) -> tuple[list[KVBlock], int]:
        """The longest chain of cached full blocks of a new request's tokens, and how many tokens it covers."""
        return [], 0

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count a lookup once its request is admitted (a request that waits is looked up again next step)."""
        self.prefix_stats.queries += num_tokens
        self.prefix_stats.hits += num_hit_tokens

    def allocate_slots(
        self,
        request: KVRequest,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVBlock] = (),
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
        """Return a finished, aborted or preempted request's blocks, the tail of its chain first.

        The tail goes first because it is the least likely to be shared: when memory runs short, the eviction
        order (least recently freed first) then drops a prompt's last blocks before its first ones.
        """
        blocks = self.req_blocks.pop(request.request_id, [])
        self.req_tokens.pop(request.request_id, None)
        self.pool.free(reversed(blocks))

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()

    def commit_step(self) -> None:
        """The step's K/V are written: the blocks it registered in the prefix cache are now really cached."""

    def rollback_step(self) -> dict[str, list[KVBlock]]:
        """The step failed before its K/V were written: unregister the blocks it registered (else a later request
        would be served their never-written contents) and return them per request."""
        return {}

    def attach_disk_tier(self, disk: DiskKVTier, block_io: BlockIO) -> None:
        """Only the paged manager keeps blocks a disk tier could hold (the config refuses any other)."""
        raise ValueError(f"{type(self).__name__} has no prefix cache for a disk tier")

    def offload_cached(self) -> None:
        """The engine went idle: a manager with a disk tier writes its hot blocks there; this one has none."""

    def cache_computed(self, request: KVRequest, num_tokens: int) -> None:
        """Register the full blocks of the request's first `num_tokens` tokens (after a rolled-back step ran)."""


class PagedKVCacheManager(KVCacheManager):
    def __init__(
        self, num_blocks: int, block_size: int = 16, enable_caching: bool = True, sliding_window: int | None = None
    ) -> None:
        super().__init__(num_blocks, block_size, enable_caching)
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding window must be at least 1 token, got {sliding_window}")
        self.sliding_window = sliding_window
        # What a table holds for a block that fell out of the window: not in the pool, never counted or cached.
        # Its id (0) is any valid block for the kernels, which never read it (the torch path masks it out).
        self.null_block = KVBlock(0)
        self.req_hashes: dict[str, list[BlockHash]] = {}
        self.req_num_cached: dict[str, int] = {}  # how many of a request's blocks are registered in the cache
        # Blocks registered since the last commit_step: (request id, its req_num_cached before, the blocks).
        # Registration happens at allocation, before the model writes the blocks, so that a request scheduled
        # later in the same step (another of n samples) can share them; a failed step must take it back.
        self.step_journal: list[tuple[str, int, list[KVBlock]]] = []
        self.disk: DiskKVTier | None = None
        self.block_io: BlockIO | None = None
        # kv_blend: stored segment blocks a request holds until their K/V are copied into its own slots.
        self.req_segments: dict[str, list[KVBlock]] = {}

    def attach_disk_tier(self, disk: DiskKVTier, block_io: BlockIO) -> None:
        """Blocks evicted from the RAM pool go to `disk`; lookups that miss in RAM continue there."""
        self.disk, self.block_io = disk, block_io
        self.pool.on_evict = self._offload

    def _offload(self, block: KVBlock) -> None:
        assert self.disk is not None and self.block_io is not None and block.block_hash is not None
        io = self.block_io
        self.disk.put(block.block_hash, lambda: io.read_block(block.block_id))

    def offload_cached(self) -> None:
        """Queue the registered blocks the disk tier lacks, as many as its queue takes. Eviction alone would never
        write the hottest prefixes (a shared system prompt is never evicted), and a restart would miss them first;
        the engine calls this when it goes idle, between steps, so every registered block's K/V are written."""
        if self.disk is None:
            return
        for block in list(self.pool.cached.values()):
            if not self.disk.accepting:
                break
            if block.block_hash is not None and not self.disk.contains(block.block_hash):
                self._offload(block)

    def _hashes(self, request: KVRequest, num_tokens: int) -> list[BlockHash]:
        """The chained hashes of the request's full blocks within its first `num_tokens` tokens (memoized)."""
        known = self.req_hashes.get(request.request_id, [])
        if len(known) < num_tokens // self.block_size:
            known = hash_full_blocks(
                request.all_token_ids[:num_tokens], self.block_size, getattr(request, "cache_salt", None), known
            )
            self.req_hashes[request.request_id] = known
        return known

    def get_computed_blocks(self, request: KVRequest) -> tuple[list[KVBlock], int]:
        if not self.enable_caching:
            return [], 0
        num_tokens = len(request.all_token_ids)
        # Never the whole prompt: its last token must be computed to produce the next token's logits.
        max_blocks = (num_tokens - 1) // self.block_size
        hashes = self._hashes(request, max_blocks * self.block_size)[:max_blocks]
        hits: list[KVBlock] = []
        for block_hash in hashes:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        sliding = self.sliding_window is not None and len(hits) < max_blocks
        windowed = self._window_hit(hashes) if sliding else []
        if len(windowed) < max_blocks and self.disk is not None and len(hits) < max_blocks:
            if self.disk.contains(hashes[len(hits)]):  # (a whole window in RAM needs no disk read)
                hits += self._load_from_disk(request, hashes, hits)
                windowed = self._window_hit(hashes) if sliding else []  # the reads may have evicted some
        if self.sliding_window is not None:
            hits = windowed if len(windowed) > len(hits) else hits
            skipped = self._first_useful_block(len(hits) * self.block_size)
            hits[:skipped] = [self.null_block] * min(skipped, len(hits))
        return hits, len(hits) * self.block_size

    def hold_segment(self, request: KVRequest, hashes: Sequence[BlockHash]) -> list[KVBlock]:
        """The stored blocks of a segment (kv_blend), the leading run of `hashes` found in RAM or on the disk tier,
        held for `request` until `release_segment` or its `free` (so no allocation meanwhile evicts them)."""
        if not self.enable_caching:
            return []
        found: list[KVBlock] = []
        for block_hash in hashes:
            block = self.pool.get_cached_block(block_hash)
            if block is not None:
                self.pool.touch([block])
            elif self.disk is not None and self.pool.num_free_blocks and self.disk.contains(block_hash):
                data = self.disk.load(block_hash)
                block = self._fill_free_block(block_hash, data, published=False) if data is not None else None
                if block is None:
                    break
                self.prefix_stats.disk_hits += self.block_size
            else:
                break
            found.append(block)
        self.req_segments.setdefault(request.request_id, []).extend(found)
        return found

    def release_segment(self, request: KVRequest, blocks: Sequence[KVBlock]) -> None:
        """Drop the hold of `hold_segment` on `blocks` (copied now); they stay cached, evictable, LRU last. One
        entry of the request's holds goes per block released: two segments that share a block hold it twice."""
        held = self.req_segments.get(request.request_id, [])
        for block in blocks:
            del held[next(i for i, h in enumerate(held) if h is block)]
        self.pool.free(reversed(list(blocks)))

    def pin(self, blocks: Sequence[KVBlock]) -> None:
        """Keep a lookup's hits (cached, maybe free) from eviction while other blocks are taken (a segment read
        from the disk tier) before `allocate_slots` holds them; `unpin` after."""
        self.pool.touch([b for b in blocks if b is not self.null_block])

    def unpin(self, blocks: Sequence[KVBlock]) -> None:
        self.pool.free(reversed([b for b in blocks if b is not self.null_block]))

    def new_segment_blocks(self, hashes: Sequence[BlockHash]) -> list[tuple[int, KVBlock]]:
        """Fresh blocks for the blocks of a segment not stored yet, as (index in `hashes`, block), registered
        under their segment hashes and held once: the caller writes them, then `end_segment_store`s them. Only
        from free blocks (LRU eviction), and none at all when fewer are free than the segment misses, so storing
        never makes a running request wait."""
        if not self.enable_caching:
            return []
        missing = [i for i, h in enumerate(hashes) if self.pool.get_cached_block(h) is None]
        if not missing or len(missing) > self.pool.num_free_blocks:
            return []
        blocks = self.pool.allocate(len(missing))
        for i, block in zip(missing, blocks):
            self.pool.cache_block(block, hashes[i], published=False)  # not a prefix: no KV event, as on disk
        return list(zip(missing, blocks))

    def end_segment_store(self, blocks: Sequence[KVBlock], written: bool) -> None:
        """Let go of `new_segment_blocks`' blocks; unless their K/V were `written`, forget their hashes first."""
        if not written:
            for block in blocks:
                self.pool.uncache(block)
        self.pool.free(reversed(list(blocks)))

    def _first_useful_block(self, num_computed_tokens: int) -> int:
        """The first block the token after `num_computed_tokens` computed ones still sees (its window's start)."""
        assert self.sliding_window is not None
        return max(0, (num_computed_tokens - self.sliding_window + 1) // self.block_size)

    def _window_hit(self, hashes: list[BlockHash]) -> list[KVBlock]:
        """vLLM's sliding-window hit: the rightmost run of cached blocks long enough to cover a window (the blocks
        before it are null: nothing will read them), else the run of cached blocks at the start, however short."""
        assert self.sliding_window is not None
        need = cdiv(self.sliding_window - 1, self.block_size)
        found = [self.pool.get_cached_block(h) for h in hashes]
        run = 0
        for i in range(len(found) - 1, -1, -1):
            run = run + 1 if found[i] is not None else 0
            if run >= max(need, 1):
                return [self.null_block] * i + [b for b in found[i : i + run] if b is not None]
        return [b for b in found[:run] if b is not None]

    def _remove_skipped_blocks(self, held: list[KVBlock], num_computed_tokens: int) -> None:
        """Give back the blocks that fell out of the window of the next token; they keep their prefix, so they stay
        evictable and a later hit can take them back. Oldest first, so they are evicted first: a later request
        that continues this one hits on the blocks of its last window (vLLM gives them back newest first)."""
        if self.sliding_window is None:
            return
        removed: list[KVBlock] = []
        for i in range(min(self._first_useful_block(num_computed_tokens), len(held)) - 1, -1, -1):
            if held[i] is self.null_block:
                break  # the blocks before it went back earlier
            removed.append(held[i])
            held[i] = self.null_block
        self.pool.free(reversed(removed))

    def num_skipped_blocks(self, request_id: str) -> int:
        blocks = self.req_blocks.get(request_id, [])
        return next((i for i, b in enumerate(blocks) if b is not self.null_block), len(blocks))

    @property
    def num_stored_tokens(self) -> int:
        """Also without the tokens of the blocks that fell out of a window (their slots went back)."""
        skipped = sum(1 for blocks in self.req_blocks.values() for b in blocks if b is self.null_block)
        return super().num_stored_tokens - skipped * self.block_size

    def _load_from_disk(self, request: KVRequest, hashes: list[BlockHash], hits: list[KVBlock]) -> list[KVBlock]:
        """Continue the prefix chain past the RAM hits: a block on disk is read into a free block and registered
        as if it had never left (one still in RAM is taken as it is). The chain is held meanwhile, so that the
        allocations cannot evict a block of it; it ends at the first block found nowhere or failing a check."""
        assert self.disk is not None and self.block_io is not None
        found: list[KVBlock] = []
        loaded: list[int] = []
        self.pool.touch(hits)
        try:
            for i in range(len(hits), len(hashes)):
                block = self.pool.get_cached_block(hashes[i])
                if block is None:
                    data = self.disk.load(hashes[i]) if self.pool.num_free_blocks else None
                    if data is None:
                        break
                    block = self._fill_free_block(hashes[i], data)
                    if block is None:
                        break
                    loaded.append(i)
                else:
                    self.pool.touch([block])
                found.append(block)
        finally:
            self.pool.free(reversed(found))
            self.pool.free(reversed(hits))
        self.prefix_stats.disk_hits += len(loaded) * self.block_size
        if loaded and self.pool.events is not None:
            self._publish_stored(request, hashes, loaded)
        return found

    def _fill_free_block(self, block_hash: BlockHash, data: bytes, published: bool = True) -> KVBlock | None:
        """A fresh block holding `data`, registered under `block_hash` (held once: the caller frees it);
        `published` as `BlockPool.cache_block`'s."""
        assert self.block_io is not None
        (block,) = self.pool.allocate(1)
        try:
            self.block_io.write_block(block.block_id, data)
        except Exception as e:  # noqa: BLE001 - a block that does not fit the cache is a miss, not a failed request
            logger.warning("KV disk tier: block does not fit the cache (%s): not served", e)
            self.pool.free([block])
            return None
        self.pool.cache_block(block, block_hash, published)
        return block

    def allocate_slots(
        self,
        request: KVRequest,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVBlock] = (),
        num_lookahead_tokens: int = 0,
    ) -> bool:
        rid = request.request_id
        held = self.req_blocks.get(rid, [])
        self._remove_skipped_blocks(held, request.num_computed_tokens)
        total = request.num_computed_tokens + len(new_computed_blocks) * self.block_size + num_new_tokens
        num_new_blocks = cdiv(total + num_lookahead_tokens, self.block_size) - len(held) - len(new_computed_blocks)
        real = [b for b in new_computed_blocks if b is not self.null_block]
        # Cached blocks that sit in the free queue leave it when touched, so they count against the free pool.
        evictable = sum(1 for b in real if b.ref_cnt == 0)
        if num_new_blocks + evictable > self.pool.num_free_blocks:
            return False
        self.pool.touch(real)
        held = self.req_blocks.setdefault(rid, held)
        held.extend(new_computed_blocks)
        if num_new_blocks > 0:
            held.extend(self.pool.allocate(num_new_blocks))
        self.req_tokens[rid] = total + num_lookahead_tokens
        if self.enable_caching:  # only blocks full of real tokens: drafts are not known to be the sequence yet
            self._cache_full_blocks(request, held, total)
        return True

    def trim(self, request: KVRequest, num_tokens: int) -> None:
        """Also free the blocks that held rejected drafts only (never registered: past the real tokens)."""
        super().trim(request, num_tokens)
        blocks = self.req_blocks.get(request.request_id)
        keep = cdiv(num_tokens, self.block_size)
        if blocks is not None and len(blocks) > keep:
            self.pool.free(reversed(blocks[keep:]))
            del blocks[keep:]

    def _cache_full_blocks(self, request: KVRequest, held: list[KVBlock], num_tokens: int) -> None:
        """Register the blocks that this step fills, so requests scheduled after this one can share them."""
        start = self.req_num_cached.get(request.request_id, 0)
        limit = getattr(request, "kv_cache_limit", None)  # kv_blend: past it the K/V are not a prefix's own
        num_full = (num_tokens if limit is None else min(num_tokens, limit)) // self.block_size
        if num_full <= start:
            return
        hashes = self._hashes(request, num_tokens)
        registered = [
            i
            for i in range(start, num_full)
            if held[i] is not self.null_block and self.pool.cache_block(held[i], hashes[i])
        ]
        if registered:
            self.step_journal.append((request.request_id, start, [held[i] for i in registered]))
            if self.pool.events is not None:
                self._publish_stored(request, hashes, registered)
        self.req_num_cached[request.request_id] = num_full

    def _publish_stored(self, request: KVRequest, hashes: list[BlockHash], registered: list[int]) -> None:
        """One BlockStored per run of consecutive registered blocks (a block whose prefix another block already
        holds is not registered, and breaks the run), with its parent hash and tokens as vLLM publishes them."""
        assert self.pool.events is not None
        runs: list[list[int]] = []
        for i in registered:
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        bs = self.block_size
        for run in runs:
            a, b = run[0], run[-1] + 1
            self.pool.events.stored(hashes[a:b], hashes[a - 1] if a else None, request.all_token_ids[a * bs : b * bs])

    def commit_step(self) -> None:
        self.step_journal.clear()

    def rollback_step(self) -> dict[str, list[KVBlock]]:
        undone: dict[str, list[KVBlock]] = {}
        for rid, before, blocks in reversed(self.step_journal):
            for block in blocks:
                self.pool.uncache(block)
            if rid in self.req_num_cached:
                self.req_num_cached[rid] = before
            undone.setdefault(rid, []).extend(blocks)
        self.step_journal.clear()
        return undone

    def cache_computed(self, request: KVRequest, num_tokens: int) -> None:
        if self.enable_caching and request.request_id in self.req_blocks:
            self._cache_full_blocks(request, self.req_blocks[request.request_id], num_tokens)

    def free(self, request: KVRequest) -> None:
        blocks = self.req_blocks.pop(request.request_id, [])
        self.req_tokens.pop(request.request_id, None)
        self.pool.free([b for b in reversed(blocks) if b is not self.null_block])
        self.pool.free(reversed(self.req_segments.pop(request.request_id, [])))
        self.req_hashes.pop(request.request_id, None)
        self.req_num_cached.pop(request.request_id, None)


class ContiguousKVCacheManager(KVCacheManager):
    """Reserves max_model_len (in whole blocks) per request at admission, as a system without paging must."""

    def __init__(self, num_blocks: int, block_size: int, max_model_len: int) -> None:
        super().__init__(num_blocks, block_size, enable_caching=False)
        self.blocks_per_request = cdiv(max_model_len, block_size)
        if self.blocks_per_request > num_blocks:
            raise ValueError(
                f"contiguous allocation reserves {self.blocks_per_request} blocks per request "
                f"(max_model_len {max_model_len}), but the KV cache has only {num_blocks}"
            )

    def allocate_slots(
        self,
        request: KVRequest,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVBlock] = (),
        num_lookahead_tokens: int = 0,
    ) -> bool:
        assert not new_computed_blocks, "contiguous allocation shares nothing"
        rid = request.request_id
        total = request.num_computed_tokens + num_new_tokens + num_lookahead_tokens
        if total > self.blocks_per_request * self.block_size:
            return False
        if rid not in self.req_blocks:
            if self.blocks_per_request > self.pool.num_free_blocks:
                return False
            self.req_blocks[rid] = self.pool.allocate(self.blocks_per_request)
        self.req_tokens[rid] = total
        return True


def make_kv_cache_manager(
    allocation: str,
    num_blocks: int,
    block_size: int,
    max_model_len: int,
    enable_prefix_caching: bool,
    sliding_window: int | None = None,
) -> KVCacheManager:
    """`sliding_window`: the window of every layer, when they share one (kv.sizing.freeing_window)."""
    if allocation == "paged":
        return PagedKVCacheManager(num_blocks, block_size, enable_prefix_caching, sliding_window)
    if allocation == "contiguous":
        return ContiguousKVCacheManager(num_blocks, block_size, max_model_len)
    raise ValueError(f"unknown KV allocation {allocation!r}: choose paged or contiguous")
