"""Speculative decoding by n-gram prompt lookup: the drafter, the config, and the engine keeping its outputs.

Greedy outputs must equal those without speculation token for token (RAG prompts that quote their context, where
drafts are accepted often); random sampling must keep the model's distribution (a tiny random checkpoint with an
8-token vocabulary, exact probabilities from transformers, chi-square) and seeded requests their exact tokens;
the KV pool must be whole after every request, through preemption, aborts and failed steps.
"""

from __future__ import annotations

import pytest
import torch
from engine_helpers import assert_all_blocks_free, make_engine
from rag_eval_questions import EVAL_QUESTIONS

from pagedllm import SamplingParams
from pagedllm.engine.config import EngineConfig
from pagedllm.engine.spec_decode import SpecDecodeStats, SpeculativeConfig, ngram_draft, num_accepted
from pagedllm.errors import UserError
from pagedllm.model.runner import bytes_per_block

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}


# ---------------------------------------------------------------- the drafter and the config


def test_ngram_draft_takes_the_longest_then_most_recent_match():
    #         0  1  2  3  4  5  6  7  8  9 10 11
    tokens = [1, 2, 3, 9, 8, 2, 3, 7, 6, 5, 2, 3]
    # "2 3" occurs at 1-2 and 5-6; "x 2 3" nowhere earlier: the most recent "2 3" wins
    assert ngram_draft(tokens, 3, 1, 4) == [7, 6, 5]
    # a longer match beats a more recent one: "1 2 3" at 0-2 vs "2 3" at 5-6
    assert ngram_draft([1, 2, 3, 4, 2, 3, 5, 1, 2, 3], 2, 1, 4) == [4, 2]
    assert ngram_draft([1, 2, 3, 4, 2, 3, 5, 1, 2, 3], 2, 1, 2) == [5, 1]  # max 2: "2 3" at 4-5 is as long, later
    assert ngram_draft(tokens, 3, 3, 4) == []  # nothing of length 3 matches
    assert ngram_draft([4, 5, 6, 4], 9, 1, 4) == [5, 6, 4]  # as many as there are
    assert ngram_draft([4, 5, 6, 4], 0, 1, 4) == [] and ngram_draft([1, 2, 3], 3, 1, 4) == []


def test_speculative_config_follows_vllm_and_names_the_flag():
    cfg = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}')
    assert (cfg.num_speculative_tokens, cfg.prompt_lookup_max, cfg.prompt_lookup_min) == (3, 4, 4)
    assert SpeculativeConfig.parse({"num_speculative_tokens": 2}).prompt_lookup_min == 5
    assert EngineConfig(speculative_config=None).speculative_config is None
    for bad, words in [
        ("{oops", "JSON"),
        ("[4]", "JSON object"),
        ('{"method": "eagle", "num_speculative_tokens": 2}', "eagle"),
        ('{"method": "ngram"}', "num_speculative_tokens"),
        ('{"num_speculative_tokens": 0}', "positive"),
        ('{"num_speculative_tokens": 2, "k": 1}', "unknown"),
        ('{"num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2}', "<="),
    ]:
        with pytest.raises(UserError, match="--speculative-config") as e:
            EngineConfig(speculative_config=bad)
        assert words in str(e.value)


def test_the_cli_default_is_prompt_lookup_on_a_cpu_and_none_turns_it_off():
    from pagedllm.engine.spec_decode import CPU_DEFAULT
    from pagedllm.entrypoints.cli import build_parser

    for command in (["serve"], ["generate", "hi"], ["bench", "throughput"]):
        config = EngineConfig.from_args(build_parser().parse_args(command))
        assert config.speculative_config == SpeculativeConfig(**CPU_DEFAULT), command
    for off in ("none", "off", "", "None"):
        assert (
            EngineConfig.from_args(build_parser().parse_args(["serve", "--speculative-config", off])).speculative_config
            is None
        )
    assert EngineConfig().speculative_config is None  # the Python API is opt-in, as vLLM's LLM(...)
    assert EngineConfig(speculative_config="auto", device="cpu").speculative_config == SpeculativeConfig(**CPU_DEFAULT)
    assert SpeculativeConfig.parse("auto", on_cpu=False) is None  # measured on CPUs only


def test_cli_bad_speculative_config_is_one_line(capsys):
    from pagedllm.entrypoints.cli import main

    assert main(["generate", "hi", "--speculative-config", '{"method": "ngram"']) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--speculative-config" in err and "Traceback" not in err


