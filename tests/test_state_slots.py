"""Recurrent-state slots and checkpoints in the KV manager (kv/state_slots.py, kv/recurrent_state_manager.py),
without a model: a request holds one slot from its first allocation to its free; an allocation that fails (blocks
or slots short) takes nothing; a prefix hit ends at a state checkpoint, whose blocks of the pool it holds until
copied; checkpoints are evicted with the KV blocks by the pool's LRU, never while held; nothing leaks."""

from __future__ import annotations

from pagedllm.kv.hashing import hash_full_blocks
from pagedllm.kv.manager import ContiguousKVCacheManager, PagedKVCacheManager, TokenRequest
from pagedllm.kv.state_slots import StateCheckpoints, StateSlotPool

BS = 4


class StateIO:
    """A runner's state rows and block memory, in dicts: a state of 2 blocks' bytes (3 values in 2 blocks)."""

    def __init__(self) -> None:
        self.rows: dict[int, tuple[int, ...]] = {}
        self.blocks: dict[int, tuple[int, ...]] = {}

    def state_to_blocks(self, row: int, block_ids) -> None:
        state = self.rows[row]
        self.blocks.update({b: state[2 * i : 2 * i + 2] for i, b in enumerate(block_ids)})

    def blocks_to_state(self, block_ids, row: int) -> None:
        self.rows[row] = sum((self.blocks[b] for b in block_ids), ())


def _manager(blocks: int = 8, slots: int = 2, checkpoints: bool = False, mode: str = "align"):
    kv = PagedKVCacheManager(blocks, BS)
    io = StateIO()
    ck = StateCheckpoints(kv.pool, io, 2, BS, mode, staging=range(slots, slots + 2)) if checkpoints else None
    kv.attach_state_slots(StateSlotPool(slots), ck)
    return kv, io


def test_a_request_holds_one_slot_until_freed_and_a_failed_allocation_takes_none():
    kv, _ = _manager(blocks=4, slots=2)
    a, b, c = (TokenRequest(r, list(range(8))) for r in "abc")
    assert kv.allocate_slots(a, 8) and kv.recurrent.slot("a") is not None
    assert kv.allocate_slots(a, 1) and kv.recurrent.slots is not None and kv.recurrent.slots.num_free == 1  # still one
    assert not kv.allocate_slots(b, 12)  # 3 blocks: only 2 free
    assert kv.recurrent.slot("b") is None and kv.recurrent.slots.num_free == 1
    assert kv.allocate_slots(b, 4)
    assert not kv.allocate_slots(c, 1)  # blocks remain, slots do not: nothing taken
    assert kv.recurrent.slot("c") is None and kv.num_free_blocks == 1
    for r in (a, b):
        kv.free(r)
    assert kv.recurrent.slots.num_free == 2 and not kv.recurrent.slots.req_to_slot and kv.num_free_blocks == 4


def test_the_contiguous_baseline_reserves_blocks_and_a_slot_through_the_same_groups():
    """Without paging (one reservation of max_model_len per request) the state slot is still a group of the
    coordinator: an allocation short of blocks or of slots takes neither, a free returns both."""
    kv = ContiguousKVCacheManager(6, BS, max_model_len=8)  # 2 blocks reserved per request: 3 fit
    kv.attach_state_slots(StateSlotPool(2))
    a, b, c = (TokenRequest(r, list(range(8))) for r in "abc")
    assert kv.allocate_slots(a, 3) and kv.num_free_blocks == 4 and kv.recurrent.slot("a") is not None
    assert kv.allocate_slots(a, 5) and kv.num_free_blocks == 4  # grows inside its reservation
    assert not kv.allocate_slots(b, 9)  # past max_model_len: nothing taken
    assert kv.recurrent.slot("b") is None and kv.num_free_blocks == 4
    assert kv.allocate_slots(b, 2)
    assert not kv.allocate_slots(c, 1)  # blocks for one more remain, slots do not: nothing taken
    assert kv.recurrent.slot("c") is None and kv.num_free_blocks == 2 and "c" not in kv.req_blocks
    kv.free(a)
    assert kv.allocate_slots(c, 1) and kv.recurrent.slot("c") is not None
    for r in (b, c):
        kv.free(r)
    assert kv.recurrent.slots.num_free == 2 and not kv.recurrent.slots.req_to_slot and kv.num_free_blocks == 6


