"""The hybrid families (Qwen3.5 text, Qwen3-Next, Qwen3.5-MoE: Gated DeltaNet layers beside full attention) against
transformers in float32, on tiny random checkpoints written by `save_pretrained`: logits over 130 tokens fed in
uneven chunks; 32 greedy tokens of several batched requests under chunked prefill (64 tokens a step, so a 258-token
prompt's state crosses chunk ends), a prefix-cache hit and a cache small enough to preempt (recomputed from a zero
state); a step that fails after some layers ran (its states are never committed: the retry continues from the old
ones); prefix caching, whose hits start from recurrent-state checkpoints at block boundaries and must never change an
answer; every state slot back at the end, as every block."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest
import torch
from engine_helpers import greedy_cached_chunked_preempted, hybrid_engine, shared_prefix_prompts
from model_helpers import (
    assert_long_marked_chunks_match,
    assert_marked_states_match,
    cpu_target,
    fused_and_torch,
    marks_fused_and_torch,
)

from devkit.tiny_tokenizer import save_tiny_tokenizer
from pagedllm import SamplingParams
from pagedllm.engine import EngineConfig, LLMEngine
from pagedllm.engine.memory import state_bytes
from pagedllm.model import ModelRunner, SeqChunk, load_model
from pagedllm.model.fused_step import _model_blockers
from pagedllm.model.kernels import cpu_kernel
from pagedllm.model.params import param_count
from pagedllm.model.runner import bytes_per_block

TOL = 1e-4  # of the largest logit
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository: the subprocesses import it
FAMILIES = ["qwen3_5", "qwen3_next", "qwen3_5_moe"]
_SHAPE = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,  # three linear-attention layers, then a full-attention one
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=8,
    rms_norm_eps=1e-5,
    max_position_embeddings=512,
)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)


def make_hybrid(family: str, folder: str, twin: bool = False, **over: int) -> torch.nn.Module:
    """A tiny random checkpoint of `family` in `folder`: weights drawn wide enough that a wrong state, gate or
    rotation moves the logits far past the tolerance (decays spread by A_log, norms around 1). `over`: sizes in
    place of the default shape's; `twin` (qwen3_5): every layer full attention, the hybrid's attention-only twin."""
    from transformers import AutoModelForCausalLM, Qwen3_5MoeTextConfig, Qwen3_5TextConfig, Qwen3NextConfig

    base, moe = (
        _SHAPE | {k: v for k, v in over.items() if k in _SHAPE},
        _MOE | {k: v for k, v in over.items() if k in _MOE},
    )
    if family == "qwen3_next":
        cfg, arch = Qwen3NextConfig(**base, **moe), "Qwen3NextForCausalLM"
    elif family == "qwen3_5_moe":  # every layer sparse: no dense intermediate_size in its config
        shape = {k: v for k, v in base.items() if k != "intermediate_size"}
        cfg, arch = Qwen3_5MoeTextConfig(**shape, **moe), "Qwen3_5MoeForCausalLM"
    else:
        types = ["full_attention"] * base["num_hidden_layers"] if twin else None
        cfg, arch = Qwen3_5TextConfig(**base, layer_types=types), "Qwen3_5ForCausalLM"
    cfg.architectures = [arch]
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "A_log" in name:
                p.uniform_(-2, 1)
            elif "norm" in name:
                p.uniform_(-0.3, 0.3) if "linear_attn" not in name else p.uniform_(0.7, 1.3)
            else:
                p.normal_(0, 0.3)
    hf.save_pretrained(folder, safe_serialization=True)
    save_tiny_tokenizer(folder, 256)
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 1, "eos_token_id": 2}, f)
    return hf


pytestmark = pytest.mark.usefixtures("one_thread", "private_tokenizer_cache")  # tests/conftest.py


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = {}
    for family in FAMILIES:
        folder = str(tmp_path_factory.mktemp(family))
        out[family] = (make_hybrid(family, folder), load_model(folder, "float32", "cpu"), folder)
    return out


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 256) for _ in range(n)]


def _greedy(hf: torch.nn.Module, prompt: list[int], n: int = 32) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt) :].tolist()


def _engine(loaded, blocks: int = 64, **kw) -> LLMEngine:
    """An engine whose KV budget holds `blocks` blocks of 16 besides its requests' state slots (and a state's
    worth each more with prefix caching on: staging rows under all, blocks for checkpoints under align)."""
    seqs = kw.pop("max_num_seqs", 4)
    per_block = bytes_per_block(loaded.config, 16, "float32", loaded.config.kv_layout(hybrid=True))
    rows = 2 if kw.get("enable_prefix_caching", True) else 1
    budget = blocks * per_block + seqs * rows * state_bytes(loaded.config, torch.float32)
    kw = dict(max_model_len=256, log_stats_interval=0, max_num_seqs=seqs, kv_cache_memory=budget) | kw
    return LLMEngine(EngineConfig(**kw), loaded)


def _run(engine: LLMEngine, prompts: list[list[int]], n: int = 32) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    return [done[str(i)].outputs[0].token_ids for i in range(len(prompts))]


def _all_back(engine: LLMEngine) -> None:
    slots = engine.kv.recurrent.slots
    assert slots is not None and slots.num_free == slots.num_slots and not slots.req_to_slot
    assert engine.kv.num_free_blocks == engine.kv.num_blocks and not engine.scheduler.running


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers_over_uneven_chunks(models, family):
    hf, loaded, _ = models[family]
    ids = _tokens(130, 1)
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
    runner = ModelRunner(loaded, 16, 16)
    got, pos = [], 0
    for n in (50, 46, 33, 1):  # the state and the KV both carried across each
        got.append(runner.execute([SeqChunk(ids[pos : pos + n], pos, list(range(16)), True, state_slot=5)]))
        pos += n
    assert (torch.cat(got) - want).abs().max().item() < TOL * want.abs().max().item()


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_batched_chunked_and_preempted_match_transformers(models, family):
    """Three requests at once, two sharing 256 tokens (the second starts from the first's state checkpoint), 64
    tokens a step, a cache of 16 blocks of 32 for 23 blocks of requests: preemption; every block and slot back."""
    hf, loaded, _ = models[family]
    prompts = shared_prefix_prompts(_tokens)
    assert greedy_cached_chunked_preempted(hybrid_engine(loaded, 16), prompts) == [_greedy(hf, p) for p in prompts]


def test_a_step_that_fails_midway_is_retried_from_the_states_before_it(models, monkeypatch):
    """The full-attention layer (the last) raises in the third step, after the three linear layers computed new
    states; nothing was committed, each request runs alone again and every answer is transformers'."""
    hf, loaded, _ = models["qwen3_5"]
    prompts = [_tokens(90, 5), _tokens(70, 6)]
    engine = _engine(loaded, max_num_batched_tokens=64)
    layer = loaded.model.decoder_layers[-1]
    assert layer.linear_attn is None and loaded.model.decoder_layers[0].linear_attn is not None
    original, calls = layer.forward, []

    def forward(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected failure after the linear layers ran")
        return original(*args, **kwargs)

    monkeypatch.setattr(layer, "forward", forward)
    assert _run(engine, prompts, 8) == [_greedy(hf, p, 8) for p in prompts]
    assert len(calls) > 3
    _all_back(engine)


def test_prefix_caching_hits_at_state_checkpoints_and_never_changes_an_answer(models):
    """Prompts sharing 64 tokens, one after the other (64 tokens a step: the first's state at 64 is kept): the
    later ones hit on those 64 tokens and start from the checkpoint; a prompt that continues an earlier one hits
    at that one's last block boundary; every answer equals caching off, and transformers'."""
    hf, loaded, _ = models["qwen3_5"]
    shared = _tokens(64, 7)
    first = shared + _tokens(30, 8)
    prompts = [first, shared + _tokens(20, 9), first + _tokens(20, 16)]
    on = _engine(loaded, max_num_batched_tokens=64)
    off = _engine(loaded, max_num_batched_tokens=64, enable_prefix_caching=False)
    got = [_run(on, [p], 8)[0] for p in prompts]
    assert got == [_run(off, [p], 8)[0] for p in prompts] == [_greedy(hf, p, 8) for p in prompts]
    stats = on.stats()
    assert stats.prefix_cache_hits == 64 + 80  # the shared 64, then the first prompt's last boundary (80)
    assert off.stats().prefix_cache_hits == 0
    _all_back(on)
    checkpoints = on.kv.recurrent.checkpoints
    assert checkpoints is not None and not checkpoints.holds


def test_a_shared_prefix_hits_from_its_third_prompt_without_chunking(models):
    """Prompts computed in one chunk each: the first keeps only its last boundary's state; the second finds the
    shared 64 tokens' KV but no state there, so its chunk is cut at 64 and that state kept; the third hits on it."""
    hf, loaded, _ = models["qwen3_5"]
    shared = _tokens(64, 18)
    prompts = [shared + _tokens(40 + 3 * i, 19 + i) for i in range(3)]
    engine = _engine(loaded, max_num_batched_tokens=512)
    assert [_run(engine, [p], 6)[0] for p in prompts] == [_greedy(hf, p, 6) for p in prompts]
    assert engine.stats().prefix_cache_hits == 64
    _all_back(engine)
    assert engine.kv.recurrent.checkpoints is not None and not engine.kv.recurrent.checkpoints.wanted


def _checkpoints_idle(engine: LLMEngine) -> None:
    ck = engine.kv.recurrent.checkpoints
    assert ck is not None and not ck.holds and not ck.unwritten and not ck.wanted
    assert len(ck._staging) == ck.num_staging


def test_mamba_cache_mode_all_hits_the_second_prompt_at_the_shared_prefix_end(models):
    """--mamba-cache-mode all: the first prompt, one chunk of 140 tokens, leaves its state at every block
    boundary inside it, so the second prompt sharing its 100-token system prompt already hits at that prompt's
    last full block (96; align: no hit until the third), and so does the third; chunks of 40 tokens (boundaries
    inside and at chunk ends) hit the same; every answer equals caching off and transformers'."""
    hf, loaded, _ = models["qwen3_5"]
    system = _tokens(100, 20)
    prompts = [system + _tokens(40 + 3 * i, 21 + i) for i in range(3)]
    want = [_greedy(hf, p, 6) for p in prompts]
    hits = {}
    for mode, chunk in (("all", 512), ("all", 40), ("align", 512)):
        engine = _engine(loaded, max_num_batched_tokens=chunk, mamba_cache_mode=mode)
        assert [_run(engine, [p], 6)[0] for p in prompts] == want
        hits[mode, chunk] = engine.stats().prefix_cache_hits
        _all_back(engine)
        _checkpoints_idle(engine)
    assert hits == {("all", 512): 2 * 96, ("all", 40): 2 * 96, ("align", 512): 96}
    off = _engine(loaded, max_num_batched_tokens=40, enable_prefix_caching=False, mamba_cache_mode="all")
    assert [_run(off, [p], 6)[0] for p in prompts] == want and off.stats().prefix_cache_hits == 0


def test_mamba_cache_mode_all_in_a_burst_and_none(models):
    """Questions on one system prompt sent together after a first one (all: each hits at the system prompt's
    last full block, from the one checkpoint); none caches no prefix of a hybrid model. Every answer is
    transformers', every block, slot and staging row back."""
    hf, loaded, _ = models["qwen3_5"]
    system = _tokens(70, 30)
    prompts = [system + _tokens(20 + i, 31 + i) for i in range(4)]
    want = [_greedy(hf, p, 6) for p in prompts]
    for mode, hits in (("all", 3 * 64), ("none", 0)):
        engine = _engine(loaded, max_num_batched_tokens=64, mamba_cache_mode=mode)
        assert _run(engine, prompts[:1], 6) + _run(engine, prompts[1:], 6) == want
        assert engine.stats().prefix_cache_hits == hits
        _all_back(engine)
        if mode == "all":
            _checkpoints_idle(engine)
        else:
            assert engine.kv.recurrent.checkpoints is None


def test_a_burst_on_a_new_prefix_hits_as_the_attention_only_twin(models, tmp_path):
    """Four prompts on one 100-token system prompt sent together, none computed before. The twin (every layer full
    attention) hits the later three on the first's blocks, registered in the step that computes them; the hybrid's
    later prompts wait that step for the first's state checkpoints (all: at every boundary it crosses) and hit as
    much (align: the second is cut at the prefix's end, the others hit there). Answers equal caching off."""
    hf, loaded, _ = models["qwen3_5"]
    make_hybrid("qwen3_5", str(tmp_path), twin=True)
    twin = load_model(str(tmp_path), "float32", "cpu")
    system = _tokens(100, 50)
    prompts = [system + _tokens(30 + i, 51 + i) for i in range(4)]
    off = _run(_engine(loaded, max_num_batched_tokens=256, enable_prefix_caching=False), prompts, 6)
    hits = {}
    for name, model, mode in (("twin", twin, "align"), ("all", loaded, "all"), ("align", loaded, "align")):
        engine = _engine(model, max_num_batched_tokens=256, mamba_cache_mode=mode)
        got = _run(engine, prompts, 6)
        hits[name] = engine.stats().prefix_cache_hits
        assert engine.kv.num_free_blocks == engine.kv.num_blocks
        if model is loaded:
            assert got == off
            _all_back(engine)
            _checkpoints_idle(engine)
    assert hits == {"twin": 3 * 96, "all": 3 * 96, "align": 2 * 96}


def test_checkpoints_evicted_under_memory_pressure_never_change_an_answer(models):
    """A pool of 40 blocks, three system prompts of 100 tokens asked twice in a row each, then the first again
    (all: 3 blocks per checkpoint, one at each boundary a prompt crosses: a prompt and its states take most of
    the pool): the pool's one LRU evicts checkpoints and KV blocks alike, so the second of a pair hits and the
    first system prompt, evicted since, no more; every answer equals caching off, every block and slot comes back,
    and checkpoints were evicted."""
    hf, loaded, _ = models["qwen3_5"]
    systems = [_tokens(100, 60 + i) for i in range(3)]
    prompts = [systems[s] + _tokens(20, 70 + i) for i, s in enumerate((0, 0, 1, 1, 2, 2, 0))]
    engine = _engine(loaded, blocks=40, max_num_batched_tokens=64, mamba_cache_mode="all")
    ck = engine.kv.recurrent.checkpoints
    assert ck is not None and ck.blocks_each > 1
    stored, store = [], ck.store
    ck.store = lambda key, row: store(key, row) and (stored.append(key) or True)  # type: ignore[method-assign]
    got = [_run(engine, [p], 6)[0] for p in prompts]
    off = _engine(loaded, blocks=40, max_num_batched_tokens=64, enable_prefix_caching=False)
    assert got == [_run(off, [p], 6)[0] for p in prompts]
    assert sum(not ck.find(k) for k in stored) > len(stored) // 2
    assert engine.stats().prefix_cache_hits == 3 * 96
    _all_back(engine)
    _checkpoints_idle(engine)


def test_an_abort_of_a_waiting_and_a_running_hybrid_request_gives_every_block_back(models):
    """Under all, in a burst: one request computing a new prefix in the first step, one that waits that step for
    its checkpoints; both aborted after it: every block, slot, staging row, hold and pending checkpoint comes
    back, and the prefix then hits from the checkpoints the first step left, with transformers' answer."""
    hf, loaded, _ = models["qwen3_5"]
    system = _tokens(100, 80)
    engine = _engine(loaded, max_num_batched_tokens=160, mamba_cache_mode="all")
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    engine.add_request("a", system + _tokens(30, 81), params)
    engine.add_request("b", system + _tokens(30, 82), params)
    engine.step()
    (running,) = engine.scheduler.running
    (waiting,) = engine.scheduler.waiting  # the step's budget had room for it: it waited for the checkpoints
    assert running.parent_id == "a" and waiting.parent_id == "b" and running.num_computed_tokens == 130
    engine.abort_request("a")
    engine.abort_request("b")
    _all_back(engine)
    _checkpoints_idle(engine)
    rs = engine.kv.recurrent
    assert not rs._pending and not rs._waits and not rs._hit_key
    prompt = system + _tokens(30, 83)
    assert _run(engine, [prompt], 6) == [_greedy(hf, prompt, 6)] and engine.stats().prefix_cache_hits == 96


def test_a_failed_step_leaves_no_checkpoint_of_its_marks(models, monkeypatch):
    """A prompt whose steps all fail (the full-attention layer raises after the linear layers computed the states
    at its marks): its request fails, the staging rows of its marks go back unwritten, so a later prompt on the
    same system prompt hits nothing and its answer is transformers'."""
    hf, loaded, _ = models["qwen3_5"]
    system = _tokens(100, 40)
    engine = _engine(loaded, max_num_batched_tokens=512, mamba_cache_mode="all")
    layer = loaded.model.decoder_layers[-1]
    original, failing = layer.forward, [True]

    def forward(*args, **kwargs):
        if failing[0]:
            raise RuntimeError("injected failure after the linear layers ran")
        return original(*args, **kwargs)

    monkeypatch.setattr(layer, "forward", forward)
    engine.add_request("bad", system + _tokens(30, 41), SamplingParams(temperature=0, max_tokens=4))
    (out,) = [o for o in engine.step() if o.finished]
    assert out.outputs[0].finish_reason == "error"
    ck = engine.kv.recurrent.checkpoints
    assert ck is not None and ck.counts() == (0, 0) and len(ck._staging) == ck.num_staging
    failing[0] = False
    prompt = system + _tokens(25, 42)
    assert _run(engine, [prompt], 6) == [_greedy(hf, prompt, 6)]
    assert engine.stats().prefix_cache_hits == 0
    _all_back(engine)
    _checkpoints_idle(engine)


def test_abort_gives_the_slot_back_and_a_new_request_starts_from_zero(models):
    hf, loaded, _ = models["qwen3_5"]
    engine = _engine(loaded, max_num_seqs=1, max_num_batched_tokens=32)
    engine.add_request("a", _tokens(60, 10), SamplingParams(temperature=0, max_tokens=8))
    engine.step()
    (running,) = engine.scheduler.running
    assert engine.kv.recurrent.slot(running.request_id) == 0
    engine.abort_request("a")
    _all_back(engine)
    _checkpoints_idle(engine)
    prompt = _tokens(40, 11)
    assert _run(engine, [prompt], 8) == [_greedy(hf, prompt, 8)]  # the same slot, after its old contents


def test_config_layout_and_what_refuses_them(models, capsys):
    """Linear layers hold no KV; the parameters count as transformers' (kv-calc's figure); the state bytes are the
    layers' conv and recurrent states; the fused C step runs them; kv_blend is refused naming them; kv-calc prints
    the state bytes per request."""
    from pagedllm.entrypoints.cli import main
    from pagedllm.errors import UserError

    hf, loaded, folder = models["qwen3_next"]
    cfg = loaded.config
    assert param_count(cfg)[0] == sum(p.numel() for p in hf.parameters())
    layout = cfg.kv_layout(hybrid=True)
    assert cfg.linear_layers == [0, 1, 2] and layout.num_kv_layers == 1 and layout.recurrent_layers == (0, 1, 2)
    assert cfg.state_bytes_per_request(4) == 3 * (96 * 3 * 4 + 4 * 16 * 8 * 4)
    assert not _model_blockers(cfg)  # the fused C step runs every piece (test_the_fused_step_...)
    engine = _engine(loaded)
    blend = r"its Gated DeltaNet layers \(layers 0, 1, 2\) keep a conv state and a linear-attention recurrent state"
    with pytest.raises(UserError, match=blend):
        engine.add_request("x", _tokens(40, 12), SamplingParams(max_tokens=1), kv_segments=[[0, 32]])
    assert main(["kv-calc", "--model", folder, "--kv-cache-dtype", "float32"]) == 0
    out = capsys.readouterr().out
    assert f"recurrent state: {cfg.state_bytes_per_request(4):,} bytes per request" in out
    # a block of 16 holds the full-attention layer's K and V: 16 x 2 x 2 heads x 16 dims x 4 bytes
    ratio = cfg.state_bytes_per_request(4) / 4096
    each = -(-cfg.state_bytes_per_request(4) // 4096)
    assert f"a checkpoint of it takes {each:,} pool blocks of their own kind (4,096 bytes each, {ratio:,.1f}x" in out
    assert "--mamba-cache-mode align: one where a prompt chunk ends at a block boundary; all: one at every block" in out


def test_a_budget_for_fewer_slots_than_max_num_seqs_runs_that_many_at_once(models):
    """Half the budget holds two states and a half: two slots, so two of the three requests run at once; all
    correct."""
    hf, loaded, _ = models["qwen3_5"]
    per_state = state_bytes(loaded.config, torch.float32)  # slots take at most half the budget
    engine = LLMEngine(
        EngineConfig(max_model_len=256, log_stats_interval=0, max_num_seqs=4, kv_cache_memory=5 * per_state),
        loaded,
    )
    assert engine.kv.recurrent.slots is not None and engine.kv.recurrent.slots.num_slots == 2
    prompts = [_tokens(40, 13), _tokens(30, 14), _tokens(50, 15)]
    assert _run(engine, prompts, 8) == [_greedy(hf, p, 8) for p in prompts]
    assert engine.scheduler.peak_running == 2
    _all_back(engine)


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """Each family with int8 weights (what the fused C step runs; a shared expert of 64 so that every matmul is
    quantized), and transformers' model of the same file."""
    out = {}
    for family in FAMILIES:
        folder = str(tmp_path_factory.mktemp(family + "-int8"))
        hf = make_hybrid(family, folder, shared_expert_intermediate_size=64)
        out[family] = hf, load_model(folder, "float32", "cpu", False, "int8", quantized_activations="none")
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_the_fused_step_computes_what_the_torch_path_does(quantized, family):
    """The fused C step (Gated DeltaNet's conv and delta rule token by token on the state slots, the attention's
    output gate) against the torch path (its chunked scan) on the same int8 weights: a prompt in two chunks (the
    state crosses the chunk end) over shuffled blocks, then 8 greedy decode tokens: the same tokens, logits within
    the tolerance."""
    _, loaded = quantized[family]
    assert not _model_blockers(loaded.config)
    got = fused_and_torch(loaded, _tokens(70, 1), 29, 8)
    (fused, fused_tokens), (want, want_tokens) = got[True], got[False]
    assert fused_tokens == want_tokens
    assert (fused - want).abs().max().item() < TOL * want.abs().max().item()


@pytest.mark.parametrize("family", FAMILIES)
def test_the_fused_step_writes_the_states_at_marks_as_the_torch_path(quantized, family):
    """Prompt chunks with prefix-cache checkpoints inside them (state marks, --mamba-cache-mode all) beside another
    sequence's marked chunk, then beside its decode token, on the fused C step (its token loop copies the state as
    it passes each mark) and on the torch path (its chunked scan's state at each mark): the same logits, and every
    mark row and slot of every Gated DeltaNet layer (conv and recurrent state) the same within the tolerance."""
    _, loaded = quantized[family]
    assert_marked_states_match(marks_fused_and_torch(loaded, _tokens(70, 1), _tokens(9, 2)), TOL)


# A prompt chunk on the fused step in a thread of a 256 KiB stack (musl's threads get 128 KiB): the chunked scan's
# ~320 KiB of scratch must come from the heap (model_step.c's per-thread Scratch), not the stack
SMALL_STACK_STEP = """
import sys, threading, torch
from pagedllm.model import ModelRunner, SeqChunk, load_model
torch.set_num_threads(1)  # the step runs on the calling thread
loaded = load_model(sys.argv[1], "float32", "cpu", False, "int8", quantized_activations="none")
runner = ModelRunner(loaded, num_blocks=8, block_size=16, fused=True, num_state_slots=2)
assert runner.fused is not None
threading.stack_size(256 * 1024)
out = []
chunk = SeqChunk(list(range(3, 83)), 0, list(range(8)), state_slot=0)
thread = threading.Thread(target=lambda: out.append(runner.execute([chunk])))
thread.start()
thread.join()
assert out and torch.isfinite(out[0]).all()
"""


def test_a_prompt_chunk_on_the_fused_step_fits_a_small_thread_stack(models):
    """An 80-token prompt chunk of Qwen3.5 (its Gated DeltaNet layers take the chunked scan) through the fused
    step in a thread whose stack is 256 KiB, in a process of its own (an overflow kills it): it finishes."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    done = subprocess.run(
        [sys.executable, "-c", SMALL_STACK_STEP, models["qwen3_5"][2]], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_fused_step_refuses_marks_it_cannot_write(quantized):
    """A mark on a row the step reads as a slot, or past the state rows, or not inside its chunk: the runner
    refuses it (both paths), and the C step itself (its own check before any state is written) refuses it
    without touching a state."""
    _, loaded = quantized["qwen3_5"]
    runner = ModelRunner(loaded, num_blocks=8, block_size=8, num_state_slots=4)
    assert runner.fused is not None
    for marks in ([(3, 1)], [(3, 4)], [(10, 2)], [(5, 2), (3, 3)]):
        chunks = [SeqChunk(_tokens(10, 1), 0, [0, 1]), SeqChunk(_tokens(6, 2), 0, [2, 3], state_marks=marks)]
        with pytest.raises(ValueError, match="state mark"):
            runner.execute(chunks)
    before = [t.clone() for pair in runner.states.values() for t in pair]
    toks = [c.token_ids for c in chunks]
    with pytest.raises(RuntimeError, match="slot or row out of range"):
        runner.fused.run(toks, [0, 0], [[[0, 1], [2, 3]]], [1, 1], state_slots=[0, 1], state_marks=[[], [(3, 0)]])
    assert all(torch.equal(a, b) for a, b in zip(before, [t for pair in runner.states.values() for t in pair]))


@pytest.mark.parametrize("target", [t for t in ("x86-64-v3", "x86-64") if t in cpu_kernel.runnable_targets()])
def test_the_recurrent_kernels_of_every_cpu_class(quantized, target):
    """recurrent.c built for AVX2 and for the portable class (the native build runs above): Qwen3.5 on the fused
    step equals the torch path on the same weights, its states at marks too."""
    _, loaded = quantized["qwen3_5"]
    with cpu_target(target):
        got = fused_and_torch(loaded, _tokens(70, 1), 29, 8)
        marked = marks_fused_and_torch(loaded, _tokens(70, 1), _tokens(9, 2))
    (fused, fused_tokens), (want, want_tokens) = got[True], got[False]
    assert fused_tokens == want_tokens
    assert (fused - want).abs().max().item() < TOL * want.abs().max().item()
    assert_marked_states_match(marked, TOL)


@pytest.mark.parametrize(
    "family,target",
    [(f, "native") for f in FAMILIES]
    + [("qwen3_5", t) for t in ("x86-64-v3", "x86-64") if t in cpu_kernel.runnable_targets()],
)
@pytest.mark.parametrize("sizes", [(100, 50), (64, 64, 22)])
def test_long_marked_prompt_chunks_on_the_fused_step_match_the_torch_path(quantized, family, target, sizes):
    """A 150-token prompt in chunks longer than the C step's 64-token scan chunk (100 + 50) and in chunked prefill
    of 64, marked at every block boundary (recurrent.c's chunked scan ends a chunk at each mark), then decode: the
    fused step's logits and every state row (slot and marks, conv and recurrent) equal the torch path's."""
    _, loaded = quantized[family]
    with cpu_target(target):
        assert_long_marked_chunks_match(loaded, _tokens(150, 6), sizes, TOL)


# The int8 route between the two paths: an input the paths compute a rounding apart can round to codes a step apart
# (1/254 of its group's largest), and the recurrence carries it on: 2.4e-4 (o only) and 2.7e-3 (o and the mixers)
# of the largest logit measured here
I8_TOL = 1e-2


def test_the_int8_route_on_the_o_projections_leaves_the_recurrent_mixers_on_theirs(tmp_path):
    """The int8 route for attention's o projections only (dot_accuracy's --int8-on o; the kind that keeps its
    accuracy there, docs/benchmarks.md, "per matmul"): the C step plans a Gated DeltaNet layer's projections
    under the qkv and o profile slots, but their route is their own (StepModel.i8_kinds' bit of no kind), so the
    fused step computes what the torch path does with the o projections alone on the route, and with the
    mixers' too; and the o projections alone are not the o slot's every matmul (the mixers' out on the route
    moves the logits ~30x the tolerance here)."""
    from pagedllm.model.fused_step import PHASES, i8_kinds

    folder = str(tmp_path / "qwen3_5")
    make_hybrid("qwen3_5", folder)
    loaded = load_model(folder, "float32", "cpu", False, "int8", quantized_activations="int8")
    net = loaded.model
    o = {id(w) for w in net.weights_by_kind()["o"]}
    mixers = {id(lin.quant) for layer in net.decoder_layers if layer.linear_attn for lin in layer.linear_attn.linears()}
    assert o and mixers and not o & mixers
    got = {}
    for name, selected, bits in (
        ("o", o, 1 << PHASES.index("o")),
        ("o and mixers", o | mixers, 1 << PHASES.index("o") | 1 << len(PHASES)),
    ):
        for w in net.quant_weights():
            w.i8_min_rows = 8 if id(w) in selected else 0
        assert i8_kinds(net) == bits, name
        paths = fused_and_torch(loaded, _tokens(70, 1), 29, 2)
        got[name] = paths[True][0], paths[False][0]
        fused, want = got[name]
        assert (fused - want).abs().max().item() < I8_TOL * want.abs().max().item(), name
    fused, want = got["o"][0], got["o and mixers"][1]
    assert (fused - want).abs().max().item() > 10 * I8_TOL * want.abs().max().item()


def _never(*args, **kwargs):
    raise AssertionError("a step ran on the torch path")


@pytest.mark.parametrize("mode", ["align", "all"])
def test_the_fused_step_under_the_engine_keeps_every_answer(quantized, mode, monkeypatch):
    """Batched requests through the engine on the fused step, with chunked prefill (64 tokens a step), a cache
    small enough to preempt, and prefix caching hitting at state checkpoints: every answer equals the torch path's
    on the same weights, and every slot and block comes back. Under --mamba-cache-mode all the steps whose prompt
    chunks leave states inside them (marks) run on the fused step too: the torch model never runs there."""
    _, loaded = quantized["qwen3_5"]
    shared = _tokens(64, 7)
    prompts = [_tokens(150, 2), _tokens(100, 3), _tokens(120, 4), shared + _tokens(30, 8), shared + _tokens(20, 9)]
    answers = {}
    for fused in (True, False):
        engine = _engine(loaded, blocks=16, max_num_batched_tokens=64, mamba_cache_mode=mode)
        assert (engine.runner.fused is not None) is True
        if not fused:
            engine.runner.fused = None
        with monkeypatch.context() as patch:
            if fused:  # what the torch path calls (the loaded model is the fixture's: put back after the run)
                patch.setattr(engine.runner.model, "forward", _never)
            answers[fused] = _run(engine, prompts[:3]) + [_run(engine, [p])[0] for p in prompts[3:]]
        assert engine.stats().num_preemptions > 0 and engine.stats().prefix_cache_hits >= 64
        _all_back(engine)
    assert answers[True] == answers[False]


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_the_released_multimodal_layout_loads_as_its_text_model(tmp_path, family):
    """Qwen3.5's checkpoints are `Qwen3_5ForConditionalGeneration` (a `text_config`, the language model under
    `model.language_model.`, a vision tower): the text model's logits are transformers' for a text prompt; the
    MoE's also from its state dict's 3-D expert tensors under that prefix."""
    import transformers

    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4)
    moe = family == "qwen3_5_moe"
    text = {k: v for k, v in _SHAPE.items() if k != "intermediate_size"} | _MOE if moe else dict(_SHAPE)
    prefix = "Qwen3_5Moe" if moe else "Qwen3_5"
    config = getattr(transformers, f"{prefix}Config")(text_config=text, vision_config=vision)
    torch.manual_seed(3)
    hf = getattr(transformers, f"{prefix}ForConditionalGeneration")(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name and "linear_attn" not in name:
                p.uniform_(-0.3, 0.3)
            elif "norm" not in name:
                p.normal_(0, 0.3)
    folder = str(tmp_path / "hf")
    hf.save_pretrained(folder, safe_serialization=True)
    save_tiny_tokenizer(folder, 256)
    folders = [folder]
    if moe:
        from moe_helpers import save_fused

        save_fused(hf, folder + "-3d", folder)
        folders.append(folder + "-3d")
    ids = _tokens(70, 17)
    with torch.no_grad():
        want = hf(input_ids=torch.tensor([ids])).logits[0]
    for path in folders:
        loaded = load_model(path, "float32", "cpu")
        assert loaded.config.family == family and loaded.config.linear_layers == [0, 1, 2]
        got = ModelRunner(loaded, 8, 16).execute([SeqChunk(ids, 0, list(range(8)), True)])
        assert (got - want).abs().max().item() < TOL * want.abs().max().item(), path
