"""Bench workloads: prompt lengths exact in the default model's tokens."""

import json

import pytest

from pagedllm.bench import datasets as ds
from pagedllm.errors import UserError


@pytest.fixture(scope="module")
def tok():
    from pagedllm.bench.tokenizer import load_bench_tokenizer

    return load_bench_tokenizer()


def _exact(tok, reqs):
    return all(len(tok.encode(r.prompt)) == r.prompt_len for r in reqs)


def test_random_exact_lengths(tok):
    reqs = ds.random_dataset(tok, 40, input_len=100, output_len=16, range_ratio=0.5, seed=3)
    assert _exact(tok, reqs)
    assert all(50 <= r.prompt_len <= 150 for r in reqs) and len({r.prompt_len for r in reqs}) > 5
    assert all(8 <= r.expected_output_len <= 24 for r in reqs)
    fixed = ds.random_dataset(tok, 10, input_len=77, output_len=5, seed=3)
    assert [r.prompt_len for r in fixed] == [77] * 10 and _exact(tok, fixed)
    assert [r.prompt for r in fixed] == [r.prompt for r in ds.random_dataset(tok, 10, 77, 5, seed=3)]


def test_random_shared_prefix(tok):
    reqs = ds.random_dataset(tok, 12, input_len=40, output_len=4, prefix_len=64, seed=1)
    assert [r.prompt_len for r in reqs] == [104] * 12 and _exact(tok, reqs)
    assert len({tuple(tok.encode(r.prompt)[:64]) for r in reqs}) == 1
    assert len({r.prompt for r in reqs}) == 12


def test_prefix_repetition(tok):
    reqs = ds.prefix_repetition_dataset(tok, 24, num_prefixes=3, prefix_len=96, suffix_len=32, output_len=7, seed=2)
    assert [r.prompt_len for r in reqs] == [128] * 24 and _exact(tok, reqs)
    prefixes = [tuple(tok.encode(r.prompt)[:96]) for r in reqs]
    assert len(set(prefixes)) == 3 and all(prefixes.count(p) == 8 for p in set(prefixes))
    assert all(r.expected_output_len == 7 for r in reqs)


def test_long_tail(tok):
    lens = ds.long_tail_lengths(32, max_len=4096, seed=0)
    assert max(lens) == 4096 and min(lens) >= 16 and sorted(lens)[16] < 1000
    reqs = ds.lengths_dataset(tok, lens[:8], 4)
    assert [r.prompt_len for r in reqs] == lens[:8] and _exact(tok, reqs)


def test_sharegpt(tok, tmp_path):
    data = [
        {
            "conversations": [
                {"from": "human", "value": "What is the capital of France? Answer briefly."},
                {"from": "gpt", "value": "The capital of France is Paris, a city on the Seine."},
            ]
        },
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello there friend"}]},
        {"conversations": [{"from": "human", "value": "only one turn"}]},
        {"id": "x"},
    ]
    p = tmp_path / "sg.json"
    p.write_text(json.dumps(data))
    reqs = ds.sharegpt_dataset(tok, str(p), 3, seed=0)
    assert len(reqs) == 3 and all(r.prompt.startswith("What is") for r in reqs)  # the short ones are filtered
    assert reqs[0].expected_output_len == len(tok.encode(data[0]["conversations"][1]["value"])) and _exact(tok, reqs)
    assert [r.expected_output_len for r in ds.sharegpt_dataset(tok, str(p), 2, output_len=9)] == [9, 9]
    with pytest.raises(UserError):
        ds.sharegpt_dataset(tok, str(tmp_path / "missing.json"), 1)
    with pytest.raises(UserError):
        ds.sharegpt_dataset(tok, None, 1)


def test_rag_hook(tok, monkeypatch, tmp_path):
    import pagedllm.rag as rag

    with pytest.raises(UserError, match="rag ingest"):  # nothing ingested there
        ds.rag_dataset(tok, 2, 8, store=str(tmp_path))
    monkeypatch.setattr(rag, "bench_prompts", lambda n, seed=0: ["Context: cats.\nQuestion: what?"] * n)
    reqs = ds.rag_dataset(tok, 2, 8)
    assert len(reqs) == 2 and _exact(tok, reqs) and reqs[0].expected_output_len == 8
