"""The cluster's routing policy and its pure parts, without Ray (fast): the prefix index against a brute-force
reference, the choice rules, KV events in vLLM's wire format, per-replica metrics and the cluster's flags."""

from __future__ import annotations

import random

import pytest

from pagedllm.cluster.routing import (
    PROMPT_KW,
    SALT_KW,
    PrefixIndex,
    apply_events,
    choose,
    key,
    prefix_keys,
    request_keys,
)
from pagedllm.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventLog, decode_batch, encode_batch
from pagedllm.kv.hashing import hash_full_blocks
from pagedllm.kv.manager import PagedKVCacheManager, TokenRequest

BS = 4


def test_prefix_keys_are_the_kv_cache_hashes_of_the_first_blocks():
    ids = list(range(100, 123))  # 23 tokens: 5 full blocks, but the last token is never a hit
    assert prefix_keys(ids, BS, 64) == [key(h) for h in hash_full_blocks(ids[:20], BS)]
    assert prefix_keys(ids[:20], BS, 64) == prefix_keys(ids, BS, 64)[:4]  # 20 tokens: the 5th block holds the last
    assert prefix_keys(ids, BS, 2) == prefix_keys(ids, BS, 64)[:2]
    assert prefix_keys([], BS, 64) == [] and prefix_keys([1, 2, 3, 4], BS, 64) == []
    # a different first block changes every key after it: keys name prefixes, not blocks
    other = [7] + ids[1:]
    assert all(a != b for a, b in zip(prefix_keys(other, BS, 64), prefix_keys(ids, BS, 64)))


def test_a_cache_salt_is_in_the_routing_key_as_in_the_engines_block_hashes():
    """Two tenants' same prompt are two prefixes to the router, as to the engine (issue 28: cache_salt): the keys
    of a request as the ingress sends it are those its replica's KV events publish for it, so a replica holding
    one tenant's blocks does not attract the other tenant's prompt, and a salted prompt follows its own blocks."""
    ids = list(range(100, 123))
    plain, a, b = (request_keys({PROMPT_KW: ids, SALT_KW: salt}, BS, 64) for salt in (None, "tenant-a", "tenant-b"))
    assert plain == prefix_keys(ids, BS, 64) and len(a) == len(b) == len(plain) == 5
    assert not set(a) & set(b) and not set(a) & set(plain)
    mgr = _engine_like_manager()
    assert mgr.allocate_slots(TokenRequest("r", ids, cache_salt="tenant-a"), len(ids))
    index = PrefixIndex()
    apply_events(index, "one", mgr.pool.events.since(0)[1])
    assert index.match(a, ["one", "two"]) == {"one": 5, "two": 0}
    assert index.match(b, ["one", "two"]) == index.match(plain, ["one", "two"]) == {"one": 0, "two": 0}
    choice = choose(index.match(b, ["one", "two"]), {"one": 0, "two": 0}, {"one": 5, "two": 0}, threshold=8)
    assert (choice.reason, choice.ranked[0]) == ("new", "two")  # tenant b's prompt: not to tenant a's blocks


def _reference_match(held: dict[str, set[int]], keys: list[int], candidates: list[str]) -> dict[str, int]:
    out = {}
    for c in candidates:
        n = 0
        while n < len(keys) and keys[n] in held.get(c, set()):
            n += 1
        out[c] = n
    return out


def test_match_agrees_with_a_brute_force_reference():
    rng = random.Random(0)
    index, held = PrefixIndex(), {}
    chains = [prefix_keys([rng.randrange(1000) for _ in range(41)], BS, 64) for _ in range(6)]
    replicas = [f"r{i}" for i in range(5)]
    for _ in range(400):
        r, chain = rng.choice(replicas), rng.choice(chains)
        part = chain[: rng.randrange(len(chain) + 1)]
        if rng.random() < 0.7:
            index.insert(r, part)
            held.setdefault(r, set()).update(part)
        elif rng.random() < 0.8:
            index.remove(r, part)
            held.get(r, set()).difference_update(part)
        else:
            index.clear(r)
            held.pop(r, None)
        probe, cands = rng.choice(chains), rng.sample(replicas + ["new"], 3)
        assert index.match(probe, cands) == _reference_match(held, probe, cands)


