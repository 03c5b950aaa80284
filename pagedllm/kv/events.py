"""KV-cache events in vLLM's format (`vllm/distributed/kv_events.py`): BlockStored, BlockRemoved, AllBlocksCleared.

A router that knows which blocks each replica holds can send a request to the replica that has its prefix
(exact routing, as vLLM production-stack and llm-d do); so each engine can record what enters and leaves its
prefix cache. The wire format is vLLM's, so other routers can consume pagedllm's events: a `KVEventBatch` is a
msgpack array `[ts, [event, ...]]` and each event a msgpack map tagged `{"type": "BlockStored", ...}` with
vLLM's field names (what msgspec writes for vLLM's structs). Block hashes are pagedllm's chained sha256 digests
(bytes, one of vLLM's `ExternalBlockHash` forms).

Recording is off unless a `KVEventLog` is attached to the block pool; then each event costs one append. The
blocks of kv_blend's stored passages (engine/blend.py) are in no event, stored or removed: their hashes are rooted
apart from every prompt's chain, so no router could match a prefix to them.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pagedllm.kv.hashing import BlockHash


@dataclass
class BlockStored:
    """Blocks that entered the prefix cache, in chain order: `parent_block_hash` is the hash before the first."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    medium: str | None = None
    lora_id: int | None = None
    lora_name: str | None = None


@dataclass
class BlockRemoved:
    """Blocks whose prefix left the cache (evicted for reuse, or a failed step's registrations taken back)."""

    block_hashes: list[BlockHash]
    medium: str | None = None


@dataclass
class AllBlocksCleared:
    """The whole prefix cache was dropped (reset_prefix_cache, or a fresh engine)."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
_TYPES = {cls.__name__: cls for cls in (BlockStored, BlockRemoved, AllBlocksCleared)}


def event_to_wire(event: KVCacheEvent) -> dict[str, object]:
    """The msgpack map msgspec writes for vLLM's tagged struct: the tag first, then every field without a
    default in vLLM (None included) in vLLM's order."""
    if isinstance(event, BlockStored):
        return {
            "type": "BlockStored",
            "block_hashes": list(event.block_hashes),
            "parent_block_hash": event.parent_block_hash,
            "token_ids": list(event.token_ids),
            "block_size": event.block_size,
            "lora_id": event.lora_id,
            "medium": event.medium,
            "lora_name": event.lora_name,
        }
    if isinstance(event, BlockRemoved):
        return {"type": "BlockRemoved", "block_hashes": list(event.block_hashes), "medium": event.medium}
    return {"type": "AllBlocksCleared"}


def event_from_wire(obj: dict[str, Any]) -> KVCacheEvent:
    """An event from its wire map; fields pagedllm does not model (vLLM's optional extras) are ignored."""
    kind = _TYPES.get(str(obj.get("type")))
    if kind is None:
        raise ValueError(f"not a KV cache event: {obj.get('type')!r}")
    names = kind.__dataclass_fields__
    return kind(**{k: v for k, v in obj.items() if k in names})


def encode_batch(events: Sequence[KVCacheEvent], ts: float | None = None) -> bytes:
    """A vLLM `KVEventBatch` as msgpack bytes: `[ts, [events]]` (no data-parallel rank: omitted as vLLM omits it)."""
    import msgpack

    return msgpack.packb([time.time() if ts is None else ts, [event_to_wire(e) for e in events]], use_bin_type=True)


def decode_batch(data: bytes) -> tuple[float, list[KVCacheEvent]]:
    """(ts, events) of a vLLM `KVEventBatch` in msgpack, whether vLLM or pagedllm wrote it."""
    import msgpack

    batch = msgpack.unpackb(data, raw=False)
    return float(batch[0]), [event_from_wire(e) for e in batch[1]]


@dataclass
class KVEventLog:
    """The engine's events since start, numbered, bounded: a reader asks for those after the last number it saw
    (vLLM's replay socket does the same). A reader that fell behind past `capacity` is told so (`lost`) and must
    resynchronise from an AllBlocksCleared plus the engine's current blocks (`snapshot` of the pool)."""

    block_size: int
    medium: str | None = None
    capacity: int = 65536
    _events: deque[tuple[int, KVCacheEvent]] = field(default_factory=deque)
    _next: int = 1
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, event: KVCacheEvent) -> None:
        with self._lock:
            self._events.append((self._next, event))
            self._next += 1
            if len(self._events) > self.capacity:
                self._events.popleft()

    def stored(self, hashes: list[BlockHash], parent: BlockHash | None, token_ids: list[int]) -> None:
        self.record(BlockStored(hashes, parent, token_ids, self.block_size, self.medium))

    def removed(self, hashes: list[BlockHash]) -> None:
        self.record(BlockRemoved(hashes, self.medium))

    def since(self, after: int) -> tuple[int, list[KVCacheEvent], bool]:
        """(number of the last event, the events numbered after `after`, whether some were already dropped)."""
        with self._lock:
            last = self._next - 1
            first = self._events[0][0] if self._events else self._next
            lost = after + 1 < first
            return last, [e for n, e in self._events if n > after], lost
