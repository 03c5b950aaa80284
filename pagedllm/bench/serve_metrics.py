"""Serving metrics, with vLLM's definitions (benchmarks/serve.py), from per-request timings.

- TTFT: from sending the request to the first streamed chunk that carries text.
- ITL: every gap between two consecutive text-carrying chunks (all requests' gaps pooled).
- TPOT: per request (E2E - TTFT) / (output tokens - 1), for requests with more than one output token.
- E2E latency (e2el): from sending the request to its last text-carrying chunk.
- Output tokens: the server's `usage.completion_tokens` when it sent one, else the generated text re-encoded.
- Throughputs divide by the benchmark's duration (first send to last completion).
- Peak output tokens/s: each text-carrying chunk is one token at its arrival time, counted in one-second buckets
  from the first request's start; the best bucket (as vLLM, which also counts a chunk as one token).
- Goodput: completed requests meeting every SLO given (ttft, tpot, e2el in ms) per second; a request with one
  output token has TPOT 0 for this purpose.
- Mean / median / std (population, numpy's default) and percentiles (numpy's linear interpolation), in ms.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from pagedllm.errors import UserError

METRICS = (
    ("ttft", "TTFT", "Time to First Token"),
    ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
    ("itl", "ITL", "Inter-token Latency"),
    ("e2el", "E2EL", "End-to-end Latency"),
)
GOODPUT_KEYS = ("ttft", "tpot", "e2el")


@dataclass
class RequestResult:
    success: bool = False
    error: str = ""
    prompt_len: int = 0  # the dataset's exact count
    start_time: float = 0.0  # time.perf_counter() when the request was sent
    ttft: float = 0.0  # seconds
    latency: float = 0.0  # seconds, E2E
    itl: list[float] = field(default_factory=list)  # seconds, gaps between text chunks
    generated_text: str = ""
    prompt_tokens: int | None = None  # server usage, when reported
    output_tokens: int | None = None  # server usage, when reported


def percentile_key(p: float) -> str:
    return str(int(p)) if float(p).is_integer() else str(p)


def parse_percentiles(text: str) -> list[float]:
    try:
        ps = [float(x) for x in str(text).replace(" ", "").split(",") if x]
    except ValueError as e:
        raise UserError(f"--percentiles: expected numbers separated by commas like 50,90,99, got {text!r}") from e
    if not ps or any(not 0 <= p <= 100 for p in ps):
        raise UserError(f"--percentiles: each must be in [0, 100], got {text!r}")
    return ps


def parse_goodput(items: Sequence[str] | None) -> dict[str, float]:
    """['ttft:500', 'tpot:50'] -> {'ttft': 500.0, 'tpot': 50.0} (milliseconds)."""
    out: dict[str, float] = {}
    for item in items or []:
        for part in str(item).split():
            key, sep, value = part.partition(":")
            key = key.strip().lower()
            if not sep or key not in GOODPUT_KEYS:
                raise UserError(f"--goodput: expected KEY:MS with KEY one of ttft, tpot, e2el, got {part!r}")
            try:
                ms = float(value)
            except ValueError as e:
                raise UserError(f"--goodput: {key} needs a number of milliseconds, got {value!r}") from e
            if ms < 0 or math.isnan(ms):
                raise UserError(f"--goodput: {key} must be >= 0 ms, got {value}")
            out[key] = ms
    return out


def token_times(r: RequestResult) -> list[float]:
    """Absolute arrival time of each text chunk of a successful request."""
    if not r.success:
        return []
    t = r.start_time + r.ttft
    times = [t]
    for gap in r.itl:
        t += gap
        times.append(t)
    return times


def per_second(results: Sequence[RequestResult]) -> tuple[np.ndarray, np.ndarray]:
    """(output chunks per one-second bucket, requests in flight during each bucket), from the first start."""
    ok = [r for r in results if r.success]
    if not ok:
        return np.zeros(0), np.zeros(0, dtype=int)
    t0 = min(r.start_time for r in ok)
    t_end = max(r.start_time + r.latency for r in ok)
    n = int(np.ceil(t_end - t0)) + 1
    tokens = np.zeros(n)
    running = np.zeros(n, dtype=int)
    for r in ok:
        for t in token_times(r):
            b = int(t - t0)
            if 0 <= b < n:
                tokens[b] += 1
        for b in range(int(r.start_time - t0), min(n - 1, int(r.start_time + r.latency - t0)) + 1):
            running[b] += 1
    return tokens, running


def _stats(name: str, values_s: Sequence[float], percentiles: Sequence[float], out: dict) -> None:
    arr = np.asarray(values_s, dtype=float) * 1000.0
    if arr.size == 0:
        arr = np.zeros(1)
    out[f"mean_{name}_ms"] = float(np.mean(arr))
    out[f"median_{name}_ms"] = float(np.median(arr))
    out[f"std_{name}_ms"] = float(np.std(arr))
    for p in percentiles:
        out[f"p{percentile_key(p)}_{name}_ms"] = float(np.percentile(arr, p))


@dataclass
class _Samples:
    """The per-request figures compute_metrics summarizes (failed requests count 0 output tokens only)."""

    completed: int = 0
    total_input: int = 0
    input_lens: list[int] = field(default_factory=list)
    output_lens: list[int] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    tpots: list[float] = field(default_factory=list)  # requests with more than one output token
    all_tpots: list[float] = field(default_factory=list)  # every completed request (0 for one token)
    itls: list[float] = field(default_factory=list)
    e2els: list[float] = field(default_factory=list)


def _samples(results: Sequence[RequestResult], count_tokens: Callable[[str], int] | None) -> _Samples:
    s = _Samples()
    for r in results:
        in_len = int(r.prompt_tokens if r.prompt_tokens is not None else r.prompt_len)
        s.input_lens.append(in_len)
        if not r.success:
            s.output_lens.append(0)
            continue
        out_len = r.output_tokens
        if out_len is None:
            out_len = count_tokens(r.generated_text) if count_tokens else 0
        out_len = int(out_len)
        s.output_lens.append(out_len)
        s.total_input += in_len
        tpot = (r.latency - r.ttft) / (out_len - 1) if out_len > 1 else 0.0
        if out_len > 1:
            s.tpots.append(tpot)
        s.all_tpots.append(tpot)
        s.itls.extend(r.itl)
        s.ttfts.append(r.ttft)
        s.e2els.append(r.latency)
        s.completed += 1
    return s


def compute_metrics(
    results: Sequence[RequestResult],
    duration: float,
    count_tokens: Callable[[str], int] | None = None,
    percentiles: Sequence[float] = (50, 90, 99),
    goodput: dict[str, float] | None = None,
) -> dict:
    """vLLM-style result dict (see the module docstring for each definition)."""
    s = _samples(results, count_tokens)
    completed, total_input, output_lens, input_lens = s.completed, s.total_input, s.output_lens, s.input_lens
    ttfts, tpots, itls, e2els = s.ttfts, s.tpots, s.itls, s.e2els
    total_output = sum(output_lens)
    dur = duration if duration > 0 else float("nan")
    slos = goodput or {}
    good = sum(
        all(m[k] * 1000.0 <= v for k, v in slos.items())
        for m in ({"ttft": a, "tpot": b, "e2el": c} for a, b, c in zip(ttfts, s.all_tpots, e2els))
    )
    tokens_per_s, running = per_second(results)
    out: dict = {
        "duration": duration,
        "completed": completed,
        "failed": len(results) - completed,
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": completed / dur,
        "request_goodput": (good / dur) if slos else None,
        "output_throughput": total_output / dur,
        "total_token_throughput": (total_input + total_output) / dur,
        "max_output_tokens_per_s": float(tokens_per_s.max()) if tokens_per_s.size else 0.0,
        "max_concurrent_requests": int(running.max()) if running.size else 0,
    }
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        _stats(name, values, percentiles, out)
    out.update(
        {
            "input_lens": input_lens,
            "output_lens": output_lens,
            "ttfts": [r.ttft if r.success else 0.0 for r in results],
            "itls": [list(r.itl) if r.success else [] for r in results],
            "e2els": [r.latency if r.success else 0.0 for r in results],
            "start_times": [r.start_time for r in results],
            "generated_texts": [r.generated_text for r in results],
            "errors": [r.error for r in results],
            "output_tokens_per_second": tokens_per_s.tolist(),
            "running_requests_per_second": running.tolist(),
        }
    )
    return out


# ---- the server's prefix-cache counters, from its Prometheus /metrics -------------------------------------


def _prometheus_samples(text: str) -> Iterator[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of every sample of a Prometheus text page (prometheus_client's parser); a page it
    cannot read has none (a server without Prometheus metrics)."""
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                yield sample.name, sample.labels, sample.value
    except ValueError:
        return