def test_a_replica_that_leaves_takes_its_blocks_and_its_slot_is_reused():
    index = PrefixIndex()
    keys = [1, 2, 3]
    index.insert("a", keys)
    index.insert("b", keys[:1])
    index.remove_replica("a")
    assert index.match(keys, ["a", "b"]) == {"a": 0, "b": 1}
    index.insert("c", keys)  # takes a's free bit: 64 replicas do not need 64 bits for ever
    assert index.match(keys, ["b", "c"]) == {"b": 1, "c": 3}
    assert len(set(index._slots.values())) == 2


def test_capacity_forgets_the_least_recently_routed_blocks():
    index = PrefixIndex(capacity=4)
    index.insert("a", [1, 2, 3])
    index.insert("a", [10, 11])  # 5 blocks > 4: block 1 goes first, so the chain 1-2-3 no longer matches
    assert index.num_blocks("a") == 4
    assert index.match([1, 2, 3], ["a"]) == {"a": 0}
    index.insert("a", [2])  # touching 2 keeps it; the oldest (3) goes
    index.insert("a", [12])
    assert index.match([10, 11, 12], ["a"]) == {"a": 3}


def test_choose_prefers_the_longest_prefix_then_the_least_loaded():
    c = choose({"a": 3, "b": 5, "c": 5}, {"a": 0, "b": 2, "c": 1}, {}, threshold=8)
    assert (c.ranked[0], c.reason, c.matched_blocks) == ("c", "prefix", 5)
    assert c.ranked == ["c", "b", "a"]


def test_choose_balances_when_the_best_is_overloaded():
    assert choose({"a": 5, "b": 0}, {"a": 9, "b": 0}, {}, threshold=8).ranked[0] == "b"
    assert choose({"a": 5, "b": 0}, {"a": 8, "b": 0}, {}, threshold=8).ranked[0] == "a"  # at the threshold: stay
    assert choose({"a": 5, "b": 0}, {"a": 9, "b": 0}, {}, threshold=8).reason == "balance"


def test_a_short_shared_prefix_does_not_pin_traffic_to_one_replica():
    """Every prompt shares a 1-block system prompt with replica a: under the minimum match it counts as new."""
    assert choose({"a": 1, "b": 0}, {"a": 2, "b": 0}, {}, threshold=8, min_match=2).ranked[0] == "b"
    assert choose({"a": 2, "b": 0}, {"a": 2, "b": 0}, {}, threshold=8, min_match=2).ranked[0] == "a"


def test_a_new_prefix_goes_to_the_least_loaded_then_the_emptiest_replica():
    c = choose({"a": 0, "b": 0, "c": 0}, {"a": 1, "b": 0, "c": 0}, {"a": 0, "b": 40, "c": 10}, threshold=8)
    assert (c.ranked, c.reason) == (["c", "b", "a"], "new")
    assert choose({}, {}, {}, 8).ranked == []


def test_prefix_groups_stick_to_one_replica_and_spread_across_replicas():
    """The policy loop the Ray router runs, on a prefix-repetition workload: every request of a group goes to the
    replica that took its first request, and the groups are shared out evenly."""
    rng = random.Random(1)
    index, load = PrefixIndex(), {"r0": 0, "r1": 0}
    groups = [[rng.randrange(1000) for _ in range(32)] for _ in range(6)]
    where: dict[int, set[str]] = {}
    for _ in range(60):
        g = rng.randrange(len(groups))
        keys = prefix_keys(groups[g] + [rng.randrange(1000) for _ in range(9)], BS, 64)
        cached = {r: index.num_blocks(r) for r in load}
        chosen = choose(index.match(keys, list(load)), load, cached, threshold=8).ranked[0]
        index.insert(chosen, keys)
        where.setdefault(g, set()).add(chosen)
    assert all(len(r) == 1 for r in where.values())
    counts = [sum(1 for r in where.values() if r == {x}) for x in load]
    assert counts == [3, 3]


def _engine_like_manager() -> PagedKVCacheManager:
    mgr = PagedKVCacheManager(num_blocks=6, block_size=BS)
    mgr.pool.events = KVEventLog(BS, "CPU")
    return mgr


