"""Benchmark workloads. Every prompt length is exact in the model's tokens: len(tokenizer.encode(prompt)).

Random prompts are built as vLLM builds them: random token ids are decoded to text, the text is re-encoded
(BPE merges change the count) and the ids are truncated or extended until decode -> encode is stable at the
target length.
"""

from __future__ import annotations

import json
import os
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from pagedllm.bench.tokenizer import BenchTokenizer
from pagedllm.errors import UserError

DatasetName = Literal["random", "prefix-repetition", "sharegpt", "rag"]
DATASETS: tuple[str, ...] = typing.get_args(DatasetName)


@dataclass
class SampleRequest:
    prompt: str
    prompt_len: int  # tokens, exact: len(tokenizer.encode(prompt))
    expected_output_len: int  # sent as max_tokens (with ignore_eos)


class _TokenSampler:
    def __init__(self, tokenizer: BenchTokenizer, rng: np.random.Generator):
        self.tok = tokenizer
        self.rng = rng
        specials = np.array(sorted(i for i in tokenizer.special_ids if 0 <= i < tokenizer.vocab_size), dtype=np.int64)
        allowed = np.setdiff1d(np.arange(tokenizer.vocab_size, dtype=np.int64), specials)
        self.allowed = allowed

    def sample(self, n: int) -> list[int]:
        if n <= 0:
            return []
        return self.allowed[self.rng.integers(0, len(self.allowed), size=n)].tolist()


def exact_length_prompt(
    sampler: _TokenSampler, target_len: int, prefix_ids: list[int] | None = None, max_tries: int = 50
) -> tuple[str, list[int]]:
    """A text whose encoding is exactly `target_len` tokens and starts with `prefix_ids` (if given).

    Returns (text, ids) with tokenizer.encode(text) == ids and len(ids) == target_len.
    """
    tok = sampler.tok
    prefix = list(prefix_ids or [])
    if target_len < len(prefix):
        raise UserError(f"prompt length {target_len} is shorter than its shared prefix ({len(prefix)} tokens)")
    if target_len == 0:
        return "", []
    ids = prefix + sampler.sample(target_len - len(prefix))
    for attempt in range(max_tries):
        text = tok.decode(ids)
        re_ids = tok.encode(text)
        if len(re_ids) == target_len and re_ids[: len(prefix)] == prefix:
            return text, re_ids
        if re_ids[: len(prefix)] != prefix or attempt % 10 == 9:
            # the suffix merged into the prefix (or we are going round in circles): new random suffix
            ids = prefix + sampler.sample(target_len - len(prefix))
        elif len(re_ids) > target_len:
            ids = re_ids[:target_len]
        else:
            ids = re_ids + sampler.sample(target_len - len(re_ids))
    raise UserError(f"could not build a prompt of exactly {target_len} tokens with this tokenizer in {max_tries} tries")


def _lens(rng: np.random.Generator, mean: int, range_ratio: float, n: int, name: str) -> np.ndarray:
    if not 0.0 <= range_ratio < 1.0:
        raise UserError(f"--range-ratio must be in [0, 1), got {range_ratio}")
    if mean < 0:
        raise UserError(f"--{name} must be >= 0, got {mean}")
    low = int(np.floor(mean * (1 - range_ratio)))
    high = int(np.ceil(mean * (1 + range_ratio)))
    return rng.integers(low, high + 1, size=n)


def random_dataset(
    tokenizer: BenchTokenizer,
    num_prompts: int,
    input_len: int = 1024,
    output_len: int = 128,
    range_ratio: float = 0.0,
    prefix_len: int = 0,
    seed: int = 0,
) -> list[SampleRequest]:
    """`prefix_len` tokens shared by all prompts, then input_len +- range_ratio random tokens each."""
    rng = np.random.default_rng(seed)
    sampler = _TokenSampler(tokenizer, rng)
    _, prefix_ids = exact_length_prompt(sampler, prefix_len) if prefix_len > 0 else ("", [])
    in_lens = _lens(rng, input_len, range_ratio, num_prompts, "input-len")
    out_lens = _lens(rng, output_len, range_ratio, num_prompts, "output-len")
    out = []
    for i in range(num_prompts):
        text, ids = exact_length_prompt(sampler, prefix_len + int(in_lens[i]), prefix_ids)
        out.append(SampleRequest(text, len(ids), max(1, int(out_lens[i]))))
    return out


