"""KV-cache groups on one pool (vLLM v1's coordinator): each group its own block table; a Gemma-3-shaped model
(five sliding layers to one full) gives its sliding groups' old blocks back while the full group keeps its own,
with transformers' greedy tokens; the prefix hit is the longest every group serves; preemption and abort return
every group's blocks; layers that read another's KV (Gemma 4) get none."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import assert_all_blocks_free, run_all
from model_helpers import VOCAB

from devkit.tiny_tokenizer import save_tiny_tokenizer
from pagedllm import SamplingParams
from pagedllm.engine import EngineConfig, LLMEngine
from pagedllm.kv.kv_spec import kv_cache_layout, kv_sources
from pagedllm.kv.manager import PagedKVCacheManager
from pagedllm.kv.manager import TokenRequest as Req

BS, WINDOW, PROMPT, NEW = 4, 12, 120, 24


def _grow(mgr: PagedKVCacheManager, req: Req, chunk: int) -> int:
    """Admit `req` (prefix lookup), compute its prompt in chunks as the scheduler does; the peak blocks held."""
    hit, cached = mgr.get_computed_blocks(req)
    req.num_computed_tokens = 0
    n = min(chunk, len(req.all_token_ids) - cached)
    assert mgr.allocate_slots(req, n, hit)
    req.num_computed_tokens, peak = cached + n, mgr.num_used_blocks
    while req.num_computed_tokens < len(req.all_token_ids):
        n = min(chunk, len(req.all_token_ids) - req.num_computed_tokens)
        assert mgr.allocate_slots(req, n)
        req.num_computed_tokens += n
        peak = max(peak, mgr.num_used_blocks)
    return peak


def test_gemma3_layout_is_six_groups_of_one_layer():
    layout = kv_cache_layout([WINDOW] * 5 + [None])
    assert layout.layers_per_block == 1 and len(layout.groups) == 6
    assert layout.groups[0].window is None and layout.groups[0].layers == (5,)
    assert [g.window for g in layout.kinds()] == [None, WINDOW]
    twin = kv_cache_layout([WINDOW] * 5 + [None], hybrid=False)
    assert len(twin.groups) == 1 and twin.layers_per_block == 6 and twin.layer_slot == tuple(range(6))


def test_shared_kv_layers_get_no_slot():
    """Gemma 4: the last two layers read the last earlier layer of their kind and store no KV."""
    windows = [WINDOW, None, WINDOW, None, WINDOW, None]
    src = kv_sources(windows, 2)
    assert src == [0, 1, 2, 3, 2, 3]
    layout = kv_cache_layout(windows, src)
    assert layout.num_kv_layers == 4 and sum(len(g.layers) for g in layout.groups) == 4
    assert layout.layer_slot[4] == layout.layer_slot[2] and layout.layer_group[5] == layout.layer_group[3]
    with pytest.raises(ValueError):
        kv_sources([None, WINDOW], 1)  # the sliding kind has no earlier layer storing it


def test_sliding_groups_free_while_the_full_group_keeps_its_blocks():
    layout = kv_cache_layout([WINDOW] * 5 + [None])
    mgr = PagedKVCacheManager(400, BS, True, layout=layout)
    req = Req("a", list(range(1000, 1000 + PROMPT)))
    _grow(mgr, req, chunk=8)
    counts = mgr.group_block_counts("a")
    assert counts[0] == PROMPT // BS  # the full group holds every block
    assert all(c <= -(-(WINDOW + 8) // BS) + 1 for c in counts[1:])  # each sliding group: its window's
    assert len(mgr.held_block_ids("a")) == sum(counts)  # no block is in two groups' tables
    mgr.free(req)
    assert mgr.num_free_blocks == mgr.num_blocks and all(b.ref_cnt == 0 for b in mgr.pool.blocks)


def test_hit_is_the_longest_every_group_serves():
    """A request sharing A's first 60 tokens hits 60 in both groups (the sliding one null before its window);
    once the sliding group's blocks just before 60 are gone, the full group's hit shortens to what the sliding
    group serves: the hit is the longest length both serve."""
    layout = kv_cache_layout([WINDOW, None])
    mgr = PagedKVCacheManager(200, BS, True, layout=layout)
    a = Req("a", list(range(1000, 1000 + PROMPT)))
    _grow(mgr, a, chunk=PROMPT)  # one chunk: every sliding block registered before it was given back
    mgr.free(a)
    b = Req("b", a.all_token_ids[:60] + [7, 8, 9])
    hit, cached = mgr.get_computed_blocks(b)
    assert cached == 60 and [len(g) for g in hit.groups] == [15, 15]
    need = -(-(WINDOW - 1) // BS)
    assert all(x is mgr.null_block for x in hit.groups[1][: 15 - need]) and mgr.null_block not in hit.groups[0]
    # the sliding group's blocks just before 60 evicted: no group can serve past the sliding group's hit
    for block in hit.groups[1][15 - need :]:
        mgr.pool.uncache(block)
    hit, cached = mgr.get_computed_blocks(Req("c", b.all_token_ids))
    assert cached < 60 and len(hit.groups[0]) == len(hit.groups[1]) == cached // BS
    assert mgr.allocate_slots(b, 3, mgr.get_computed_blocks(b)[0])
    mgr.free(b)
    assert mgr.num_free_blocks == mgr.num_blocks


def test_preemption_and_abort_return_every_groups_blocks():
    layout = kv_cache_layout([WINDOW] * 2 + [None])
    mgr = PagedKVCacheManager(50, BS, True, layout=layout)
    reqs = [Req(str(i), list(range(i * 1000, i * 1000 + 30))) for i in range(2)]
    for r in reqs:
        _grow(mgr, r, chunk=7)
    mgr.free(reqs[0])  # preempted, then recomputed from its prefix
    _grow(mgr, Req("0", reqs[0].all_token_ids[:]), chunk=5)
    assert not mgr.allocate_slots(Req("big", list(range(5000, 5200))), 200)  # all or nothing over the groups
    for rid in ("0", "1", "big"):
        mgr.free(Req(rid, []))
    assert mgr.num_free_blocks == mgr.num_blocks and all(b.ref_cnt == 0 for b in mgr.pool.blocks)
    assert not any(m.req_to_blocks for m in mgr.coordinator.managers)


def _write(mgr: PagedKVCacheManager, req: Req, start: int, end: int, written: dict[int, tuple[int, int]]) -> None:
    """What the model does after a step's allocation: positions start..end-1 written through each group's table
    (a shadow of the pool: block id -> the (group, table index) whose K/V it holds)."""
    for g, table in enumerate(mgr.get_group_block_ids(req.request_id)):
        for pos in range(start, end):
            written[table[pos // BS]] = (g, pos // BS)


def test_readmitted_hit_blocks_hold_what_they_claim():
    """A request whose prompt filled the pool is preempted before its decode step: the sliding group's blocks
    are freed first (the tail first), so its hit block heads the free queue. Re-admitted, the full group's
    fresh block must not be that block: every group's hit is taken before any group allocates (else the full
    group writes its K/V there while the sliding group reads it as its hit)."""
    mgr = PagedKVCacheManager(8, BS, True, layout=kv_cache_layout([BS, None]))  # sliding window of one block
    a, written = Req("a", list(range(1000, 1000 + 4 * BS))), {}
    assert mgr.allocate_slots(a, 4 * BS)  # every block of the pool: four per group
    _write(mgr, a, 0, 4 * BS, written)
    a.num_computed_tokens = 4 * BS
    a.all_token_ids.append(7)  # its first token sampled; the decode step finds no room and preempts it
    mgr.free(a)
    a.num_computed_tokens = 0
    hit, cached = mgr.get_computed_blocks(a)
    assert cached == 4 * BS and [len(g) for g in hit.groups] == [4, 4]
    assert hit.groups[1][:3] == [mgr.null_block] * 3  # the sliding group's hit: its last block only
    assert mgr.allocate_slots(a, 1, hit)
    _write(mgr, a, cached, cached + 1, written)  # the step after re-admission: its one token, in every group
    claims = [(g, i, b) for g, blocks in enumerate(hit.groups) for i, b in enumerate(blocks) if b is not mgr.null_block]
    assert [written[b.block_id] for _, _, b in claims] == [(g, i) for g, i, _ in claims]
    assert len(mgr.held_block_ids("a")) == sum(mgr.group_block_counts("a"))  # no block in two tables
    mgr.free(a)
    assert mgr.num_free_blocks == mgr.num_blocks and all(b.ref_cnt == 0 for b in mgr.pool.blocks)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    """A tiny Gemma 3 (five sliding layers of window 12, then a full one) and transformers' greedy tokens."""
    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    folder = str(tmp_path_factory.mktemp("gemma3_groups"))
    cfg = Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=WINDOW,
        max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    hf.save_pretrained(folder, safe_serialization=True)
    save_tiny_tokenizer(folder, VOCAB)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, VOCAB, (PROMPT,), generator=g).tolist() for _ in range(2)]
    want = []
    for p in prompts:
        out = hf.generate(torch.tensor([p]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0)
        want.append(out[0, len(p) :].tolist())
    return folder, prompts, want


def _engine(folder: str, **kw) -> LLMEngine:
    kw.setdefault("kv_cache_memory", 2**20)
    return LLMEngine(
        EngineConfig(
            model=folder,
            dtype="float32",
            max_model_len=512,
            block_size=BS,
            max_num_batched_tokens=32,
            log_stats_interval=0,
            **kw,
        )  # fmt: skip
    )


def test_gemma3_through_the_engine_frees_sliding_blocks_with_the_same_tokens(gemma3):
    """Greedy tokens equal transformers' with per-group tables and with one table (hybrid off), while the peak
    KV bytes drop: the sliding groups hold their windows only."""
    folder, prompts, want = gemma3
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    hybrid, single = _engine(folder), _engine(folder, disable_hybrid_kv_cache_manager=True)
    assert len(hybrid.kv_layout.groups) == 6 and len(single.kv_layout.groups) == 1
    assert run_all(hybrid, prompts[:1], params) == want[:1] == run_all(single, prompts[:1], params)
    peak = {e: e.kv.peak_used_blocks * e.runner.bytes_per_block for e in (hybrid, single)}
    assert peak[hybrid] < 0.5 * peak[single]
    assert_all_blocks_free(hybrid)
    assert_all_blocks_free(single)


@pytest.fixture(scope="module")
def gemma3_q8(gemma3, tmp_path_factory):
    """The same Gemma 3 as a Q8_0 GGUF (so every step runs the fused C step) and transformers' greedy tokens on
    the values the file stands for."""
    import copy

    from transformers import AutoModelForCausalLM

    import pagedllm.model.tokenizer as tokenizer_module
    from devkit.family_helpers import write_gguf

    folder, prompts, _ = gemma3
    path = str(tmp_path_factory.mktemp("gemma3_q8") / "tiny-gemma3.q8_0.gguf")
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ref = copy.deepcopy(hf)
    ref.load_state_dict(write_gguf(folder, "gemma3", "q8_0", path), strict=False)
    want = []
    for p in prompts[:1]:
        out = ref.generate(torch.tensor([p]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0)
        want.append(out[0, len(p) :].tolist())
    cache = tmp_path_factory.mktemp("gguf_tokenizers")  # GGUF tokenizers are cached by path: not the user's cache
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tokenizer_module, "cache_dir_for", lambda path, kind: str(cache / "tok"))
        yield path, prompts, want


def test_gemma3_gguf_runs_the_fused_step_with_a_table_per_group(gemma3_q8):
    """The fused C step reads each layer's group's table and slots: with the sliding groups' blocks out of the
    window handed back (null in their tables), greedy tokens equal transformers' and the one-table run's."""
    path, prompts, want = gemma3_q8
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    kw = dict(quantized_activations="none")  # float32 x into the matmuls: transformers' numbers
    hybrid, single = _engine(path, **kw), _engine(path, disable_hybrid_kv_cache_manager=True, **kw)
    assert hybrid.runner.fused is not None and single.runner.fused is not None
    assert len(hybrid.kv_layout.groups) == 6 and len(single.kv_layout.groups) == 1
    assert run_all(hybrid, prompts[:1], params) == want == run_all(single, prompts[:1], params)
    assert hybrid.kv.peak_used_blocks * hybrid.runner.bytes_per_block < 0.5 * (
        single.kv.peak_used_blocks * single.runner.bytes_per_block
    )  # the sliding groups' old blocks did go back while the C step ran
    assert_all_blocks_free(hybrid)
    assert_all_blocks_free(single)


def test_gemma3_prefix_hit_and_preemption_across_groups(gemma3):
    """A second request with the first one's prompt hits in every group and answers the same; a cache that holds
    one request at a time preempts and still answers transformers' tokens, every group's blocks returned."""
    folder, prompts, want = gemma3
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    engine = _engine(folder)
    assert run_all(engine, prompts[:1], params) == want[:1]
    assert run_all(engine, prompts[:1], params) == want[:1]
    assert engine.kv.prefix_stats.hits >= (PROMPT - 1) // BS * BS - WINDOW
    per_block = engine.runner.bytes_per_block
    small = _engine(folder, kv_cache_memory=per_block * 110, enable_prefix_caching=False)
    assert run_all(small, prompts, params) == want
    assert small.scheduler.num_preemptions > 0
    assert_all_blocks_free(small)
    assert_all_blocks_free(engine)
