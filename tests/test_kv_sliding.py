"""The paged manager with a sliding window (vLLM's SlidingWindowManager): blocks out of the next token's window go
back to the pool (still cached), a prefix hit needs only the blocks inside the window, nothing leaks; and the
KV-cache groups / kv-calc arithmetic per layer group."""

from __future__ import annotations

import pytest

from pagedllm.kv.manager import PagedKVCacheManager
from pagedllm.kv.manager import TokenRequest as Req
from pagedllm.kv.sizing import freeing_window, kv_cache_groups, window_blocks

BS = 4


def run_request(mgr: PagedKVCacheManager, req: Req, chunk: int, decode: int = 0) -> list[int]:
    """Admit `req` (prefix lookup), compute its prompt in chunks of `chunk`, then `decode` tokens one by one, as
    the scheduler does; returns the blocks held after each step."""
    blocks, cached = mgr.get_computed_blocks(req)
    req.num_computed_tokens = 0
    first = min(chunk, len(req.all_token_ids) - cached)
    assert mgr.allocate_slots(req, first, blocks)
    req.num_computed_tokens = cached + first
    held = [mgr.num_used_blocks]
    while req.num_computed_tokens < len(req.all_token_ids):
        n = min(chunk, len(req.all_token_ids) - req.num_computed_tokens)
        assert mgr.allocate_slots(req, n)
        req.num_computed_tokens += n
        held.append(mgr.num_used_blocks)
    for t in range(decode):
        req.all_token_ids.append(7000 + t)
        assert mgr.allocate_slots(req, 1)
        req.num_computed_tokens += 1
        held.append(mgr.num_used_blocks)
    return held


def test_blocks_out_of_the_window_go_back_and_stay_cached():
    window = 10
    mgr = PagedKVCacheManager(64, BS, True, sliding_window=window)
    full = PagedKVCacheManager(64, BS, True)
    prompt = list(range(100, 160))
    held = run_request(mgr, Req("a", list(prompt)), chunk=8, decode=12)
    held_full = run_request(full, Req("a", list(prompt)), chunk=8, decode=12)
    assert held_full[-1] == -(-72 // BS)
    # the next token (position 72) sees 63..72: blocks 15..17 plus the one it is written to, at most
    assert max(held[2:]) <= -(-(window + 8) // BS) + 1 and held[-1] < held_full[-1] // 3
    skipped = (71 - window + 1) // BS  # out of the window of the last token computed (position 71)
    assert mgr.get_block_ids("a")[:skipped] == [0] * skipped  # the null block's id
    assert mgr.num_stored_tokens == 72 - BS * skipped
    assert mgr.num_cached_blocks == skipped  # what went back still caches its prefix: evictable, not lost


def test_hit_needs_only_the_blocks_inside_the_window():
    """A's early blocks were evicted (reused by B); A's last blocks are still cached: a request with A's prompt
    gets a hit from the window's blocks with null blocks before them, where full attention gets one block."""
    window = 9
    mgr = PagedKVCacheManager(14, BS, True, sliding_window=window)
    prompt = list(range(100, 140))  # 10 blocks
    run_request(mgr, Req("a", list(prompt)), chunk=8)
    mgr.free(Req("a", prompt))
    run_request(mgr, Req("b", list(range(500, 520))), chunk=20)  # 5 fresh blocks evict A's oldest cached ones
    again = Req("c", list(prompt) + [1, 2, 3])
    blocks, cached = mgr.get_computed_blocks(again)
    assert cached == 40 and len(blocks) == 10
    need = -(-(window - 1) // BS)
    assert all(b is mgr.null_block for b in blocks[: 10 - need]) and None not in blocks
    assert all(b is not mgr.null_block for b in blocks[10 - need :])
    assert mgr.allocate_slots(again, 3, blocks)
    again.num_computed_tokens = 43
    mgr.free(again)
    mgr.free(Req("b", []))
    assert mgr.num_free_blocks == mgr.num_blocks


def test_no_hit_when_the_window_is_not_covered():
    mgr = PagedKVCacheManager(64, BS, True, sliding_window=12)
    run_request(mgr, Req("a", list(range(100, 140))), chunk=40)
    other = Req("b", list(range(100, 104)) + list(range(900, 936)))  # shares the first block only
    blocks, cached = mgr.get_computed_blocks(other)
    assert cached == BS and len(blocks) == 1  # the leading run is a hit even if it is short (vLLM)


@pytest.mark.parametrize("window", [1, 5, 16, 64])
def test_preemption_and_abort_leak_nothing(window):
    mgr = PagedKVCacheManager(40, BS, True, sliding_window=window)
    reqs = [Req(str(i), list(range(i * 1000, i * 1000 + 30))) for i in range(3)]
    for r in reqs:
        run_request(mgr, r, chunk=7, decode=5)
    mgr.free(reqs[0])  # preempted: recomputed from its prefix
    run_request(mgr, Req("0", reqs[0].all_token_ids[:]), chunk=7, decode=3)
    for rid in ("0", "1", "2"):
        mgr.free(Req(rid, []))
    assert mgr.num_free_blocks == mgr.num_blocks and not mgr.req_blocks
    assert all(b.ref_cnt == 0 for b in mgr.pool.blocks)


def test_sliding_model_holds_fewer_blocks_than_full_of_the_same_shape():
    """The manager's rule, as the engine applies it to a model: every layer slides -> the pool frees."""
    groups = kv_cache_groups([32] * 4)
    assert freeing_window(groups) == 32
    mixed = kv_cache_groups([32, 32, None, 32, 32, None])
    assert [(g.window, g.layers) for g in mixed] == [(None, (2, 5)), (32, (0, 1, 3, 4))]
    assert freeing_window(mixed) is None
    assert window_blocks(1000, 32, 16) < window_blocks(1000, None, 16) // 10
    mgr = PagedKVCacheManager(200, 16, True, sliding_window=freeing_window(groups))
    full = PagedKVCacheManager(200, 16, True, sliding_window=freeing_window(mixed))
    a, b = Req("a", list(range(1000))), Req("a", list(range(1000)))
    assert run_request(mgr, a, chunk=64, decode=8)[-1] == window_blocks(1008, 32, 16)
    assert run_request(full, b, chunk=64, decode=8)[-1] == window_blocks(1008, None, 16)
