"""The KV-cache core: block pool, prefix caching by chained hashes, paged vs contiguous managers."""

from __future__ import annotations

import pytest

from pagedllm.kv.block_pool import BlockPool
from pagedllm.kv.hashing import hash_block_tokens, hash_full_blocks
from pagedllm.kv.manager import ContiguousKVCacheManager, PagedKVCacheManager
from pagedllm.kv.manager import TokenRequest as Req
from pagedllm.kv.sizing import kv_bytes_per_token, parse_memory_size, requests_that_fit


def admit(mgr, req: Req) -> int:
    """What the scheduler does for a new request: look up its prefix, allocate the rest, mark it computed."""
    blocks, cached = mgr.get_computed_blocks(req)
    assert mgr.allocate_slots(req, len(req.all_token_ids) - cached, blocks)
    mgr.record_prefix_lookup(len(req.all_token_ids), cached)
    req.num_computed_tokens = len(req.all_token_ids)
    return cached


def test_second_request_with_same_100_token_prompt_reuses_six_blocks():
    mgr = PagedKVCacheManager(num_blocks=64, block_size=16)
    prompt = list(range(1000, 1100))
    a, b = Req("a", list(prompt)), Req("b", list(prompt))
    assert admit(mgr, a) == 0
    blocks_b, cached = mgr.get_computed_blocks(b)
    assert cached == 96 and len(blocks_b) == 6
    assert [blk.block_id for blk in blocks_b] == mgr.get_block_ids("a")[:6]
    assert mgr.allocate_slots(b, 100 - cached, blocks_b)
    mgr.record_prefix_lookup(100, cached)
    # b computes only the last 4 tokens, in one fresh block of its own; the 6 shared blocks are held twice.
    assert mgr.get_block_ids("b")[:6] == mgr.get_block_ids("a")[:6]
    assert mgr.get_block_ids("b")[6] != mgr.get_block_ids("a")[6]
    assert mgr.num_used_blocks == 7 + 1
    assert mgr.num_stored_tokens == 100 + 4  # the 96 shared tokens count once
    assert mgr.prefix_stats.queries == 200 and mgr.prefix_stats.hits == 96


def test_32_token_prompt_reuses_one_block_not_two():
    mgr = PagedKVCacheManager(num_blocks=16, block_size=16)
    admit(mgr, Req("a", list(range(32))))
    blocks, cached = mgr.get_computed_blocks(Req("b", list(range(32))))
    assert (len(blocks), cached) == (1, 16)  # the last token must be computed to give logits


def test_freed_prefix_is_reused_after_its_owner_finished():
    mgr = PagedKVCacheManager(num_blocks=16, block_size=16)
    a = Req("a", list(range(50)))
    admit(mgr, a)
    ids = mgr.get_block_ids("a")
    mgr.free(a)
    assert mgr.num_free_blocks == 16
    b = Req("b", list(range(50)) + [7, 7])
    assert admit(mgr, b) == 48
    assert mgr.get_block_ids("b")[:3] == ids[:3]