def test_events_follow_the_prefix_cache_through_reuse_rollback_and_reset():
    mgr = _engine_like_manager()
    a = TokenRequest("a", list(range(13)))  # 3 full blocks
    assert mgr.allocate_slots(a, 13)
    last, events, lost = mgr.pool.events.since(0)
    assert not lost and len(events) == 1 and isinstance(events[0], BlockStored)
    assert events[0].block_hashes == hash_full_blocks(a.all_token_ids[:12], BS)
    assert events[0].parent_block_hash is None and events[0].token_ids == list(range(12))
    mgr.commit_step()
    mgr.free(a)
    b = TokenRequest("b", list(range(50, 71)))  # 6 blocks: two free ones, then a's three cached ones are evicted
    assert mgr.allocate_slots(b, 21)
    _, events, _ = mgr.pool.events.since(last)
    removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert sorted(removed) == sorted(hash_full_blocks(a.all_token_ids[:12], BS))
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert [h for e in stored for h in e.block_hashes] == hash_full_blocks(b.all_token_ids[:20], BS)
    last, _, _ = mgr.pool.events.since(0)
    mgr.rollback_step()  # b's step failed: its registrations are taken back, and published as removed
    _, events, _ = mgr.pool.events.since(last)
    assert sorted(h for e in events for h in e.block_hashes) == sorted(hash_full_blocks(b.all_token_ids[:20], BS))
    mgr.cache_computed(b, 20)
    last, _, _ = mgr.pool.events.since(0)
    mgr.reset_prefix_cache()
    assert [type(e) for e in mgr.pool.events.since(last)[1]] == [AllBlocksCleared]


def test_the_wire_format_is_vllms_kv_event_batch():
    """[ts, [events]] with each event a map tagged by its class name and vLLM's field names, as msgspec writes
    vLLM's structs (checked against vLLM itself: docs/architecture.md, "KV events")."""
    import msgpack

    h1, h2 = b"\x01" * 32, b"\x02" * 32
    events = [BlockStored([h1, h2], None, list(range(8)), 4, "CPU"), BlockRemoved([h1], "CPU"), AllBlocksCleared()]
    raw = msgpack.unpackb(encode_batch(events, ts=12.5), raw=False)
    assert raw == [
        12.5,
        [
            {
                "type": "BlockStored",
                "block_hashes": [h1, h2],
                "parent_block_hash": None,
                "token_ids": list(range(8)),
                "block_size": 4,
                "lora_id": None,
                "medium": "CPU",
                "lora_name": None,
            },
            {"type": "BlockRemoved", "block_hashes": [h1], "medium": "CPU"},
            {"type": "AllBlocksCleared"},
        ],
    ]
    assert decode_batch(encode_batch(events, ts=1.0)) == (1.0, events)
    with pytest.raises(ValueError, match="not a KV cache event"):
        decode_batch(msgpack.packb([0.0, [{"type": "Nope"}]]))


def test_a_reader_that_fell_behind_the_log_is_told():
    log = KVEventLog(BS, capacity=3)
    for i in range(5):
        log.removed([bytes([i])])
    last, events, lost = log.since(0)
    assert (last, len(events), lost) == (5, 3, True)
    assert log.since(2) == (5, events, False)
    assert log.since(5) == (5, [], False)


def test_events_replayed_into_the_index_route_exactly():
    index = PrefixIndex()
    h = hash_full_blocks(list(range(12)), BS)
    apply_events(index, "a", [BlockStored(h, None, list(range(12)), BS)])
    apply_events(index, "b", [BlockStored(h[:1], None, list(range(4)), BS)])
    keys = [key(x) for x in h]
    assert index.match(keys, ["a", "b"]) == {"a": 3, "b": 1}
    apply_events(index, "a", [BlockRemoved(h[1:2])])  # evicted: a now holds only the first block of the chain
    assert index.match(keys, ["a", "b"]) == {"a": 1, "b": 1}
    apply_events(index, "b", [AllBlocksCleared()])
    assert index.match(keys, ["a", "b"]) == {"a": 1, "b": 0}


def _stats(**kw):
    from pagedllm.engine.stats import EngineStats

    base = dict(
        num_running=0,
        num_waiting=0,
        num_blocks=10,
        num_free_blocks=10,
        num_cached_blocks=0,
        block_size=16,
        kv_usage=0.0,
        num_stored_tokens=0,
        prefix_cache_queries=0,
        prefix_cache_hits=0,
        num_preemptions=0,
        prompt_tokens=0,
        generation_tokens=0,
        peak_running=0,
        num_steps=0,
    )
    return EngineStats(**{**base, **kw})