def test_a_hit_ends_at_a_checkpoint_and_holds_its_blocks_until_copied():
    kv, io = _manager(blocks=12, checkpoints=True)
    tokens = list(range(13))
    first = TokenRequest("a", tokens)
    assert kv.allocate_slots(first, 13)
    io.rows[kv.recurrent.slot("a")] = (1, 2, 3)
    assert kv.recurrent.checkpoint(first, 8)  # the state after two blocks, in 2 blocks of the pool
    assert not kv.recurrent.checkpoint(first, 6)  # not a block boundary
    assert not kv.recurrent.checkpoint(first, 8)  # cached already
    assert kv.num_free_blocks == 12 - 4  # the checkpoint's blocks are free (evictable), the request's 4 are not
    kv.commit_step()
    kv.free(first)
    again = TokenRequest("b", tokens)
    blocks, n = kv.get_computed_blocks(again)
    assert n == 8  # three blocks are cached, the state only after two
    assert kv.allocate_slots(again, 5, blocks)
    ck = kv.recurrent.checkpoints
    assert ck.holds and kv.num_free_blocks == 12 - 4 - 2  # its two KV blocks, one new, the checkpoint's two
    slot = kv.recurrent.slot("b")
    assert kv.recurrent.restore("b") and io.rows[slot] == (1, 2, 3) and not ck.holds
    assert not kv.recurrent.restore("b")
    kv.free(again)
    assert not ck.holds and not ck.wanted and kv.recurrent.slots.num_free == 2 and kv.num_free_blocks == 12


def test_under_mode_all_too_a_hit_ends_at_the_last_checkpoint():
    """The recurrent-state group's hit is the longest prefix whose state is kept, in either mode: three blocks
    cached, a state only after the first, so the hit is one block (not three, with no state to start from)."""
    kv, io = _manager(blocks=12, checkpoints=True, mode="all")
    first = TokenRequest("a", list(range(13)))
    assert kv.allocate_slots(first, 13)
    io.rows[kv.recurrent.slot("a")] = (7,)
    assert kv.recurrent.checkpoint(first, 4)
    kv.commit_step()
    kv.free(first)
    again = TokenRequest("b", list(range(13)))
    blocks, n = kv.get_computed_blocks(again)
    assert n == 4 and [len(g) for g in blocks.groups] == [1, 1]
    assert kv.allocate_slots(again, 9, blocks) and kv.recurrent.restore("b")
    assert io.rows[kv.recurrent.slot("b")] == (7,)
    kv.free(again)
    assert kv.num_free_blocks == 12 and not kv.recurrent.checkpoints.holds


def test_marks_are_stored_when_the_step_commits_and_dropped_when_it_fails():
    kv, io = _manager(blocks=12, checkpoints=True, mode="all")
    req = TokenRequest("a", list(range(13)))
    assert kv.allocate_slots(req, 13)
    marks = kv.recurrent.marks(req, 0, 12)  # boundaries 4, 8, 12: two staging rows only
    assert marks == [(4, 2), (8, 3)]
    kv.rollback_step()
    ck, keys = kv.recurrent.checkpoints, hash_full_blocks(list(range(12)), BS)
    assert not ck.find(keys[0]) and not ck.unwritten
    assert kv.recurrent.marks(req, 0, 12) == [(4, 2), (8, 3)]
    io.rows[2], io.rows[3] = (4,), (8,)
    kv.commit_step()
    assert ck.find(keys[0]) and ck.find(keys[1]) and not ck.find(keys[2]) and ck.counts() == (2, 4)
    assert kv.recurrent.marks(req, 0, 8) == []  # cached already
    kv.free(req)


def test_checkpoints_are_evicted_with_the_kv_blocks_least_recently_used_never_a_held_one():
    kv, io = _manager(blocks=8, slots=1, checkpoints=True)
    ck = kv.recurrent.checkpoints
    k1, k2, k3 = hash_full_blocks(list(range(12)), BS)
    io.rows[0] = (1,)
    assert ck.store(k1, 0) and ck.store(k2, 0)
    ck.hold("r", k1)  # held: out of the free queue
    k4, k5 = hash_full_blocks(list(range(100, 108)), BS)
    assert ck.store(k3, 0) and ck.store(k4, 0)  # the 8 blocks
    assert ck.store(k5, 0)  # evicts k2's, the least recently used unheld ones
    assert ck.find(k1) and not ck.find(k2) and ck.find(k3) and ck.counts() == (4, 8)
    assert kv.allocate_slots(TokenRequest("x", list(range(200, 220))), 20)  # 5 KV blocks: k3's, k4's and one more
    assert ck.find(k1) and not ck.find(k3) and not ck.find(k4) and not ck.find(k5) and ck.counts() == (1, 2)
    ck.forget("r")
    assert kv.num_free_blocks == 3


