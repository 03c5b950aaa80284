"""The engine: batching must not change greedy answers; every block comes back; n samples share the prompt."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from engine_helpers import assert_all_blocks_free, kv_budget, make_engine, run_all
from model_helpers import all_logits

from pagedllm import LLM, SamplingParams
from pagedllm.engine import EngineConfig, LLMEngine
from pagedllm.errors import UserError

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


@pytest.fixture(scope="module")
def prompts(model_fp32):
    rng = random.Random(0)
    vocab = model_fp32.config.vocab_size
    stem = [rng.randrange(200, vocab) for _ in range(40)]  # some prompts share a prefix: the cache gets used
    out = []
    for i in range(32):
        n = rng.randrange(5, 60)
        body = [rng.randrange(200, vocab) for _ in range(n)]
        out.append(stem + body if i % 4 == 0 else body)
    return out


@pytest.fixture(scope="module")
def alone(model_fp32, prompts):
    engine = make_engine(model_fp32)
    return [run_all(engine, [p])[0] for p in prompts]


@pytest.mark.parametrize(
    "settings",
    [
        {},
        {"enable_prefix_caching": False},
        {"max_num_batched_tokens": 32},
        {"kv_allocation": "contiguous", "max_model_len": 256, "kv_cache_memory": 256 * 2**20},
        {"kv_cache_memory": kv_budget(40), "max_model_len": 256},  # 40 blocks: must preempt
        {"speculative_config": SPEC},
        {"speculative_config": SPEC, "kv_cache_memory": kv_budget(40), "max_model_len": 256},
        {
            "speculative_config": SPEC,
            "kv_allocation": "contiguous",
            "max_model_len": 256,
            "kv_cache_memory": 256 * 2**20,
        },
    ],
    ids=[
        "default",
        "no-prefix-caching",
        "chunked-prefill-32",
        "contiguous",
        "preemption",
        "spec",
        "spec-preemption",
        "spec-contiguous",
    ],
)
def test_batched_greedy_equals_alone(model_fp32, prompts, alone, settings):
    engine = make_engine(model_fp32, **settings)
    together = run_all(engine, prompts)
    assert together == alone
    assert_all_blocks_free(engine)
    if "speculative_config" in settings:  # random prompts: few drafts match, but some do
        assert 0 < engine.stats().spec_decode_num_accepted_tokens < engine.stats().spec_decode_num_draft_tokens
    stats = engine.stats()
    if settings.get("kv_cache_memory") == kv_budget(40):  # the preemption cases
        assert engine.kv.num_blocks == 40
        assert stats.num_preemptions > 0
    if settings.get("max_num_batched_tokens") == 32:
        assert stats.num_steps > sum(len(p) for p in prompts) // 32  # prompts were prefilled in chunks
    if not settings:
        assert stats.prefix_cache_hits > 0


def test_abort_mid_prefill_and_mid_decode_frees_everything(model_fp32):
    engine = make_engine(model_fp32, max_num_batched_tokens=16)
    engine.add_request("long", list(range(300, 400)), SamplingParams(temperature=0, max_tokens=50))
    engine.add_request("short", list(range(500, 505)), SamplingParams(temperature=0, max_tokens=50))
    engine.add_request("queued", list(range(600, 610)), SamplingParams(temperature=0, max_tokens=50))
    engine.step()
    assert engine.kv.get_block_ids("long#0")  # prefill started, not finished (100 tokens, 16 per step)
    assert engine.scheduler.running[0].num_computed_tokens < 100
    engine.abort_request("long")
    for _ in range(3):
        engine.step()
    short = engine.requests["short#0"]
    assert short.num_output_tokens > 0  # mid-decode
    engine.abort_request("short")
    engine.abort_request("queued")
    engine.abort_request("unknown")  # no-op
    assert not engine.has_unfinished_requests()
    assert_all_blocks_free(engine)


def test_n_samples_hold_the_prompt_blocks_once(model_fp32):
    engine = make_engine(model_fp32, block_size=16)
    prompt = list(range(1000, 1064))  # 4 full blocks
    engine.add_request("n4", prompt, SamplingParams(n=4, temperature=1.0, seed=1, max_tokens=20, ignore_eos=True))
    engine.step()  # all four admitted in one step
    tables = [engine.kv.get_block_ids(f"n4#{i}") for i in range(4)]
    assert all(t[:3] == tables[0][:3] for t in tables)  # the 3 full blocks before the last prompt token: shared
    held = {b for t in tables for b in t}
    assert len(held) == 3 + 4  # the shared prefix once; each sample its own block with the last prompt token
    engine.step()  # the first sampled token of each goes into a new block of its own
    held = {b for i in range(4) for b in engine.kv.get_block_ids(f"n4#{i}")}
    assert len(held) == 3 + 4 * 2 and engine.kv.num_used_blocks == 11
    outs = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs = out
    assert outs.finished and len(outs.outputs) == 4
    assert len({tuple(o.token_ids) for o in outs.outputs}) > 1  # different seeds, different samples
    assert_all_blocks_free(engine)


def test_request_too_big_for_the_whole_cache_fails_alone_and_others_finish(model_fp32):
    engine = make_engine(model_fp32, kv_cache_memory=kv_budget(4), max_model_len=512)  # 4 blocks
    engine.add_request("big", list(range(300, 400)), SamplingParams(temperature=0, max_tokens=4))
    engine.add_request("small", list(range(300, 310)), SamplingParams(temperature=0, max_tokens=4))
    done = {}
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
    assert done["big"].finish_reason == "error" and "KV" in done["big"].error
    assert done["small"].finish_reason == "length" and len(done["small"].token_ids) == 4
    assert_all_blocks_free(engine)


def test_bad_input_is_rejected_before_queueing(model_fp32):
    engine = make_engine(model_fp32, max_model_len=64)
    with pytest.raises(UserError, match="64"):
        engine.add_request("x", list(range(100, 200)))
    with pytest.raises(UserError, match="empty"):
        engine.add_request("x", [])
    with pytest.raises(UserError, match="token ids"):
        engine.add_request("x", [10**9])
    for bad in (
        {"temperature": -1},
        {"top_p": 0},
        {"top_p": 1.5},
        {"max_tokens": -1},
        {"n": 0},
        {"top_k": -5},
        {"logprobs": 100},
        {"min_tokens": 5, "max_tokens": 2},
    ):
        with pytest.raises(UserError, match=next(iter(bad))):
            SamplingParams(**bad)
    assert not engine.has_unfinished_requests()
    assert_all_blocks_free(engine)


def test_llm_api_generate_and_chat_with_metrics(model_fp32):
    llm = LLM(loaded=model_fp32, kv_cache_memory=64 * 2**20, max_model_len=1024)
    system = "You are a helpful assistant. " * 8
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": "Say hi."}]
    first = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=8))[0]
    second = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=8))[0]
    assert first.outputs[0].text == second.outputs[0].text and first.outputs[0].text
    assert first.num_cached_tokens == 0 and second.num_cached_tokens >= 16
    m = second.metrics
    assert m.queue_time >= 0 and m.ttft >= m.queue_time and m.e2e >= m.ttft
    outs = llm.generate(
        ["Hello", "The capital of France is"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False
    )
    assert [o.prompt for o in outs] == ["Hello", "The capital of France is"]
    assert all(o.outputs[0].finish_reason in ("stop", "length") for o in outs)


def run_one(engine: LLMEngine, rid: str, prompt, params) -> tuple[list, object]:
    """All intermediate outputs of one request, and the final one."""
    engine.add_request(rid, prompt, params)
    seen = []
    while engine.has_unfinished_requests():
        seen += [o for o in engine.step() if o.request_id == rid]
    return seen, seen[-1]


def test_stop_string_ends_the_text_before_it_and_never_streams_it(model_fp32):
    engine = make_engine(model_fp32)
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Count from one to ten in words."}])
    _, full = run_one(engine, "a", prompt, SamplingParams(temperature=0, max_tokens=40))
    text = full.outputs[0].text
    assert len(text) > 12
    stop = text[8:12]
    seen, out = run_one(engine, "b", prompt, SamplingParams(temperature=0, max_tokens=40, stop=[stop]))
    first = text.index(stop)
    assert out.outputs[0].text == text[:first]
    assert (out.outputs[0].finish_reason, out.outputs[0].stop_reason) == ("stop", stop)
    assert all(stop not in o.outputs[0].text for o in seen)
    sent = [o.outputs[0].text for o in seen]
    assert all(b.startswith(a) for a, b in zip(sent, sent[1:]))  # streamed text only grows
    assert_all_blocks_free(engine)


def test_seeded_sampling_is_the_same_in_any_batch_mix(model_fp32):
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=12, ignore_eos=True)
    noise = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    prompt = list(range(2000, 2030))
    engine = make_engine(model_fp32)
    alone = run_all(engine, [prompt], params)[0]
    engine.add_request("x1", list(range(3000, 3050)), noise)
    engine.add_request("x2", list(range(4000, 4007)), noise)
    mixed = run_all(engine, [prompt], params)[0]
    assert mixed == alone and len(alone) == 12


def test_min_tokens_and_stop_token_ids(model_fp32):
    engine = make_engine(model_fp32)
    prompt = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 2? Answer with the number only."}]
    )
    _, out = run_one(engine, "a", prompt, SamplingParams(temperature=0, max_tokens=24))
    natural = out.outputs[0].token_ids
    assert out.outputs[0].finish_reason == "stop" and natural[-1] in engine.tokenizer.eos_token_ids
    _, longer = run_one(engine, "b", prompt, SamplingParams(temperature=0, max_tokens=24, min_tokens=len(natural) + 3))
    assert len(longer.outputs[0].token_ids) >= len(natural) + 3
    stop_id = natural[1]
    _, cut = run_one(engine, "c", prompt, SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_id]))
    assert cut.outputs[0].token_ids == natural[:2] and cut.outputs[0].stop_reason == stop_id


def test_a_stop_tokens_text_is_never_in_the_output(model_fp32):
    """vLLM's rule: the token that stopped a request (EOS, one of stop_token_ids) adds no text, with
    skip_special_tokens off too (so a parser reading special tokens never sees EOS), streamed and whole; a
    special token that did not stop it is kept."""
    engine = make_engine(model_fp32)
    tok = engine.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 2? Answer with the number only."}])
    keep = SamplingParams(temperature=0, max_tokens=24, skip_special_tokens=False)
    seen, out = run_one(engine, "a", prompt, keep)
    natural = out.outputs[0].token_ids
    assert natural[-1] in tok.eos_token_ids and out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].text == tok.decode(natural[:-1], skip_special_tokens=False) != ""
    assert all(tok.decode([natural[-1]], skip_special_tokens=False) not in o.outputs[0].text for o in seen)
    _, cut = run_one(engine, "b", prompt, replace(keep, stop_token_ids=[natural[1]]))
    assert cut.outputs[0].token_ids == natural[:2] and cut.outputs[0].text == tok.decode(natural[:1])
    _, ignored = run_one(engine, "c", prompt, replace(keep, ignore_eos=True, max_tokens=len(natural)))
    assert ignored.outputs[0].text == tok.decode(natural, skip_special_tokens=False)  # EOS that did not stop it
    assert_all_blocks_free(engine)


def test_incremental_detokenizer_never_emits_half_a_character(model_fp32):
    from pagedllm.engine.detokenizer import IncrementalDetokenizer

    tok = model_fp32.tokenizer
    text = "KV 캐시를 쪽으로 나눠 잡기 🚀🙂 naïve café — ok"
    ids = tok.encode(text)
    assert len(ids) > len(text.split())  # byte-level pieces: characters span several tokens
    detok = IncrementalDetokenizer(tok, tok.encode("Hello"))
    deltas = [detok.add(t) for t in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tok.decode(ids)


def test_gpu_memory_utilization_sizes_the_cache_after_weights_and_warmup(model_fp32, monkeypatch):
    import psutil

    rss = psutil.Process().memory_info().rss
    total = psutil.virtual_memory().total
    # A share that leaves ~256 MiB above what this process already holds (weights included).
    share = (rss + 256 * 2**20) / total
    engine = make_engine(model_fp32, kv_cache_memory=None, gpu_memory_utilization=share, max_num_batched_tokens=64)
    per_block = engine.runner.bytes_per_block
    assert 0 < engine.kv.num_blocks * per_block <= 256 * 2**20
    with pytest.raises(UserError, match="--gpu-memory-utilization"):
        make_engine(model_fp32, kv_cache_memory=None, gpu_memory_utilization=rss / total / 2)


def test_bfloat16_kv_cache_holds_twice_the_tokens_and_keeps_the_answers(model_fp32, prompts):
    """--kv-cache-dtype bfloat16 on a float32 model: the same budget gives twice the blocks, stored in bfloat16,
    and the next-token choices stay those of the float32 cache (K/V rounding to bf16 is small next to logit gaps)."""
    import torch

    from pagedllm.model import SeqChunk

    f32 = make_engine(model_fp32)
    b16 = make_engine(model_fp32, kv_cache_dtype="bfloat16")
    assert b16.kv.num_blocks == 2 * f32.kv.num_blocks
    assert all(k.dtype == v.dtype == torch.bfloat16 for k, v in b16.runner.kv_caches)
    chunks = [SeqChunk(p, 0, list(range(1 + 8 * i, 1 + 8 * i + 8))) for i, p in enumerate(prompts[:6])]
    ref = torch.cat(all_logits(f32.runner, chunks))
    got = torch.cat(all_logits(b16.runner, chunks))
    agree = (ref.argmax(-1) == got.argmax(-1)).float().mean().item()
    assert agree >= 0.95 and (ref - got).abs().max().item() < 1.0
    assert run_all(b16, prompts[:8]) and not b16.kv.req_blocks
    assert_all_blocks_free(b16)
    with pytest.raises(UserError, match="--kv-cache-dtype"):
        EngineConfig(kv_cache_dtype="fp4")


def test_stacked_views_rows_that_lie_back_to_back_and_copies_others():
    """The engine's batch of logits rows: one view of the runner's buffer when the requests' rows are consecutive
    slices of it, a copy when they are not (reordered, or from separate buffers), with the same values."""
    import torch

    from pagedllm.engine.llm_engine import stacked

    buf = torch.randn(7, 5)
    parts = [buf[0:2], buf[2:3], buf[3:7]]
    view = stacked(parts)
    assert view.shape == (7, 5) and view.data_ptr() == buf.data_ptr() and torch.equal(view, buf)
    one = stacked([buf[4:5]])
    assert one.data_ptr() == buf[4].data_ptr() and torch.equal(one, buf[4:5])
    reordered, gap, apart, columns = (
        [buf[3:7], buf[0:2]],
        [buf[0:2], buf[3:4]],
        [buf[0:2], torch.randn(3, 5)],
        [buf[:, :2], buf[:, 2:4]],
    )
    for others in (reordered, gap, apart, columns):
        got = stacked(others)
        assert got.data_ptr() != buf.data_ptr() and torch.equal(got, torch.cat(others))
