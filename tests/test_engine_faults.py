"""One request's failure fails that request alone, and a failed step never poisons the prefix cache.

Faults are injected where they happen in real life: the model's forward pass (a bug, an out-of-memory error,
Ctrl-C) and sampling. Every value that validation accepts must sample; every request that is refused must
leave nothing queued.
"""

from __future__ import annotations

import random

import pytest
import torch
from engine_helpers import assert_all_blocks_free, kv_budget, make_engine

from pagedllm import LLM, SamplingParams
from pagedllm.engine import fault_isolation, llm_engine
from pagedllm.engine.blend import segment_store
from pagedllm.sampling_params import SamplingParamsError

POISON = 4242  # a token id that makes the injected model failure fire
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(model_fp32):
    rng = random.Random(7)
    vocab = model_fp32.config.vocab_size
    return [[rng.randrange(300, vocab) for _ in range(rng.randrange(20, 70))] for _ in range(4)]


@pytest.fixture(scope="module")
def alone(model_fp32, prompts):
    return [run(make_engine(model_fp32), [p])[0].token_ids for p in prompts]


def run(engine, prompts, params=GREEDY) -> dict[str, object]:
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    done = {}
    for _ in range(1000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
    return [done[str(i)] for i in range(len(prompts))]


def fail_forward(monkeypatch, engine, should_fail, exc=RuntimeError("injected model failure")) -> list[int]:
    """Make the model's forward raise whenever should_fail(input_ids, call number) says so; returns the calls.
    The forward pass is the fused C step for a quantized model (the default) and the torch module otherwise."""
    fused = engine.runner.fused
    target, name = (fused, "run") if fused is not None else (engine.runner.model, "forward")
    original = getattr(target, name)
    calls = []

    def forward(*args, **kwargs):
        calls.append(len(calls))
        ids = torch.tensor([t for seq in args[0] for t in seq]) if fused is not None else args[0]
        if should_fail(ids, len(calls) - 1):
            raise exc
        return original(*args, **kwargs)

    monkeypatch.setattr(target, name, forward)
    return calls


def test_a_request_failing_in_the_model_fails_alone(model_fp32, prompts, alone, monkeypatch):
    engine = make_engine(model_fp32)
    fail_forward(monkeypatch, engine, lambda ids, _: bool((ids == POISON).any()))
    bad = prompts[1][:10] + [POISON] + prompts[1][10:]
    outs = run(engine, [prompts[0], bad, prompts[2], prompts[3]])
    assert outs[1].finish_reason == "error" and "injected model failure" in outs[1].error
    assert [o.token_ids for i, o in enumerate(outs) if i != 1] == [alone[0], alone[2], alone[3]]
    assert all(o.finish_reason == "length" for i, o in enumerate(outs) if i != 1)
    assert_all_blocks_free(engine)


def test_a_request_failing_in_sampling_fails_alone(model_fp32, prompts, alone, monkeypatch):
    engine = make_engine(model_fp32)
    real_sample = fault_isolation.sample

    def sample(logits, rows):
        if any(r.params.seed == 666 for r in rows):
            raise RuntimeError("injected sampling failure")
        return real_sample(logits, rows)

    monkeypatch.setattr(fault_isolation, "sample", sample)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, GREEDY)
    engine.add_request("seeded", prompts[0], SamplingParams(seed=666, max_tokens=8))
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.outputs[0] for o in engine.step() if o.finished})
    assert done["seeded"].finish_reason == "error" and "injected sampling failure" in done["seeded"].error
    assert [done[str(i)].token_ids for i in range(4)] == alone
    assert_all_blocks_free(engine)


