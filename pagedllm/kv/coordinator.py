"""The coordinator over one manager per KV-cache group on one block pool (vLLM v1's KVCacheCoordinator).

Every group keeps its own block table per request; an allocation is all or nothing across the groups (the sum of
what each takes must be free); a prefix hit is the longest that every group can serve: each group's hit for the
shortest length found so far, again, until they agree (a full-attention hit shortens to any prefix, a sliding
one must be looked up again at the shorter length, since it needs the blocks just before its end; a hybrid
model's recurrent-state group, recurrent_state_manager.py, ends its hit where a state checkpoint lies).

The groups with block tables (one per KV-cache group of the layout, the runner's tables in that order) come first;
a group that holds no table (the recurrent state) is added after them and takes part in every call but `tables`.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedllm.kv.block_pool import BlockPool, KVBlock
from pagedllm.kv.connector import KVConnector
from pagedllm.kv.hashing import BlockHash
from pagedllm.kv.single_type_manager import Lookup, SingleTypeKVCacheManager

GroupBlocks = list[list[KVBlock]]  # per group, blocks of one request (a hit, or its tables)


class KVCacheCoordinator:
    def __init__(self, managers: Sequence[SingleTypeKVCacheManager], pool: BlockPool, block_size: int) -> None:
        """`managers`: one per group with block tables, in the layout's order (each of its group's kind)."""
        self.pool, self.block_size = pool, block_size
        self.managers: list[SingleTypeKVCacheManager] = list(managers)
        self.num_tables = len(self.managers)  # the groups with block tables; any added later hold none

    def add(self, manager: SingleTypeKVCacheManager) -> None:
        """A group without block tables (a hybrid model's recurrent state), after the table groups."""
        self.managers.append(manager)

    @property
    def table_managers(self) -> list[SingleTypeKVCacheManager]:
        return self.managers[: self.num_tables]

    def _padded(self, new_computed: GroupBlocks) -> GroupBlocks:
        """A hit per group: the groups it does not name hit nothing."""
        return list(new_computed) + [[] for _ in range(len(self.managers) - len(new_computed))]

    def find_longest_cache_hit(
        self, request_id: str, hashes: Sequence[BlockHash], max_blocks: int, lookup: Lookup
    ) -> GroupBlocks:
        """Per group, the hit of the longest prefix (at most `max_blocks` blocks) that every group can serve."""
        n = max_blocks
        while True:
            hits = [m.find_longest_cache_hit(m.keys(request_id, hashes), n, lookup) for m in self.managers]
            shortest = min(len(h) for h in hits)
            if all(len(h) == shortest for h in hits):
                return hits
            n = shortest

    def note_hit(
        self, request_id: str, hashes: Sequence[BlockHash], hits: GroupBlocks, max_blocks: int, lookup: Lookup
    ) -> None:
        """Tell every group the hit a lookup settled on (its allocation gets it), once it is final."""
        for m in self.managers:
            m.note_hit(request_id, m.keys(request_id, hashes), len(hits[0]), max_blocks, lookup)

    def connect(self, connector: KVConnector) -> None:
        for m in self.managers:
            m.connect(connector)

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        for m in self.managers:
            m.remove_skipped_blocks(request_id, num_computed_tokens)

    def can_allocate(self, request_id: str, num_tokens: int, new_computed: GroupBlocks) -> bool:
        """The free pool holds what every group's growth takes, and each group has the rest it gives (a slot)."""
        hit = self._padded(new_computed)
        need = sum(m.num_blocks_to_allocate(request_id, num_tokens, b) for m, b in zip(self.managers, hit))
        return need <= self.pool.num_free_blocks and all(
            m.can_allocate(request_id, b) for m, b in zip(self.managers, hit)
        )

    def allocate(self, request_id: str, num_tokens: int, new_computed: GroupBlocks) -> None:
        """Every group's hit first, then fresh blocks (vLLM's order): a hit block can sit in the free queue, and
        a group allocating before a later group touched its hit would pop that block, drop its hash and write
        its own K/V there, while the later group still reads it as its hit."""
        for m, blocks in zip(self.managers, self._padded(new_computed)):
            m.save_new_computed_blocks(request_id, blocks)
        for m in self.managers:
            m.allocate_new_blocks(request_id, num_tokens)

    def cache_blocks(
        self, request_id: str, hashes: Sequence[BlockHash], num_full: int
    ) -> list[tuple[int, int, list[int]]]:
        """Register each group's blocks up to `num_full`: (group, its count before, indices registered now)."""
        out = []
        for g, m in enumerate(self.managers):
            if num_full <= m.num_cached_block.get(request_id, 0):
                continue
            before, registered = m.cache_blocks(request_id, m.keys(request_id, hashes[:num_full]), num_full)
            if registered:
                out.append((g, before, registered))
        return out

    def trim(self, request_id: str, num_tokens: int) -> None:
        for m in self.managers:
            m.trim(request_id, num_tokens)

    def free(self, request_id: str) -> None:
        for m in reversed(self.managers):
            m.free(request_id)

    def commit_step(self) -> None:
        for m in self.managers:
            m.commit_step()

    def rollback_step(self) -> None:
        for m in self.managers:
            m.rollback_step()

    def reset_prefix_cache(self) -> None:
        for m in self.managers:
            m.reset_prefix_cache()

    def tables(self, request_id: str) -> GroupBlocks:
        return [m.req_to_blocks.get(request_id, []) for m in self.table_managers]