def parse_prefix_cache_counters(text: str) -> dict[str, float] | None:
    """{'queries': q, 'hits': h} summed over label sets, from vLLM's `vllm:prefix_cache_queries` /
    `vllm:prefix_cache_hits` counters (with or without `_total`, any namespace: `pagedllm:` too; the
    `gpu_`/`cpu_` forms of older vLLM are accepted); None when the server has no such counters."""
    found: dict[str, dict[tuple, float]] = {"queries": {}, "hits": {}}
    for name, labels, value in _prometheus_samples(text):
        base = name.split(":")[-1].removeprefix("gpu_").removeprefix("cpu_").removesuffix("_total")
        if base in ("prefix_cache_queries", "prefix_cache_hits"):
            # a counter may appear as both `x` and `x_total`: one value per (name without _total, labels)
            found[base.rsplit("_", 1)[-1]][(name.removesuffix("_total"), *sorted(labels.items()))] = value
    if not found["queries"]:
        return None
    return {"queries": sum(found["queries"].values()), "hits": sum(found["hits"].values())}


def prefix_cache_delta(before: dict | None, after: dict | None) -> dict | None:
    if before is None or after is None:
        return None
    q = after["queries"] - before["queries"]
    h = after["hits"] - before["hits"]
    return {"prefix_cache_queries": q, "prefix_cache_hits": h, "prefix_cache_hit_rate": (h / q) if q > 0 else None}