def test_replica_pages_merge_into_one_valid_page_with_a_replica_label():
    from prometheus_client.parser import text_string_to_metric_families

    from pagedllm.bench.serve_metrics import parse_prefix_cache_counters
    from pagedllm.cluster.replica_metrics import sum_stats, with_replica_labels
    from pagedllm.engine.metrics import PrometheusStatLogger

    a = _stats(
        prefix_cache_queries=100,
        prefix_cache_hits=60,
        num_running=2,
        num_free_blocks=4,
        spec_decode_num_accepted_tokens_per_pos=[5, 3, 1],
    )
    b = _stats(prefix_cache_queries=50, prefix_cache_hits=5, num_waiting=1, spec_decode_num_accepted_tokens_per_pos=[2])
    pages = {
        "ra": PrometheusStatLogger().render(a, "m").decode(),
        "rb": PrometheusStatLogger().render(b, "m").decode(),
    }
    merged = with_replica_labels(pages)
    families = {f.name: f for f in text_string_to_metric_families(merged)}  # parses: one HELP/TYPE per family
    running = {s.labels["replica"]: s.value for s in families["vllm:num_requests_running"].samples}
    assert running == {"ra": 2.0, "rb": 0.0}
    assert all(s.labels.get("replica") in ("ra", "rb") for f in families.values() for s in f.samples)
    assert all(s.labels.get("model_name") == "m" for f in families.values() for s in f.samples)
    assert parse_prefix_cache_counters(merged) == {"queries": 150.0, "hits": 65.0}
    total = sum_stats([a, b])
    assert (total.num_blocks, total.num_free_blocks, total.kv_usage) == (20, 14, pytest.approx(0.3))
    assert (total.prefix_cache_hit_rate, total.block_size) == (pytest.approx(65 / 150), 16)
    assert total.spec_decode_num_accepted_tokens_per_pos == [7, 3, 1]  # position by position


def _serve_args(*argv: str):
    from pagedllm.entrypoints.cli import build_parser

    return build_parser().parse_args(["serve", *argv])


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--routing", "prefix"], "--routing"),
        (["--ray-address", "auto"], "--ray-address"),
        (["--cpus-per-replica", "2"], "--cpus-per-replica"),
        (["--replicas", "0"], "--replicas"),
        (["--replicas", "2", "--cpus-per-replica", "0"], "--cpus-per-replica"),
        (["--replicas", "2", "--num-gpus-per-replica", "-1"], "--num-gpus-per-replica"),
        (["--replicas", "2", "--routing-imbalance-threshold", "-1"], "--routing-imbalance-threshold"),
        (["--replicas", "2", "--rag-index", "idx"], "--rag-index"),
    ],
)
def test_bad_cluster_flags_are_one_line_naming_the_flag(argv, flag):
    from pagedllm.entrypoints.serve_args import check_cluster_args
    from pagedllm.errors import UserError

    with pytest.raises(UserError, match=f"^{flag}:"):
        check_cluster_args(_serve_args(*argv))


def test_lora_modules_are_checked_before_ray_starts(tmp_path):
    """The replicas load --lora-modules; what can be told without the model is one line before Ray starts (a
    replica that failed to load would be started again and again by Ray Serve)."""
    from pagedllm.entrypoints.serve_cluster import settings_from_args
    from pagedllm.errors import UserError

    with pytest.raises(UserError, match="^--lora-modules: needs --enable-lora$"):
        settings_from_args(_serve_args("--replicas", "2", "--lora-modules", f"a={tmp_path}"))
    missing = tmp_path / "missing"
    with pytest.raises(UserError, match=f"^--lora-modules: a: no PEFT folder or GGUF file at {missing}$"):
        settings_from_args(_serve_args("--replicas", "2", "--enable-lora", "--lora-modules", f"a={missing}"))
    _, _, ingress = settings_from_args(
        _serve_args("--replicas", "2", "--enable-lora", "--lora-modules", f"a={tmp_path}")
    )
    assert [(lora.lora_name, lora.lora_int_id) for lora in ingress.loras] == [("a", 1)]


def test_a_replica_that_fails_on_a_users_mistake_is_one_line():
    """An adapter that does not fit the model is known only once a replica loads it: Ray Serve's failed
    deployment becomes the replica's own error, one line; anything else keeps Ray's error."""
    from pagedllm.cluster.launch import replica_failure

    traceback = (
        "The deployment failed to start 3 times in a row. This may be due to a problem with its constructor or "
        "initial health check failing. See controller logs for details. Error:\n"
        "ray::ServeReplica:pagedllm:PagedLLMEngine.initialize_and_get_metadata() (pid=1, ip=127.0.0.1)\n"
        "RuntimeError: Traceback (most recent call last):\n"
        '  File "pagedllm/cluster/replica.py", line 72, in __init__\n'
        "    self.core.add_lora(lora)\n"
        "{}\n"
    )
    error = "LoRA adapter 'qv': model.layers.0.self_attn.q_proj: A (4, 64) and B (64, 4) do not fit the model"
    assert replica_failure(traceback.format(f"pagedllm.model.lora.LoRAError: {error}")) == error
    assert replica_failure(traceback.format("MemoryError: out of memory")) is None
    assert replica_failure("") is None