def test_different_history_or_salt_does_not_share():
    mgr = PagedKVCacheManager(num_blocks=16, block_size=4)
    admit(mgr, Req("a", [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    # Same second block, different first block: the chained hash differs, nothing is shared.
    assert mgr.get_computed_blocks(Req("b", [9, 9, 9, 9, 5, 6, 7, 8, 9]))[1] == 0
    assert mgr.get_computed_blocks(Req("c", [1, 2, 3, 4, 5, 6, 7, 8, 9], cache_salt="x"))[1] == 0
    assert mgr.get_computed_blocks(Req("d", [1, 2, 3, 4, 5, 6, 7, 8, 9]))[1] == 8


def test_chained_hash_covers_parent_tokens_and_extra_key():
    h1 = hash_block_tokens(None, [1, 2])
    assert hash_block_tokens(h1, [3, 4]) != hash_block_tokens(None, [3, 4])
    assert hash_block_tokens(None, [1, 2], "salt") != h1
    assert hash_full_blocks([1, 2, 3, 4, 5], 2) == [h1, hash_block_tokens(h1, [3, 4])]


def test_eviction_takes_least_recently_freed_block_first():
    pool = BlockPool(4)
    a, b, c, d = pool.allocate(4)
    for blk, h in zip((a, b, c, d), (b"a", b"b", b"c", b"d")):
        pool.cache_block(blk, h)
    pool.free([c])
    pool.free([a])
    pool.free([d, b])
    assert [blk.block_id for blk in pool.free_queue] == [c.block_id, a.block_id, d.block_id, b.block_id]
    first = pool.allocate(1)[0]
    assert first is c and c.block_hash is None and pool.get_cached_block(b"c") is None
    assert pool.get_cached_block(b"a") is a  # not yet evicted: still reusable


def test_free_puts_the_tail_of_the_chain_first_in_eviction_order():
    mgr = PagedKVCacheManager(num_blocks=8, block_size=4)
    req = Req("a", list(range(12)))
    admit(mgr, req)
    ids = mgr.get_block_ids("a")
    mgr.free(req)
    assert [b.block_id for b in mgr.pool.free_queue][-3:] == ids[::-1]


def test_growth_by_one_block_only_when_last_block_is_full():
    mgr = PagedKVCacheManager(num_blocks=8, block_size=4)
    req = Req("a", [1, 2, 3])
    admit(mgr, req)
    assert len(mgr.get_block_ids("a")) == 1
    for tok, expect_blocks in [(4, 1), (5, 2), (6, 2), (7, 2), (8, 2), (9, 3)]:
        req.all_token_ids.append(tok)
        assert mgr.allocate_slots(req, 1)
        req.num_computed_tokens += 1
        assert len(mgr.get_block_ids("a")) == expect_blocks


def test_allocate_slots_is_all_or_nothing():
    mgr = PagedKVCacheManager(num_blocks=4, block_size=4)
    admit(mgr, Req("a", list(range(10))))  # 3 blocks
    b = Req("b", list(range(100, 110)))
    before = (mgr.num_free_blocks, dict(mgr.req_blocks))
    assert not mgr.allocate_slots(b, 10)
    assert (mgr.num_free_blocks, dict(mgr.req_blocks)) == before and "b" not in mgr.req_blocks


def test_cached_blocks_in_free_queue_count_against_free_space():
    mgr = PagedKVCacheManager(num_blocks=3, block_size=4)
    a = Req("a", list(range(9)))
    admit(mgr, a)
    mgr.free(a)  # 3 free blocks, 2 of them caching a's prefix
    b = Req("b", list(range(9)) + list(range(100, 108)))  # 17 tokens: 5 blocks, 2 cached -> 3 more needed
    blocks, cached = mgr.get_computed_blocks(b)
    assert cached == 8
    assert not mgr.allocate_slots(b, 9, blocks)  # 2 touched + 3 new > 3 free
    assert mgr.num_free_blocks == 3 and all(blk.ref_cnt == 0 for blk in blocks)


def test_reset_prefix_cache_forgets_prefixes():
    mgr = PagedKVCacheManager(num_blocks=8, block_size=4)
    a = Req("a", list(range(9)))
    admit(mgr, a)
    mgr.free(a)
    mgr.reset_prefix_cache()
    assert mgr.get_computed_blocks(Req("b", list(range(9))))[1] == 0


def test_prefix_caching_off_shares_nothing():
    mgr = PagedKVCacheManager(num_blocks=8, block_size=4, enable_caching=False)
    admit(mgr, Req("a", list(range(9))))
    assert mgr.get_computed_blocks(Req("b", list(range(9))))[1] == 0


def test_contiguous_reserves_max_len_and_admits_fewer_of_the_example_requests():
    used = [180, 650, 90, 1200, 300, 75, 420, 260]
    budget_blocks, bs, max_len = 1024, 16, 4096  # 16,384 token slots
    paged, contiguous = PagedKVCacheManager(budget_blocks, bs), ContiguousKVCacheManager(budget_blocks, bs, max_len)

    def admitted(mgr) -> int:
        n = 0
        for i in range(64):
            req = Req(f"r{i}", [i] * used[i % len(used)])
            if not mgr.allocate_slots(req, len(req.all_token_ids)):
                break
            n += 1
        return n

    n_paged, n_contig = admitted(paged), admitted(contiguous)
    assert n_contig == 4  # 16,384 / 4,096
    assert n_paged > 4 * n_contig
    assert contiguous.num_used_blocks == 4 * 256
    assert n_paged == requests_that_fit([used[i % 8] for i in range(64)], budget_blocks, bs, "paged", max_len)
    assert n_contig == requests_that_fit(used * 8, budget_blocks, bs, "contiguous", max_len)


def test_contiguous_grows_inside_its_reservation_and_not_past_it():
    mgr = ContiguousKVCacheManager(num_blocks=8, block_size=4, max_model_len=8)
    req = Req("a", [1] * 7)
    admit(mgr, req)
    assert len(mgr.get_block_ids("a")) == 2
    assert mgr.allocate_slots(req, 1)
    req.num_computed_tokens = 8
    assert not mgr.allocate_slots(req, 1)
    with pytest.raises(ValueError, match="reserves"):
        ContiguousKVCacheManager(num_blocks=1, block_size=4, max_model_len=8)


def test_sizing():
    # SmolLM2-135M: 30 layers, 3 KV heads of 64 dims, bf16 -> 23,040 bytes per token.
    assert kv_bytes_per_token(30, 3, 64, 2) == 23040
    assert parse_memory_size("4GiB") == 4 * 2**30
    assert parse_memory_size("1.5 GB") == 1_500_000_000
    assert parse_memory_size("1000") == 1000
    for bad in ("", "abc", "4Gx", "-1GiB", "0"):
        with pytest.raises(ValueError):
            parse_memory_size(bad)