def test_acceptance_counts_and_metrics_use_vllm_names():
    from pagedllm.bench.serve_metrics import parse_spec_decode_counters, spec_decode_delta
    from pagedllm.engine.metrics import PrometheusStatLogger
    from pagedllm.engine.stats import EngineStats

    assert num_accepted([5, 6, 7], [5, 6, 8, 1]) == 2 and num_accepted([5], [4, 5]) == 0
    stats = SpecDecodeStats()
    stats.record(3, 2)
    stats.record(2, 0)
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (2, 5, 2)
    assert stats.accepted_per_pos == [1, 1, 0] and stats.acceptance_rate == 0.4
    zeros = dict.fromkeys(
        (
            "num_running",
            "num_waiting",
            "num_cached_blocks",
            "num_stored_tokens",
            "prefix_cache_queries",
            "prefix_cache_hits",
            "num_preemptions",
            "prompt_tokens",
            "generation_tokens",
            "peak_running",
            "num_steps",
        ),
        0,
    )
    snapshot = EngineStats(
        **zeros,
        num_blocks=1,
        num_free_blocks=1,
        block_size=16,
        kv_usage=0.0,
        spec_decode_num_drafts=2,
        spec_decode_num_draft_tokens=5,
        spec_decode_num_accepted_tokens=2,
        spec_decode_num_accepted_tokens_per_pos=[1, 1, 0],
    )
    text = PrometheusStatLogger().render(snapshot, "m").decode()
    for line in (
        'vllm:spec_decode_num_drafts_total{model_name="m"} 2.0',
        'vllm:spec_decode_num_draft_tokens_total{model_name="m"} 5.0',
        'vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 2.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 1.0',
    ):
        assert line in text
    # bench serve reads them back as vLLM's bench serve does: the difference over the run
    before = parse_spec_decode_counters(text)
    snapshot.spec_decode_num_drafts, snapshot.spec_decode_num_draft_tokens = 6, 17
    snapshot.spec_decode_num_accepted_tokens, snapshot.spec_decode_num_accepted_tokens_per_pos = 8, [4, 3, 1]
    d = spec_decode_delta(before, parse_spec_decode_counters(PrometheusStatLogger().render(snapshot, "m").decode()))
    assert d["spec_decode_acceptance_rate"] == 50.0 and d["spec_decode_acceptance_length"] == 2.5
    assert d["spec_decode_per_position_acceptance_rates"] == [0.75, 0.5, 0.25]
    assert parse_spec_decode_counters('vllm:prefix_cache_hits_total{model_name="m"} 3.0') is None


# ---------------------------------------------------------------- greedy: the same tokens, fewer steps


@pytest.fixture(scope="module")
def rag_prompts(model_fp32):
    """The RAG eval questions, each with its topic's documentation as two retrieved excerpts (what a RAG answer
    quotes), laid out as `pagedllm rag` does; no retrieval needed."""
    import pydoc_data.topics

    from pagedllm.rag.chunking import chunk_id
    from pagedllm.rag.index import Hit
    from pagedllm.rag.layout import build_messages

    prompts = []
    for question, topic in EVAL_QUESTIONS[:6]:
        text = pydoc_data.topics.topics[topic]
        parts = [text[:500], text[500:1000]]
        hits = [Hit(chunk_id(topic, t), topic, topic, i, 1.0 - i / 10, t, i) for i, t in enumerate(parts)]
        prompts.append(model_fp32.tokenizer.apply_chat_template(build_messages(question, hits)[0]))
    return prompts