def prefix_repetition_dataset(
    tokenizer: BenchTokenizer,
    num_prompts: int,
    num_prefixes: int = 10,
    prefix_len: int = 256,
    suffix_len: int = 256,
    output_len: int = 128,
    seed: int = 0,
) -> list[SampleRequest]:
    """`num_prefixes` distinct prefixes, each shared by num_prompts / num_prefixes prompts; shuffled."""
    if num_prefixes < 1:
        raise UserError(f"--num-prefixes must be >= 1, got {num_prefixes}")
    rng = np.random.default_rng(seed)
    sampler = _TokenSampler(tokenizer, rng)
    prefixes = [exact_length_prompt(sampler, prefix_len)[1] for _ in range(num_prefixes)]
    out = []
    for i in range(num_prompts):
        text, ids = exact_length_prompt(sampler, prefix_len + suffix_len, prefixes[i % num_prefixes])
        out.append(SampleRequest(text, len(ids), max(1, output_len)))
    order = rng.permutation(len(out))
    return [out[i] for i in order]


def long_tail_lengths(
    num_prompts: int, max_len: int = 4096, median: int = 300, sigma: float = 1.0, min_len: int = 16, seed: int = 0
) -> list[int]:
    """Prompt lengths with a long tail like the kv-calc example's (180, 650, 90, 1200, 300, 75, 420, 260 of 4096):
    log-normal around `median`, clipped to [min_len, max_len]; the longest is stretched to max_len so that the
    tail is always there."""
    rng = np.random.default_rng(seed)
    lens = np.clip(np.round(median * np.exp(sigma * rng.standard_normal(num_prompts))), min_len, max_len).astype(int)
    if num_prompts >= 4:
        lens[int(np.argmax(lens))] = max_len
    return [int(x) for x in lens]


def lengths_dataset(
    tokenizer: BenchTokenizer, prompt_lens: list[int], output_len: int, seed: int = 0
) -> list[SampleRequest]:
    rng = np.random.default_rng(seed)
    sampler = _TokenSampler(tokenizer, rng)
    out = []
    for n in prompt_lens:
        text, ids = exact_length_prompt(sampler, n)
        out.append(SampleRequest(text, len(ids), output_len))
    return out


def sharegpt_dataset(
    tokenizer: BenchTokenizer,
    path: str | None,
    num_prompts: int,
    output_len: int | None = None,
    seed: int = 0,
    max_prompt_len: int = 1024,
    max_total_len: int = 2048,
) -> list[SampleRequest]:
    """First human turn as the prompt, the first reply's length (or `output_len`) as max_tokens; vLLM's filter
    (prompt and reply >= 4 tokens, prompt <= 1024, prompt + reply <= 2048)."""
    if not path:
        raise UserError("--dataset-path is required for --dataset-name sharegpt (a ShareGPT JSON file)")
    if not os.path.isfile(path):
        raise UserError(f"--dataset-path: no such file: {path}")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"--dataset-path: {path} is not a JSON file: {e}") from e
    if not isinstance(data, list):
        raise UserError(f"--dataset-path: {path} must hold a JSON list of conversations (ShareGPT format)")
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(data))
    out: list[SampleRequest] = []
    for i in order:
        entry = data[int(i)]
        conv = entry.get("conversations") or entry.get("conversation") if isinstance(entry, dict) else None
        if not isinstance(conv, list) or len(conv) < 2:
            continue
        prompt = conv[0].get("value") if isinstance(conv[0], dict) else None
        reply = conv[1].get("value") if isinstance(conv[1], dict) else None
        if not isinstance(prompt, str) or not isinstance(reply, str):
            continue
        p_len = len(tokenizer.encode(prompt))
        o_len = output_len if output_len is not None else len(tokenizer.encode(reply))
        if output_len is None and (p_len < 4 or o_len < 4 or p_len > max_prompt_len or p_len + o_len > max_total_len):
            continue
        if p_len < 1:
            continue
        out.append(SampleRequest(prompt, p_len, o_len))
        if len(out) >= num_prompts:
            break
    if not out:
        raise UserError(f"--dataset-path: no usable conversations in {path} (ShareGPT: [{{'conversations': [...]}}])")
    while len(out) < num_prompts:  # fewer conversations than prompts: reuse them
        out.append(out[len(out) % max(1, len(out))])
    return out


def rag_dataset(
    tokenizer: BenchTokenizer, num_prompts: int, output_len: int, seed: int = 0, store: str | None = None
) -> list[SampleRequest]:
    """Prompts built by the RAG pipeline: `pagedllm.rag.bench_prompts(num_prompts, seed=..., store=...)` returns
    a list of prompt strings (retrieved context + question), or raises UserError when nothing was ingested."""
    import pagedllm.rag as rag  # looked up at the call: tests stand in their own bench_prompts

    fn: Callable = rag.bench_prompts
    kwargs: dict[str, Any] = {"seed": seed}
    if store is not None:
        kwargs["store"] = store
    prompts = list(fn(num_prompts, **kwargs))
    if not prompts:
        raise UserError("the rag dataset is empty: run `pagedllm rag ingest` first")
    out = []
    for i in range(num_prompts):
        p = prompts[i % len(prompts)]
        out.append(SampleRequest(p, len(tokenizer.encode(p)), output_len))
    return out