def test_replicas_that_do_not_fit_are_refused_before_ray_starts():
    from pagedllm.cluster.launch import check_resources
    from pagedllm.errors import UserError

    check_resources({"CPU": 2.0}, 2, 1.0, 0.0)
    with pytest.raises(UserError, match="^--cpus-per-replica: 2 replicas x 1.5 CPUs need 3; the Ray cluster has 2"):
        check_resources({"CPU": 2.0}, 2, 1.5, 0.0)
    with pytest.raises(UserError, match="^--num-gpus-per-replica:"):
        check_resources({"CPU": 8.0}, 2, 1.0, 1.0)


def test_serve_run_builder_args_are_serve_flags():
    from pagedllm.entrypoints.serve_cluster import parse_builder_args

    args = parse_builder_args(
        {"replicas": "3", "routing": "kv-events", "block_size": "32", "enable_prefix_caching": "true"}
    )
    assert (args.replicas, args.routing, args.block_size, args.model) == (3, "kv-events", 32, None)
    assert parse_builder_args({"model": "m.gguf"}).replicas == 1
    assert parse_builder_args({"model": "m.gguf"}).model == "m.gguf"


def test_a_ray_address_with_no_cluster_is_one_line_naming_the_flag(monkeypatch, capsys):
    """`--ray-address auto` with no Ray running: one line naming --ray-address and a nonzero exit, not Ray's
    traceback ending in advice about an `--address` flag pagedllm does not have. No Ray is started; the search
    for a running one is made to find none, whatever else runs on this machine."""
    pytest.importorskip("ray")
    from ray._private import services

    from pagedllm.bench.server_process import free_port
    from pagedllm.entrypoints.cli import main

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(services, "_find_address_from_flag", lambda flag: set())  # no GCS process found
    services.find_gcs_addresses.cache_clear()
    monkeypatch.setattr(services, "find_bootstrap_address", lambda temp_dir: None)
    rc = main(["serve", "--replicas", "8", "--ray-address", "auto", "--port", str(free_port())])
    err = capsys.readouterr().err
    assert rc != 0
    assert len(err.strip().splitlines()) == 1 and "--ray-address auto" in err, err
    assert "Traceback" not in err and "`--address`" not in err


@pytest.mark.timeout(120)  # a hang guard: Ray itself would retry such an address for minutes
def test_a_ray_address_where_nothing_listens_is_one_line_naming_the_flag(capsys):
    pytest.importorskip("ray")
    from pagedllm.bench.server_process import free_port
    from pagedllm.entrypoints.cli import main

    address = f"127.0.0.1:{free_port()}"
    assert main(["serve", "--replicas", "2", "--ray-address", address, "--port", str(free_port())]) != 0
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [err.strip()] and f"--ray-address {address}: no Ray cluster" in err, err


def test_replicas_kv_groups_and_recurrent_state_add_up_field_by_field():
    """A hybrid model's replicas: each group's held blocks and the state's slots and checkpoints added, the shape
    (window, layers, bytes per request) kept; a dense model's replicas (no state) sum to no state."""
    from pagedllm.cluster.replica_metrics import sum_stats
    from pagedllm.engine.stats import KVGroupStats, RecurrentStateStats

    def state(used: int, held: int) -> RecurrentStateStats:
        return RecurrentStateStats([0, 1, 2], 4096, 8, used, 2, 5, 10, held, 1)

    a = _stats(kv_groups=[KVGroupStats(None, [3], 7), KVGroupStats(512, [4], 2)], recurrent_state=state(2, 1))
    b = _stats(kv_groups=[KVGroupStats(None, [3], 1), KVGroupStats(512, [4], 3)], recurrent_state=state(3, 0))
    total = sum_stats([a, b])
    assert total.kv_groups == [KVGroupStats(None, [3], 8), KVGroupStats(512, [4], 5)]
    assert total.recurrent_state == RecurrentStateStats([0, 1, 2], 4096, 16, 5, 2, 10, 20, 1, 2)
    assert sum_stats([_stats(), _stats()]).recurrent_state is None
