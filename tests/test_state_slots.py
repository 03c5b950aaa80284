"""Recurrent-state slots and checkpoints in the KV manager (kv/state_slots.py), without a model: a request holds one
slot from its first allocation to its free; an allocation that fails (blocks or slots short) takes nothing; a
prefix hit ends at a state checkpoint and holds it until copied; checkpoints are evicted least recently used, never
while held; nothing leaks."""

from __future__ import annotations

from pagedllm.kv.hashing import hash_full_blocks
from pagedllm.kv.manager import PagedKVCacheManager, TokenRequest
from pagedllm.kv.state_slots import StateCheckpoints, StateSlotPool

BS = 4


def _manager(blocks: int = 8, slots: int = 2, checkpoints: bool = False) -> PagedKVCacheManager:
    kv = PagedKVCacheManager(blocks, BS)
    kv.attach_state_slots(StateSlotPool(slots), StateCheckpoints(slots, 2, BS) if checkpoints else None)
    return kv


def test_a_request_holds_one_slot_until_freed_and_a_failed_allocation_takes_none():
    kv = _manager(blocks=4, slots=2)
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


def test_a_hit_ends_at_a_checkpoint_and_holds_it_until_copied():
    kv = _manager(checkpoints=True)
    tokens = list(range(13))
    first = TokenRequest("a", tokens)
    assert kv.allocate_slots(first, 13)
    row = kv.recurrent.checkpoint_row(first, 8)  # the state after two blocks
    assert row == 2  # the first checkpoint row, after the two running slots
    assert kv.recurrent.checkpoint_row(first, 6) is None  # not a block boundary
    kv.commit_step()
    kv.free(first)
    again = TokenRequest("b", tokens)
    blocks, n = kv.get_computed_blocks(again)
    assert n == 8  # three blocks are cached, the state only after two
    assert kv.allocate_slots(again, 5, blocks)
    ck = kv.recurrent.checkpoints
    assert ck is not None and ck.refs and kv.recurrent.take_restore("b") == row and not ck.refs
    assert kv.recurrent.take_restore("b") is None
    kv.free(again)
    assert not ck.restores and not ck.wanted and kv.recurrent.slots is not None and kv.recurrent.slots.num_free == 2


def test_under_mode_all_too_a_hit_ends_at_the_last_checkpoint():
    """The recurrent-state group's hit is the longest prefix whose state is kept, in either mode: three blocks
    cached, a state only after the first, so the hit is one block (not three, with no state to start from)."""
    kv = PagedKVCacheManager(8, BS)
    kv.attach_state_slots(StateSlotPool(2), StateCheckpoints(2, 2, BS, mode="all"))
    first = TokenRequest("a", list(range(13)))
    assert kv.allocate_slots(first, 13) and kv.recurrent.checkpoint_row(first, 4) == 2
    kv.commit_step()
    kv.free(first)
    again = TokenRequest("b", list(range(13)))
    blocks, n = kv.get_computed_blocks(again)
    assert n == 4 and [len(g) for g in blocks.groups] == [1, 1]
    assert kv.allocate_slots(again, 9, blocks) and kv.recurrent.take_restore("b") == 2
    kv.free(again)
    assert kv.num_free_blocks == 8 and not kv.recurrent.checkpoints.refs and not kv.recurrent.checkpoints.wanted


def test_checkpoints_evict_least_recently_used_never_a_held_one():
    ck = StateCheckpoints(first_row=4, num_rows=2, block_size=BS)
    k1, k2, k3 = hash_full_blocks(list(range(12)), BS, None, [])
    assert ck.store(k1) == 4 and ck.store(k2) == 5
    ck.hold("r", k1)  # held, and now the most recently used
    assert ck.store(k3) == 5 and ck.find(k2) is None  # k2 evicted, not the held k1
    ck.hold("s", k3)
    assert ck.store(k2) is None  # every row held
    ck.forget("r")
    assert ck.store(k2) == 4 and ck.find(k1) is None and ck.find(k3) == 5
