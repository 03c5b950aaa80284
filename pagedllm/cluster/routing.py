"""The prefix-aware routing policy, without Ray: which replica most likely holds the longest prefix of a prompt.

A prompt's prefix is named by the chained block hashes the KV cache itself uses (`pagedllm.kv.hashing`): a
block's hash covers every token before it, so "replica R holds hash h_k" means R holds the whole first k blocks.
The index keeps, per block hash, a bitmask of the replicas that hold it; the longest prefix a replica holds is the
length of the run of the prompt's hashes whose masks include it, found in one pass over the hashes with a mask
AND per block. Keys are the first 8 bytes of the sha256 digest (a collision only costs a routing decision).

It is filled two ways. `prefix` (approximate, as SGLang's and vLLM's routers): the router records the prompt's
hashes under the replica it sent it to, and forgets them in LRU order beyond the replica's KV capacity, since the
replica evicts too. `kv-events` (exact, as llm-d): the replicas' own BlockStored / BlockRemoved / AllBlocksCleared
events add and remove hashes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pagedllm.kv.events import BlockRemoved, BlockStored, KVCacheEvent
from pagedllm.kv.hashing import BlockHash, extra_key, hash_full_blocks
from pagedllm.lora_request import lora_id

POLICIES = ("round-robin", "prefix", "kv-events")
PROMPT_KW = "prompt_token_ids"  # the keyword the ingress passes a request's token ids in
SALT_KW = "cache_salt"  # and its cache salt
LORA_KW = "lora_request"  # and its LoRA adapter (a LoRARequest)

# The request routers of this process by (application, deployment) (router.PagedLLMRouter registers itself): the
# ingress sets its router's policy, asks it for the replica list and feeds it the replicas' KV events.
ROUTERS: dict[tuple[str, str], Any] = {}


def router_key(handle: Any) -> tuple[str, str]:
    return handle.app_name, handle.deployment_name


def router_for(handle: Any) -> Any:
    """This process's router for the deployment behind `handle` (Ray Serve builds it at the handle's first call)."""
    router = ROUTERS.get(router_key(handle))
    if router is None:
        raise RuntimeError(
            f"no pagedllm router for {router_key(handle)}: is the deployment's request router "
            "pagedllm.cluster.router.PagedLLMRouter, and has the handle made a call?"
        )
    return router


def prefix_keys(
    token_ids: Sequence[int], block_size: int, max_blocks: int, cache_salt: str | None = None, lora_int_id: int = 0
) -> list[int]:
    """The index keys of a prompt's first `max_blocks` full blocks: the KV cache's chained hashes, truncated,
    with its `cache_salt` and LoRA adapter id in them as in the engine's (two tenants' or two adapters' same
    prompt is two prefixes, never routed to the other's blocks, and the keys are the ones its replica's KV events
    publish).

    The prompt's last token never counts (the engine always computes it), as in the engine's own lookup."""
    n = min(max_blocks, (len(token_ids) - 1) // block_size) if token_ids else 0
    extra = extra_key(cache_salt, lora_int_id)
    return [key(h) for h in hash_full_blocks(token_ids[: n * block_size], block_size, extra)]


def request_keys(kwargs: dict[str, Any], block_size: int, max_blocks: int) -> list[int]:
    """The keys of an engine request as the ingress sends it (its token ids, cache salt and adapter as keywords)."""
    lora = lora_id(kwargs.get(LORA_KW))
    return prefix_keys(kwargs.get(PROMPT_KW) or [], block_size, max_blocks, kwargs.get(SALT_KW), lora)


def key(block_hash: BlockHash) -> int:
    return int.from_bytes(block_hash[:8], "little")


@dataclass
class PrefixIndex:
    """Block hash -> replicas holding it, for every replica of a deployment.

    `capacity`: the most blocks remembered per replica (its KV cache size, in blocks); beyond it the least
    recently routed are forgotten. None: unbounded (exact mode: the replicas' events remove what they evict).
    """

    capacity: int | None = None
    _holders: dict[int, int] = field(default_factory=dict)  # key -> bitmask of replica slots
    _slots: dict[str, int] = field(default_factory=dict)  # replica id -> its bit
    _blocks: dict[str, OrderedDict[int, None]] = field(default_factory=dict)  # per replica, LRU order

    def replicas(self) -> list[str]:
        return list(self._slots)

    def num_blocks(self, replica: str) -> int:
        return len(self._blocks.get(replica, ()))

    def add_replica(self, replica: str) -> None:
        if replica in self._slots:
            return
        used = set(self._slots.values())
        self._slots[replica] = next(bit for bit in (1 << i for i in range(len(used) + 1)) if bit not in used)
        self._blocks[replica] = OrderedDict()

    def remove_replica(self, replica: str) -> None:
        """A replica left (died, scaled down): what it held is gone with it."""
        self.clear(replica)
        self._slots.pop(replica, None)
        self._blocks.pop(replica, None)

    def insert(self, replica: str, keys: Iterable[int]) -> None:
        """The replica holds these blocks now (most recently used last)."""
        self.add_replica(replica)
        bit, blocks = self._slots[replica], self._blocks[replica]
        for k in keys:
            self._holders[k] = self._holders.get(k, 0) | bit
            blocks[k] = None
            blocks.move_to_end(k)
        while self.capacity is not None and len(blocks) > self.capacity:
            self._drop(bit, blocks.popitem(last=False)[0])

    def remove(self, replica: str, keys: Iterable[int]) -> None:
        blocks = self._blocks.get(replica)
        if blocks is None:
            return
        for k in keys:
            if k in blocks:
                del blocks[k]
                self._drop(self._slots[replica], k)

    def clear(self, replica: str) -> None:
        blocks = self._blocks.get(replica)
        if blocks is not None:
            for k in blocks:
                self._drop(self._slots[replica], k)
            blocks.clear()

    def _drop(self, bit: int, k: int) -> None:
        mask = self._holders.get(k, 0) & ~bit
        if mask:
            self._holders[k] = mask
        else:
            self._holders.pop(k, None)

    def match(self, keys: Sequence[int], candidates: Iterable[str]) -> dict[str, int]:
        """For each candidate, how many of the leading `keys` it holds (its cached prefix, in blocks)."""
        bits = {self._slots[c]: c for c in candidates if c in self._slots}
        out = {c: 0 for c in candidates}
        alive = sum(bits)
        for depth, k in enumerate(keys):
            held = self._holders.get(k, 0) & alive
            for bit in _bits(alive & ~held):
                out[bits[bit]] = depth
            alive = held
            if not alive:
                return out
        for bit in _bits(alive):
            out[bits[bit]] = len(keys)
        return out


def _bits(mask: int) -> Iterable[int]:
    while mask:
        low = mask & -mask
        yield low
        mask ^= low


@dataclass(frozen=True)
class Choice:
    """Replicas in order of preference (Ray tries the first that has room), and why the first was chosen."""

    ranked: list[str]
    reason: str  # "prefix" (longest cached prefix), "balance" (best was overloaded), "new" (no replica has it)
    matched_blocks: int


def choose(
    matches: dict[str, int], load: dict[str, int], cached: dict[str, int], threshold: int, min_match: int = 1
) -> Choice:
    """The replica with the longest cached prefix, ties to the least loaded; the least loaded instead when the
    best is more than `threshold` requests busier than it (a hot prefix must not pile onto one replica: its
    prefill saved is worth less than a queue). A prefix nobody holds (or holds fewer than `min_match` blocks of:
    a short system prompt every request shares must not pin all traffic to one replica) goes to the least loaded
    replica, ties to the one with the fewest cached blocks, so new prefix groups spread evenly."""
    if not matches:
        return Choice([], "new", 0)
    by_load = sorted(matches, key=lambda r: (load.get(r, 0), cached.get(r, 0), r))
    best = max(by_load, key=lambda r: matches[r])  # max keeps the first of equals: the least loaded
    if matches[best] < max(1, min_match):
        return Choice(by_load, "new", 0)
    least = by_load[0]
    if load.get(best, 0) - load.get(least, 0) > threshold:
        return Choice(by_load, "balance", matches[least])
    rest = sorted((r for r in matches if r != best), key=lambda r: (-matches[r], load.get(r, 0), r))
    return Choice([best, *rest], "prefix", matches[best])


def apply_events(index: PrefixIndex, replica: str, events: Iterable[KVCacheEvent]) -> None:
    """A replica's KV events (vLLM's BlockStored / BlockRemoved / AllBlocksCleared) applied to the index."""
    for event in events:
        if isinstance(event, BlockStored):
            index.insert(replica, [key(h) for h in event.block_hashes])
        elif isinstance(event, BlockRemoved):
            index.remove(replica, [key(h) for h in event.block_hashes])
        else:
            index.clear(replica)