def test_a_failed_step_does_not_poison_the_prefix_cache(model_fp32, prompts, monkeypatch):
    """Ctrl-C in the middle of a prefill: the blocks the step registered were never written, so the same prompt
    later must be computed, not served from the cache, and give a fresh engine's answer."""
    prompt = prompts[0] * 3  # > 7 full blocks
    fresh = run(make_engine(model_fp32), [prompt])[0].token_ids
    llm = LLM(loaded=model_fp32, kv_cache_memory=64 * 2**20, max_model_len=1024, log_stats_interval=0)
    fail_forward(monkeypatch, llm.engine, lambda ids, call: call == 0, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        llm.generate([prompt], GREEDY, use_tqdm=False)
    assert_all_blocks_free(llm.engine)
    out = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 0
    assert out.outputs[0].token_ids == fresh


def test_a_step_that_fails_once_is_retried_and_its_blocks_cached_once_written(model_fp32, prompts, monkeypatch):
    prompt = prompts[0] * 3
    fresh = run(make_engine(model_fp32), [prompt])[0].token_ids
    engine = make_engine(model_fp32)
    calls = fail_forward(monkeypatch, engine, lambda ids, call: call == 0)
    first = run(engine, [prompt])[0]
    assert first.token_ids == fresh and first.finish_reason == "length"
    assert len(calls) > 8  # the failed call, its retry, the decode steps
    engine.add_request("again", prompt, GREEDY)
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    assert outs[0].num_cached_tokens == (len(prompt) - 1) // 16 * 16
    assert outs[0].outputs[0].token_ids == fresh
    assert_all_blocks_free(engine)


def test_a_sharer_of_a_block_whose_writer_failed_is_recomputed(model_fp32, prompts, monkeypatch):
    """n=2 in one step: the second sample shares the prompt blocks the first registered. If the first fails in
    the model, the second must not read the blocks it never wrote."""
    prompt = prompts[2] * 2 + [POISON]
    engine = make_engine(model_fp32)
    state = {"poisoned": 0}

    def should_fail(ids, _):
        # The batch holds both samples' prefills: fail it, then fail the first sample alone once.
        if bool((ids == POISON).any()) and state["poisoned"] < 2:
            state["poisoned"] += 1
            return True
        return False

    fail_forward(monkeypatch, engine, should_fail)
    engine.add_request("n2", prompt, SamplingParams(n=2, temperature=0, max_tokens=6, ignore_eos=True))
    final = None
    while engine.has_unfinished_requests():
        final = next((o for o in engine.step() if o.finished), final)
    reasons = sorted(c.finish_reason for c in final.outputs)
    assert reasons == ["error", "length"]
    fresh = run(make_engine(model_fp32), [prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert next(c for c in final.outputs if c.finish_reason == "length").token_ids == fresh[0].token_ids
    assert engine.stats().num_preemptions == 1  # the sharer went back to be recomputed
    assert_all_blocks_free(engine)


@pytest.mark.parametrize(
    "params",
    [
        dict(temperature=1e-300),
        dict(temperature=1e-45),
        dict(temperature=5e-324),
        dict(repetition_penalty=1e-300),
        dict(repetition_penalty=1e-300, temperature=0),
        dict(top_p=1e-300, temperature=1.0),
        dict(top_k=2**31 - 1),
        dict(seed=2**64 - 1, n=2),
        dict(min_p=1.0, temperature=3.0),
        dict(logit_bias={5: 100.0, 6: -100.0}),
    ],
    ids=str,
)
def test_every_value_validation_accepts_samples(model_fp32, prompts, params):
    engine = make_engine(model_fp32)
    engine.add_request("r", prompts[0], SamplingParams(max_tokens=4, ignore_eos=True, **params))
    final = None
    while engine.has_unfinished_requests():
        final = next((o for o in engine.step() if o.finished), final)
    assert [c.finish_reason for c in final.outputs] == ["length"] * params.get("n", 1)
    assert_all_blocks_free(engine)


@pytest.mark.parametrize(
    "params, param",
    [
        (dict(top_k=2**70), "top_k"),
        (dict(seed=2**64), "seed"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=0), "top_p"),
        (dict(logit_bias={1: 1e9}), "logit_bias"),
        (dict(max_tokens=-1), "max_tokens"),
        (dict(prompt_logprobs=21), "prompt_logprobs"),
        (dict(max_tokens=None, min_tokens=2**70), "min_tokens"),
    ],
)
def test_values_that_cannot_sample_are_refused_naming_the_field(params, param):
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(**params)
    assert e.value.param == param


@pytest.mark.parametrize(
    "params, param",
    [
        (dict(max_tokens=None, min_tokens=2000), "min_tokens"),
        (dict(logit_bias={10**6: 1.0}), "logit_bias"),
        (dict(stop_token_ids=[10**6]), "stop_token_ids"),
    ],
)
def test_the_engine_refuses_what_the_model_cannot_do_and_queues_nothing(model_fp32, prompts, params, param):
    engine = make_engine(model_fp32)
    with pytest.raises(SamplingParamsError) as e:
        engine.add_request("r", prompts[0], SamplingParams(**params))
    assert e.value.param == param
    assert not engine.has_unfinished_requests() and not engine.requests
    assert_all_blocks_free(engine)


def test_a_failed_add_leaves_nothing_behind(model_fp32, prompts, monkeypatch):
    engine = make_engine(model_fp32)
    real_init = llm_engine.Request.__init__

    def init(self, request_id, parent_id, index, *args, **kwargs):
        if index == 1:
            raise ValueError("injected: the second sample cannot be built")
        real_init(self, request_id, parent_id, index, *args, **kwargs)

    monkeypatch.setattr(llm_engine.Request, "__init__", init)
    with pytest.raises(ValueError):
        engine.add_request("n2", prompts[0], SamplingParams(n=2, max_tokens=300, ignore_eos=True))
    assert not engine.requests and not engine.parents and not engine.scheduler.waiting
    engine.step()
    assert_all_blocks_free(engine)


def test_preemption_counts_each_prompt_token_and_each_lookup_once(model_fp32, prompts):
    budget = kv_budget(12)  # 12 blocks of 16: four requests of ~4 blocks must preempt
    engine = make_engine(model_fp32, kv_cache_memory=budget, max_model_len=256)
    outs = run(engine, prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    stats = engine.stats()
    assert stats.num_preemptions > 0 and all(o.finish_reason == "length" for o in outs)
    assert stats.prefix_cache_queries == sum(len(p) for p in prompts)
    assert stats.prompt_tokens == sum(len(p) for p in prompts) - stats.prefix_cache_hits


def test_logit_bias_moves_the_greedy_choice(model_fp32, prompts):
    plain = run(make_engine(model_fp32), [prompts[0]])[0].token_ids
    forced = run(
        make_engine(model_fp32), [prompts[0]], SamplingParams(temperature=0, max_tokens=4, logit_bias={77: 100.0})
    )[0].token_ids
    assert forced == [77] * 4
    banned = run(
        make_engine(model_fp32),
        [prompts[0]],
        SamplingParams(temperature=0, max_tokens=8, logit_bias={plain[0]: -100.0}),
    )[0].token_ids
    assert banned[0] != plain[0]


def test_max_tokens_zero_scores_the_prompt_and_prompt_logprobs_agree_with_decoding(model_fp32, prompts):
    """The logprob of a generated token, and the same token's prompt logprob when the text is scored again,
    come from two paths (a decode step and a chunked prefill of every position): they must agree."""
    gen = run(
        make_engine(model_fp32), [prompts[0]], SamplingParams(temperature=0, max_tokens=8, logprobs=0, ignore_eos=True)
    )[0]
    text = prompts[0] + gen.token_ids
    engine = make_engine(model_fp32, max_num_batched_tokens=16)  # the scored prompt is prefilled in chunks
    engine.add_request("warm", text, GREEDY)  # its blocks are in the cache: scoring must not read them
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request("score", text, SamplingParams(max_tokens=0, prompt_logprobs=3))
    final = None
    while engine.has_unfinished_requests():
        final = next((o for o in engine.step() if o.finished), final)
    assert final.outputs[0].token_ids == [] and final.outputs[0].finish_reason == "length"
    assert final.num_cached_tokens == 0
    lps = final.prompt_logprobs
    assert len(lps) == len(text) and lps[0] is None
    assert all(text[i] in lps[i] and len(lps[i]) <= 4 for i in range(1, len(text)))
    scored = [lps[len(prompts[0]) + j][t] for j, t in enumerate(gen.token_ids)]
    generated = [gen.logprobs[j][t] for j, t in enumerate(gen.token_ids)]
    assert torch.allclose(torch.tensor(scored), torch.tensor(generated), atol=1e-4)
    assert_all_blocks_free(engine)


# ---- kv_blend (reused passages) through the same faults -------------------------------------------------


def blend_prompt(order: list[int], seed: int = 3) -> tuple[list[int], list[tuple[int, int]]]:
    """A system prompt, three passages of 40-70 random tokens in `order`, a question; the passages' spans."""
    rng = random.Random(seed)
    system, question = [rng.randrange(300, 4000) for _ in range(12)], [rng.randrange(300, 4000) for _ in range(9)]
    passages = [[rng.randrange(300, 4000) for _ in range(40 + 15 * i)] for i in range(3)]
    ids, spans = list(system), []
    for i in order:
        spans.append((len(ids), len(ids) + len(passages[i])))
        ids += passages[i]
    return ids + question, spans


def run_blend(engine, rid: str, order: list[int]):
    ids, spans = blend_prompt(order)
    engine.add_request(rid, ids, GREEDY, kv_segments=spans, kv_blend_recompute=0.0)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished and out.request_id == rid:
                return out
    raise AssertionError("the request never finished")


def test_a_blend_step_that_fails_is_retried_and_stores_only_what_it_wrote(model_fp32, monkeypatch):
    """The step that computes (and then stores) a request's passages fails once: the retry stores them, and a
    reordered prompt that copies them gets what it gets on an engine that never failed."""
    fresh = make_engine(model_fp32, speculative_config=None)
    want = [run_blend(fresh, "a", [0, 1, 2]), run_blend(fresh, "b", [2, 0, 1])]
    engine = make_engine(model_fp32, speculative_config=None)
    fail_forward(monkeypatch, engine, lambda ids, call: call == 0)
    got = [run_blend(engine, "a", [0, 1, 2]), run_blend(engine, "b", [2, 0, 1])]
    assert got[1].num_blend_tokens == want[1].num_blend_tokens > 0
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert all(o.outputs[0].finish_reason == "length" for o in got)
    assert_all_blocks_free(engine)
    assert not any(segment_store(engine.kv).holds.values())


def test_ctrl_c_in_a_blend_prefill_stores_no_passage_and_leaks_nothing(model_fp32, monkeypatch):
    """Ctrl-C in the first forward of a request whose passages are new, then its abort: no block, hold or stored
    passage is left, so the next prompt with those passages computes them (copies none) and gets a fresh
    engine's answer."""
    fresh = run_blend(make_engine(model_fp32, speculative_config=None), "b", [2, 0, 1])
    engine = make_engine(model_fp32, speculative_config=None)
    fail_forward(monkeypatch, engine, lambda ids, call: call == 0, KeyboardInterrupt())
    ids, spans = blend_prompt([0, 1, 2])
    engine.add_request("a", ids, GREEDY, kv_segments=spans, kv_blend_recompute=0.0)
    with pytest.raises(KeyboardInterrupt):
        while engine.has_unfinished_requests():
            engine.step()
    engine.abort_request("a")
    assert_all_blocks_free(engine)
    assert not any(segment_store(engine.kv).holds.values())
    after = run_blend(engine, "b", [2, 0, 1])
    assert after.num_blend_tokens == 0
    assert after.outputs[0].token_ids == fresh.outputs[0].token_ids


def test_passages_on_disk_from_another_kv_dtype_are_never_copied(model_fp32, tmp_path):
    """The disk tier holds passages stored by an engine with a float32 KV cache; an int8 engine on the same
    folder copies none of them (it computes, and answers as a fresh int8 engine does), while a restarted
    float32 engine copies them all."""
    first = make_engine(model_fp32, speculative_config=None, kv_offload_dir=str(tmp_path))
    run_blend(first, "a", [0, 1, 2])
    in_ram = run_blend(first, "b", [2, 0, 1])
    first.disk_tier.flush()
    other = make_engine(model_fp32, speculative_config=None, kv_offload_dir=str(tmp_path), kv_cache_dtype="int8")
    got = run_blend(other, "b", [2, 0, 1])
    fresh = run_blend(make_engine(model_fp32, speculative_config=None, kv_cache_dtype="int8"), "b", [2, 0, 1])
    assert got.num_blend_tokens == 0 and got.outputs[0].token_ids == fresh.outputs[0].token_ids
    same = make_engine(model_fp32, speculative_config=None, kv_offload_dir=str(tmp_path))
    again = run_blend(same, "b", [2, 0, 1])
    assert again.num_blend_tokens == in_ram.num_blend_tokens > 0
    assert again.outputs[0].token_ids == in_ram.outputs[0].token_ids
    for e in (first, other, same):
        assert_all_blocks_free(e)
