"""The one seam through which something beside the RAM pool takes part in the prefix cache (vLLM v1's KV
connector, CPU-sized): the disk tier (`DiskTierConnector`) and kv_blend's segment store (segments.py).

The paged manager calls each hook at its one point and knows nothing of what answers it: a lookup that misses in
RAM asks the connectors whether they hold a block's key (`contains`) and for its K/V in a free block (`load`), a
hybrid model's recurrent-state checkpoints as well (they are pool blocks: kv/state_slots.py); a request's end
(`request_finished`) lets go of what a connector held for it; a connector that put K/V into a request's blocks that
are not its prefix's own bounds what is registered (`cache_limit`); the engine going idle (`idle`) lets a tier
write what it lacks. A connector that
stores nothing answers False / None.
"""

from __future__ import annotations

import logging
from typing import Protocol

from pagedllm.kv.block_pool import BlockPool, KVBlock
from pagedllm.kv.hashing import BlockHash
from pagedllm.kv.offload import DiskKVTier

logger = logging.getLogger("pagedllm")


class BlockIO(Protocol):
    """The KV contents of one block as bytes (the model runner's cache tensors): what the disk tier stores."""

    def read_block(self, block_id: int) -> bytes: ...

    def write_block(self, block_id: int, data: bytes) -> None: ...


class KVConnector:
    """The hooks, each a no-op here."""

    def contains(self, key: BlockHash) -> bool:
        return False

    def load(self, pool: BlockPool, key: BlockHash) -> KVBlock | None:
        """The block of `key` read into a free block of `pool`, registered under `key` and held once (the caller
        frees it); None if it is not here, fails a check, or no block is free."""
        return None

    def cache_limit(self, request_id: str) -> int | None:
        """Tokens of the request past which its blocks are not registered in the prefix cache (K/V this connector
        put there are not the prefix's own); None: no limit."""
        return None

    def request_finished(self, request_id: str) -> None:
        """The request's blocks went back (finished, aborted, preempted)."""

    def idle(self, pool: BlockPool) -> None:
        """The engine has nothing to run."""


class DiskTierConnector(KVConnector):
    """Blocks evicted from the RAM pool go to the disk tier (offload.py); lookups that miss in RAM continue there.
    Keys are per KV-cache group (hashing.group_key), and `read_block` / `write_block` move a block id's bytes in
    every cache tensor, so each group's blocks go to disk and back as the one group's did, and so do a hybrid
    model's state checkpoints (blocks of the pool under their own keys)."""

    def __init__(self, disk: DiskKVTier, block_io: BlockIO, pool: BlockPool) -> None:
        self.disk, self.block_io = disk, block_io
        pool.on_evict = self._offload

    def _offload(self, block: KVBlock) -> None:
        assert block.block_hash is not None
        io = self.block_io
        self.disk.put(block.block_hash, lambda: io.read_block(block.block_id))

    def contains(self, key: BlockHash) -> bool:
        return self.disk.contains(key)

    def load(self, pool: BlockPool, key: BlockHash) -> KVBlock | None:
        if not pool.num_free_blocks:
            return None
        data = self.disk.load(key)
        if data is None:
            return None
        (block,) = pool.allocate(1)
        try:
            self.block_io.write_block(block.block_id, data)
        except Exception as e:  # noqa: BLE001 - a block that does not fit the cache is a miss, not a failed request
            logger.warning("KV disk tier: block does not fit the cache (%s): not served", e)
            pool.free([block])
            return None
        pool.cache_block(block, key)
        return block

    def idle(self, pool: BlockPool) -> None:
        """Queue the registered blocks the disk tier lacks, as many as its queue takes. Eviction alone would never
        write the hottest prefixes (a shared system prompt is never evicted), and a restart would miss them first;
        the engine calls this between steps, so every registered block's K/V are written."""
        for block in list(pool.cached.values()):
            if not self.disk.accepting:
                break
            if block.block_hash is not None and not self.disk.contains(block.block_hash):
                self._offload(block)