def test_a_lookup_waits_for_a_checkpoint_a_chunk_scheduled_in_the_same_step_leaves():
    """A chunk allocated in this step fills the prefix's blocks (registered at once, as an attention hit needs)
    but its states at them exist only once the step commits: a request looked up meanwhile, whose run of cached
    blocks passes such a boundary, waits (mode all: every boundary the chunk fills; align: its end); after the
    commit it hits there. A boundary no chunk of this step fills makes none wait; a free forgets it all."""
    for mode, hit in (("all", 8), ("align", 8)):
        kv, io = _manager(blocks=16, slots=2, checkpoints=True, mode=mode)
        rs, tokens = kv.recurrent, list(range(9))
        first, second = TokenRequest("a", tokens), TokenRequest("b", tokens + [50, 51, 52])
        assert kv.allocate_slots(first, 8)  # its chunk: two blocks, to the boundary at 8
        assert kv.get_computed_blocks(second)[1] == 0 and rs.waits("b")
        io.rows[rs.slot("a")] = (5,)
        for m in rs.marks(first, 0, 7):  # the runner writes the marks inside the chunk (all), then its end
            io.rows[m[1]] = (4,)
        kv.commit_step()
        first.num_computed_tokens = 8
        assert rs.checkpoint(first, 8)
        blocks, n = kv.get_computed_blocks(second)
        assert n == hit and not rs.waits("b")
        kv.free(first)
        kv.free(second)
        assert not rs._pending and not rs._waits and kv.num_free_blocks == 16
    kv, _ = _manager(blocks=16, checkpoints=True, mode="all")
    assert kv.allocate_slots(TokenRequest("a", list(range(9))), 4)  # one block: nothing past it is pending
    other = TokenRequest("c", list(range(9)) + [60])
    assert kv.get_computed_blocks(other)[1] == 0 and kv.recurrent.waits("c")  # the boundary at 4
    kv.free(TokenRequest("a", []))
    assert kv.get_computed_blocks(other)[1] == 0 and not kv.recurrent.waits("c")  # freed: pending no more


def test_the_block_map_shows_checkpoint_blocks_as_their_own_kind():
    """A checkpoint's blocks in the /kv page's map and counters: free ones evictable (not used, no token slots),
    a hit's held ones used but with no token slots; plain cached KV blocks stay `cached`."""
    from types import SimpleNamespace

    from pagedllm.engine.block_map import block_map
    from pagedllm.engine.kv_snapshot import take_snapshot

    kv, io = _manager(blocks=12, checkpoints=True)
    first = TokenRequest("a", list(range(13)))
    assert kv.allocate_slots(first, 13)
    io.rows[kv.recurrent.slot("a")] = (1, 2, 3)
    assert kv.recurrent.checkpoint(first, 8)
    kv.commit_step()
    kv.free(first)
    engine = SimpleNamespace(
        kv=kv,
        scheduler=SimpleNamespace(running=[], waiting=[], num_preemptions=0),
        config=SimpleNamespace(kv_allocation="paged"),
        kv_dtype="float32",
        num_steps=0,
        prompt_tokens=0,
        generation_tokens=0,
    )
    ck = kv.recurrent.checkpoints
    ids = [b.block_id for b in ck.blocks(hash_full_blocks(list(range(8)), BS)[1])]
    m = block_map(take_snapshot(engine))
    states = [m.map.states[s] for s in m.map.state]
    assert sorted(i for i, s in enumerate(states) if s == "checkpoint") == sorted(ids)
    assert states.count("cached") == 3 and m.counters.num_checkpoint_blocks == 2  # the request's 3 full blocks
    assert (m.counters.num_free_blocks, m.counters.num_evictable_blocks, m.counters.num_used_blocks) == (12, 5, 0)
    ck.hold("h", hash_full_blocks(list(range(8)), BS)[1])  # a hit holds it until its copy
    m = block_map(take_snapshot(engine))
    assert m.counters.num_checkpoint_blocks == 2 and m.counters.num_used_blocks == 2
    assert m.counters.num_evictable_blocks == 3 and m.counters.slots_allocated == 0
    ck.forget("h")
    assert kv.num_free_blocks == 12