# ---- the server's speculative-decoding counters (vLLM's bench serve reads the same) -----------------------

_SPEC_KEYS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens_per_pos", "num_accepted_tokens")


def parse_spec_decode_counters(text: str) -> dict | None:
    """{'num_drafts', 'num_draft_tokens', 'num_accepted_tokens': sums, 'per_pos': {position: accepted}} from the
    `vllm:spec_decode_*_total` counters; None when the server has none (speculation off, or not vLLM's names)."""
    found: dict = {"num_drafts": 0.0, "num_draft_tokens": 0.0, "num_accepted_tokens": 0.0, "per_pos": {}}
    seen = False
    for name, labels, value in _prometheus_samples(text):
        key = name.removeprefix("vllm:spec_decode_").removesuffix("_total")
        if not name.startswith("vllm:spec_decode_") or not name.endswith("_total") or key not in _SPEC_KEYS:
            continue
        seen = True
        if key != "num_accepted_tokens_per_pos":
            found[key] += value
        elif labels.get("position", "").isdigit():
            pos = int(labels["position"])
            found["per_pos"][pos] = found["per_pos"].get(pos, 0.0) + value
    return found if seen else None


def spec_decode_delta(before: dict | None, after: dict | None) -> dict | None:
    """vLLM's bench serve result keys: acceptance rate (%) of draft tokens, acceptance length (1 + accepted per
    draft: tokens a verification step yields), and per position the share of drafts accepted that far."""
    if before is None or after is None:
        return None
    drafts = after["num_drafts"] - before["num_drafts"]
    draft_tokens = after["num_draft_tokens"] - before["num_draft_tokens"]
    accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
    if draft_tokens <= 0:
        return None
    per_pos = [(after["per_pos"][p] - before["per_pos"].get(p, 0.0)) / drafts for p in sorted(after["per_pos"])]
    return {
        "spec_decode_acceptance_rate": 100 * accepted / draft_tokens,
        "spec_decode_acceptance_length": 1 + accepted / drafts if drafts else 0.0,
        "spec_decode_num_drafts": int(drafts),
        "spec_decode_draft_tokens": int(draft_tokens),
        "spec_decode_accepted_tokens": int(accepted),
        "spec_decode_per_position_acceptance_rates": per_pos,
    }
