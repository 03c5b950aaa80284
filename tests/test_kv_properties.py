"""Random interleavings of admit / grow / speculate / free / prefix lookup / eviction keep the block accounting
whole, and the prefix cache never holds a block under a hash of tokens its holder does not have (a draft's)."""

from __future__ import annotations

from collections import Counter

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagedllm.kv.events import AllBlocksCleared, BlockStored, KVEventLog, decode_batch, encode_batch
from pagedllm.kv.hashing import hash_block_tokens, hash_full_blocks
from pagedllm.kv.manager import ContiguousKVCacheManager, PagedKVCacheManager, cdiv
from pagedllm.kv.manager import TokenRequest as Req

BLOCK = 4
NUM_BLOCKS = 24

# Prompts are drawn from a few shared stems so that prefixes collide often.
STEMS = [[1] * 12, [1] * 8 + [2] * 4, [3, 4, 5, 6] * 3]


class KVMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.mgr = PagedKVCacheManager(NUM_BLOCKS, BLOCK, enable_caching=True)
        self.running: dict[str, Req] = {}
        self.counter = 0
        self.mgr.pool.events = KVEventLog(BLOCK)
        self.events_seen = 0
        self.replayed: set[bytes] = set()  # the prefix cache as a KV-event consumer rebuilds it

    @rule(stem=st.sampled_from(STEMS), tail=st.lists(st.integers(0, 3), max_size=9), chunk=st.integers(1, 24))
    def admit(self, stem, tail, chunk):
        req = Req(f"r{self.counter}", stem + tail)
        self.counter += 1
        blocks, cached = self.mgr.get_computed_blocks(req)
        assert cached % BLOCK == 0 and cached < len(req.all_token_ids)
        num_new = min(chunk, len(req.all_token_ids) - cached)  # a chunk of the rest, as chunked prefill does
        free_before = self.mgr.num_free_blocks
        if self.mgr.allocate_slots(req, num_new, blocks):
            req.num_computed_tokens = cached + num_new
            self.running[req.request_id] = req
        else:
            assert self.mgr.num_free_blocks == free_before and req.request_id not in self.mgr.req_blocks

    @precondition(lambda self: self.running)
    @rule(data=st.data(), n=st.integers(1, 6))
    def grow(self, data, n):
        req = self.running[data.draw(st.sampled_from(sorted(self.running)))]
        todo = len(req.all_token_ids) - req.num_computed_tokens
        if todo == 0:  # decode: one new token to compute
            req.all_token_ids.append(data.draw(st.integers(0, 3)))
            n, todo = 1, 1
        n = min(n, todo)
        if self.mgr.allocate_slots(req, n):
            req.num_computed_tokens += n
        else:  # out of blocks: preempt it, as the scheduler would
            self.mgr.free(req)
            del self.running[req.request_id]

    @precondition(lambda self: self.running)
    @rule(data=st.data(), drafts=st.lists(st.integers(0, 3), min_size=1, max_size=6), outcome=st.integers(-1, 6))
    def speculate(self, data, drafts, outcome):
        """A decode step with drafts in lookahead slots; outcome -1: the request is aborted (or preempted)
        before verification; else that many drafts accepted (capped), the rest's slots given back."""
        req = self.running[data.draw(st.sampled_from(sorted(self.running)))]
        if len(req.all_token_ids) > req.num_computed_tokens:
            return  # mid-prefill: no drafts
        req.all_token_ids.append(data.draw(st.integers(0, 3)))  # the token sampled last step
        if not self.mgr.allocate_slots(req, 1, num_lookahead_tokens=len(drafts)):
            return self._drop(req)
        if outcome < 0:
            return self._drop(req)
        accepted = drafts[:outcome]
        req.all_token_ids.extend(accepted)
        req.num_computed_tokens += 1 + len(accepted)
        self.mgr.trim(req, req.num_computed_tokens)
        self.mgr.cache_computed(req, req.num_computed_tokens)
        self.mgr.commit_step()
        req.all_token_ids.append(data.draw(st.integers(0, 3)))  # the model's token after the accepted drafts

    def _drop(self, req):
        self.mgr.free(req)
        del self.running[req.request_id]

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def free(self, data):
        req = self.running.pop(data.draw(st.sampled_from(sorted(self.running))))
        self.mgr.free(req)

    def _block_tokens(self, req: Req, i: int) -> tuple[int, ...]:
        return tuple(req.all_token_ids[i * BLOCK : (i + 1) * BLOCK])

    @rule(stem=st.sampled_from(STEMS), tail=st.lists(st.integers(0, 3), max_size=9))
    def lookup(self, stem, tail):
        """A new request's lookup finds only blocks that hold its own tokens, and at least every full block a
        running request registered with the same leading tokens. A fresh id per probe: the manager memoizes
        hashes per request id, so a reused id would be answered for another prompt."""
        probe = Req(f"probe{self.counter}", stem + tail)
        self.counter += 1
        hits, cached = self.mgr.get_computed_blocks(probe)
        assert cached == len(hits) * BLOCK < len(probe.all_token_ids)
        contents = {
            b.block_id: self._block_tokens(r, i)
            for r in self.running.values()
            for i, b in enumerate(self.mgr.req_blocks.get(r.request_id, []))
            if (i + 1) * BLOCK <= r.num_computed_tokens
        }
        for i, block in enumerate(hits):
            if block.block_id in contents:  # (a free cached block's tokens are checked when it is shared again)
                assert contents[block.block_id] == self._block_tokens(probe, i)
        usable = (len(probe.all_token_ids) - 1) // BLOCK
        for r in self.running.values():
            blocks = self.mgr.req_blocks.get(r.request_id, [])
            k = 0
            while (
                k < min(usable, len(blocks))
                and (k + 1) * BLOCK <= r.num_computed_tokens
                and blocks[k].block_hash is not None
                and self._block_tokens(r, k) == self._block_tokens(probe, k)
            ):
                k += 1
            assert len(hits) >= k, (r.request_id, k, len(hits))

    @invariant()
    def accounting_is_whole(self):
        holders = Counter()
        for rid, blocks in self.mgr.req_blocks.items():
            assert rid in self.running
            assert len(set(id(b) for b in blocks)) == len(blocks)
            holders.update(b.block_id for b in blocks)
        free_ids = {b.block_id for b in self.mgr.pool.free_queue}
        assert len(free_ids) == self.mgr.num_free_blocks
        for block in self.mgr.pool.blocks:
            assert block.ref_cnt == holders[block.block_id]
            assert (block.block_id in free_ids) == (block.ref_cnt == 0)
            if block.ref_cnt > 1:
                assert block.block_hash is not None
                assert self.mgr.pool.cached[block.block_hash] is block
        assert len(free_ids) + len(holders) == NUM_BLOCKS
        # A shared block is a full prefix block: same position and same tokens in every holder. A registered
        # block's hash is that of its holder's tokens (never of drafts that were rejected).
        shared: dict[int, tuple[int, tuple[int, ...]]] = {}
        for rid, blocks in self.mgr.req_blocks.items():
            req = self.running[rid]
            assert len(blocks) * BLOCK >= req.num_computed_tokens
            assert self.mgr.req_tokens[rid] == req.num_computed_tokens  # no slot kept for a rejected draft
            if isinstance(self.mgr, PagedKVCacheManager):
                assert len(blocks) == cdiv(req.num_computed_tokens, BLOCK)
            hashes = hash_full_blocks(req.all_token_ids[: req.num_computed_tokens], BLOCK)
            for i, b in enumerate(blocks):
                if b.ref_cnt > 1:
                    assert (i + 1) * BLOCK <= req.num_computed_tokens
                    seen = shared.setdefault(b.block_id, (i, self._block_tokens(req, i)))
                    assert seen == (i, self._block_tokens(req, i)), (b.block_id, seen, rid)
                if b.block_hash is not None:
                    assert b.block_hash == hashes[i]

    @invariant()
    def events_rebuild_the_prefix_cache(self):
        """A router replaying the published events (through vLLM's wire format) knows exactly which prefixes the
        cache holds, and every stored block's hash is its tokens chained on its parent."""
        self.events_seen, events, lost = self.mgr.pool.events.since(self.events_seen)
        assert not lost
        for event in decode_batch(encode_batch(events))[1]:
            if isinstance(event, BlockStored):
                parent = event.parent_block_hash
                for i, h in enumerate(event.block_hashes):
                    assert hash_block_tokens(parent, event.token_ids[i * BLOCK : (i + 1) * BLOCK]) == h
                    parent = h
                self.replayed.update(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                self.replayed.clear()
            else:
                self.replayed.difference_update(event.block_hashes)
        assert self.replayed == set(self.mgr.pool.cached)

    def teardown(self):
        for req in list(self.running.values()):
            self.mgr.free(req)
        assert self.mgr.num_free_blocks == NUM_BLOCKS
        assert all(b.ref_cnt == 0 for b in self.mgr.pool.blocks)


class ContiguousMachine(KVMachine):
    def __init__(self) -> None:
        super().__init__()
        self.mgr = ContiguousKVCacheManager(NUM_BLOCKS, BLOCK, max_model_len=24)
        self.mgr.pool.events = KVEventLog(BLOCK)  # it caches nothing, so it publishes nothing


TestPagedKV = KVMachine.TestCase
TestPagedKV.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestContiguousKV = ContiguousMachine.TestCase
TestContiguousKV.settings = settings(max_examples=50, stateful_step_count=40, deadline=None)