def generate(engine, prompts, params) -> list:
    """Every request's final CompletionOutputs, and each request's streamed outputs along the way."""
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params[i] if isinstance(params, list) else params)
    done, streamed = {}, {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for out in engine.step():
            streamed[out.request_id].append(out)
            if out.finished:
                done[out.request_id] = out
    return [done[str(i)].outputs for i in range(len(prompts))], [streamed[str(i)] for i in range(len(prompts))]


RAG_PARAMS = SamplingParams(temperature=0, max_tokens=32, logprobs=2)


@pytest.fixture(scope="module")
def plain(model_fp32):
    """One engine without and one with speculation for the module: their prefix caches keep the prompts, so
    each test pays for decoding, not for prefilling the same prompts again."""
    return make_engine(model_fp32)


@pytest.fixture(scope="module")
def spec(model_fp32):
    return make_engine(model_fp32, speculative_config=NGRAM)


@pytest.fixture(scope="module")
def rag_reference(plain, rag_prompts):
    """The answers without speculation, and the number of steps they took."""
    steps = plain.num_steps
    return generate(plain, rag_prompts, RAG_PARAMS)[0], plain.num_steps - steps


def test_rag_greedy_answers_are_the_same_token_for_token_in_fewer_steps(spec, rag_prompts, rag_reference):
    ref, plain_steps = rag_reference
    before, steps = spec.stats(), spec.num_steps
    got, streamed = generate(spec, rag_prompts, RAG_PARAMS)
    for r, g in zip(ref, got):
        assert (g[0].token_ids, g[0].text, g[0].finish_reason) == (r[0].token_ids, r[0].text, r[0].finish_reason)
        assert [set(d) for d in g[0].logprobs] == [set(d) for d in r[0].logprobs]
        for a, b in zip(g[0].logprobs, r[0].logprobs):
            assert all(abs(a[t] - b[t]) < 1e-3 for t in a)  # logprobs of accepted drafts are the model's
    s = spec.stats()
    accepted = s.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
    assert accepted > 0.15 * (s.generation_tokens - before.generation_tokens)  # answers quote their excerpts
    assert s.spec_decode_num_accepted_tokens_per_pos[0] >= s.spec_decode_num_accepted_tokens_per_pos[-1] > 0
    assert spec.num_steps - steps < plain_steps
    many = [
        o
        for outs in streamed
        for a, o in zip(outs, outs[1:])
        if len(o.outputs[0].token_ids) - len(a.outputs[0].token_ids) > 1
    ]
    assert many  # several tokens reached the caller in one step
    assert_all_blocks_free(spec)


def test_stops_min_tokens_and_n_cut_where_they_would_without_drafts(plain, spec, rag_prompts, rag_reference):
    """Each variant ends at the same token and text with and without drafts, though a verified step may have
    produced tokens past the stop (they are dropped)."""
    text, ids = rag_reference[0][0][0].text, rag_reference[0][0][0].token_ids
    short = plain.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 2? Answer with the number only."}]
    )
    variants = [
        SamplingParams(temperature=0, max_tokens=32, stop=[text[30:36]]),
        SamplingParams(temperature=0, max_tokens=13, stop_token_ids=[ids[20]]),
        SamplingParams(temperature=0, max_tokens=16, min_tokens=12),  # EOS masked where it would come
        SamplingParams(temperature=0.8, top_p=0.9, max_tokens=16, seed=5, n=2),
        SamplingParams(temperature=0, max_tokens=16),
    ]
    prompts = [rag_prompts[0], rag_prompts[0], short, rag_prompts[0], short]
    ref, _ = generate(plain, prompts, variants)
    accepted = spec.stats().spec_decode_num_accepted_tokens
    got, streamed = generate(spec, prompts, variants)
    for r, g in zip(ref, got):
        assert [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in g] == [
            (c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in r
        ]
    assert len(ref[1][0].token_ids) == 13 and len(ref[4][0].token_ids) < 12 <= len(ref[2][0].token_ids)
    stop = variants[0].stop[0]
    assert all(stop not in o.outputs[0].text for o in streamed[0])  # never streamed, not even in a long chunk
    assert spec.stats().spec_decode_num_accepted_tokens > accepted
    assert_all_blocks_free(spec)


def test_abort_after_drafts_and_preemption_under_drafts_leave_the_pool_whole(
    model_fp32, spec, rag_prompts, rag_reference
):
    # room for two prompts and one block: both are admitted, and growing one must preempt the other
    blocks = sum(-(-len(p) // 16) for p in rag_prompts[:2]) + 1
    per_block = bytes_per_block(model_fp32.config, 16, "float32")
    small = make_engine(
        model_fp32, speculative_config=NGRAM, kv_cache_memory=blocks * per_block, enable_prefix_caching=False
    )
    got, _ = generate(small, rag_prompts[:2], RAG_PARAMS)
    assert [g[0].token_ids for g in got] == [r[0].token_ids for r in rag_reference[0][:2]]
    assert small.stats().num_preemptions > 0 and small.stats().spec_decode_num_accepted_tokens > 0
    assert_all_blocks_free(small)
    accepted = spec.stats().spec_decode_num_accepted_tokens
    spec.add_request("a", rag_prompts[0], RAG_PARAMS)
    spec.add_request("b", rag_prompts[1], RAG_PARAMS)
    while spec.stats().spec_decode_num_accepted_tokens == accepted and spec.has_unfinished_requests():
        spec.step()
    assert spec.stats().spec_decode_num_accepted_tokens > accepted and spec.requests  # mid-answer, after drafts
    spec.abort_request("a")
    spec.step()
    spec.abort_request("b")
    assert not spec.has_unfinished_requests()
    assert_all_blocks_free(spec)


def test_a_failed_verification_step_runs_each_request_alone(spec, rag_prompts, rag_reference, monkeypatch):
    fused = spec.runner.fused  # the fused C step runs a quantized model's forward pass, the torch module otherwise
    target, name = (fused, "run") if fused is not None else (spec.runner.model, "forward")
    original = getattr(target, name)
    failed = []

    def forward(*args, **kwargs):
        if not failed and any(r.spec_token_ids for r in spec.scheduler.running):  # the first step with drafts
            failed.append(True)
            raise RuntimeError("injected failure")
        return original(*args, **kwargs)

    monkeypatch.setattr(target, name, forward)
    got, _ = generate(spec, rag_prompts[:3], RAG_PARAMS)
    assert failed and [g[0].token_ids for g in got] == [r[0].token_ids for r in rag_reference[0][:3]]
    assert_all_blocks_free(spec)


# ---------------------------------------------------------------- sampling: the model's distribution, seeds kept

PROMPT = [3, 4, 5, 6, 7, 0, 1, 2] * 2  # every token occurs: the drafter proposes at every step
TINY_NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A random 2-layer Llama with an 8-token vocabulary and weights large enough that its next-token
    distributions are peaked and depend on the context (so that drafts are sometimes right, sometimes not)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from devkit.tiny_tokenizer import save_tiny_tokenizer
    from pagedllm.model import load_model

    folder = str(tmp_path_factory.mktemp("tiny-spec"))
    cfg = LlamaConfig(
        vocab_size=8,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() == 2:
                p.normal_(0, 1.0)
    hf.save_pretrained(folder, safe_serialization=True)
    save_tiny_tokenizer(folder, 8)
    return hf, load_model(folder, dtype="float32", verbose=False)


def tiny_engine(loaded, **kw):
    kw.setdefault("max_num_batched_tokens", 4096)
    return make_engine(loaded, max_model_len=64, kv_cache_memory=4 * 2**20, max_num_seqs=512, **kw)


def exact_joint(hf) -> torch.Tensor:
    """P(t1, t2, t3) after PROMPT at temperature 1, from transformers: [8, 8, 8]."""
    with torch.no_grad():

        def next_probs(prefixes):
            return hf(torch.tensor([PROMPT + p for p in prefixes])).logits[:, -1].softmax(-1)

        p1 = next_probs([[]])[0]
        p2 = next_probs([[a] for a in range(8)])
        p3 = next_probs([[a, b] for a in range(8) for b in range(8)]).view(8, 8, 8)
    return p1[:, None, None] * p2[:, :, None] * p3


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test of counts against probs; cells expected fewer than 5 times are pooled into one."""
    n = counts.sum()
    expected = probs.flatten().double() * n
    observed = counts.flatten().double()
    small = expected < 5
    exp = torch.cat([expected[~small], expected[small].sum().view(1)])
    obs = torch.cat([observed[~small], observed[small].sum().view(1)])
    stat = ((obs - exp) ** 2 / exp).sum()
    return torch.special.gammaincc(torch.tensor((len(exp) - 1) / 2, dtype=torch.float64), stat / 2).item()


def joint_counts(outputs) -> torch.Tensor:
    counts = torch.zeros(8, 8, 8)
    for outs in outputs:
        a, b, c = outs[0].token_ids
        counts[a, b, c] += 1
    return counts


@pytest.mark.parametrize("seeded", [False, True], ids=["global-rng", "seeded"])
def test_speculative_sampling_keeps_the_model_distribution(tiny, seeded):
    hf, loaded = tiny
    n = 3000
    params = [
        SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, seed=i if seeded else None) for i in range(n)
    ]
    engine = tiny_engine(loaded, speculative_config=TINY_NGRAM)
    outputs, _ = generate(engine, [PROMPT] * n, params)
    s = engine.stats()
    assert 0.1 * s.spec_decode_num_draft_tokens < s.spec_decode_num_accepted_tokens < s.spec_decode_num_draft_tokens
    assert chi_square_p(joint_counts(outputs), exact_joint(hf)) > 1e-3
    assert_all_blocks_free(engine)


def test_seeded_requests_sample_the_same_tokens_with_and_without_drafts(tiny):
    _, loaded = tiny
    params = [SamplingParams(temperature=0.9, top_k=6, max_tokens=12, ignore_eos=True, seed=i) for i in range(200)]
    plain, _ = generate(tiny_engine(loaded), [PROMPT] * 200, params)
    # a budget of 64 tokens: most steps have room for few drafts, so drafts are cut short by the budget
    engine = tiny_engine(loaded, speculative_config=TINY_NGRAM, max_num_batched_tokens=64)
    spec, _ = generate(engine, [PROMPT] * 200, params)
    assert [o[0].token_ids for o in spec] == [o[0].token_ids for o in plain]
    assert engine.stats().spec_decode_num_accepted_tokens_per_pos[1] > 0  # runs of drafts accepted
    assert_all_blocks_free(engine)
