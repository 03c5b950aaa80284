"""`pagedllm bench serve`: measure any OpenAI-compatible server with a streamed workload (like `vllm bench serve`)."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
from datetime import datetime
from typing import Annotated, Any

from pagedllm.bench import datasets as ds
from pagedllm.bench.arrivals import arrival_times
from pagedllm.bench.client import (
    Endpoint,
    RequestSettings,
    fetch_default_model,
    fetch_metrics_text,
    make_client,
    run_load,
    send_request,
)
from pagedllm.bench.serve_metrics import (
    METRICS,
    compute_metrics,
    parse_goodput,
    parse_percentiles,
    parse_prefix_cache_counters,
    parse_spec_decode_counters,
    percentile_key,
    prefix_cache_delta,
    spec_decode_delta,
)
from pagedllm.errors import UserError
from pagedllm.settings import Field, Flag, add_flags, from_args, settings


@settings
class ServeBenchConfig:
    """`bench serve`'s settings: the server, the workload, the load and the report, as `vllm bench serve`."""

    base_url: str = "http://127.0.0.1:8000"
    """the server's root URL (default: http://127.0.0.1:8000)"""
    endpoint: Endpoint = "/v1/completions"
    """the API the requests go to (default: /v1/completions)"""
    api_key: str | None = None
    """sent as a Bearer token (default: $OPENAI_API_KEY, else none)"""
    model: str | None = None
    """the model name to send (default: the first of the server's /v1/models)"""
    ignore_eos: bool = True
    """send ignore_eos so that every request generates its full output length (default: on; --no-ignore-eos for
    servers that reject it, output lengths then vary)"""
    temperature: float = Field(default=0.0, ge=0)
    """sampling temperature of every request (default: 0, greedy)"""
    usage: bool = True
    """ask for stream_options.include_usage, so the server counts the output tokens (default: on; --no-usage
    counts them here)"""
    extra_body: str | None = None
    """a JSON object merged into every request body (default: none)"""
    dataset_name: ds.DatasetName = "random"
    """the workload: random token prompts, prefix-repetition (shared prefixes), sharegpt (a conversation file) or
    rag (the questions of `pagedllm rag bench`) (default: random)"""
    dataset_path: str | None = None
    """sharegpt: a local JSON file in the ShareGPT format (default: none)"""
    num_prompts: int = Field(default=100, ge=1)
    """requests to send (default: 100)"""
    input_len: int = Field(default=1024, ge=0)
    """random: prompt tokens after the shared prefix (default: 1024)"""
    output_len: Annotated[int, Field(ge=1)] | None = None
    """max_tokens per request (default: 128 for random / prefix-repetition / rag; sharegpt: the dataset reply's
    length)"""
    range_ratio: float = Field(default=0.0, ge=0, lt=1)
    """random: lengths uniform in [len x (1 - r), len x (1 + r)] (default: 0, all equal)"""
    prefix_len: Annotated[int, Field(ge=0)] | None = None
    """random: tokens shared by all prompts (default: 0); prefix-repetition: each prefix's length (default: 256)"""
    num_prefixes: int = Field(default=10, ge=1)
    """prefix-repetition: distinct prefixes (default: 10)"""
    suffix_len: int = Field(default=256, ge=0)
    """prefix-repetition: tokens after the prefix (default: 256)"""
    rag_store: str | None = None
    """rag: the index `pagedllm rag ingest` wrote (default: ./rag-index)"""
    tokenizer: str | None = None
    """tokenizer for exact token counts, a GGUF file or Hugging Face folder (default: the default model's)"""
    seed: int = 0
    """seed of the workload and of the arrival times (default: 0)"""
    request_rate: float = Field(default=float("inf"), gt=0)
    """requests per second, gaps gamma-distributed, Poisson at burstiness 1 (default: inf, all at once)"""
    burstiness: float = Field(default=1.0, gt=0)
    """gamma shape of the gaps: below 1 burstier, above 1 more even (default: 1)"""
    max_concurrency: Annotated[int, Field(ge=1)] | None = None
    """at most this many requests in flight (default: no limit)"""
    skip_initial_test: bool = False
    """do not send one short unmeasured request first to check the server (default: send it)"""
    percentiles: str = "50,90,99"
    """percentiles to report, comma-separated (default: 50,90,99)"""
    goodput: Annotated[list[str] | None, Flag(metavar="KEY:MS")] = None
    """SLOs for goodput, e.g. --goodput ttft:500 tpot:50 e2el:5000 (default: none, no goodput)"""
    save_result: Annotated[str | None, Flag(metavar="FILE.json")] = None
    """write the result as JSON with vLLM's keys (default: not written)"""
    plot: Annotated[str | None, Flag(metavar="FILE.png")] = None
    """latency histograms and throughput over time (default: no picture)"""
    disable_tqdm: bool = False
    """no progress bar (default: a progress bar)"""
    quiet: bool = False
    """do not print the result table (default: print it)"""


FLAG_GROUPS = {
    "server": ("base_url", "endpoint", "api_key", "model", "ignore_eos", "temperature", "usage", "extra_body"),
    "workload": (
        "dataset_name",
        "dataset_path",
        "num_prompts",
        "input_len",
        "output_len",
        "range_ratio",
        "prefix_len",
        "num_prefixes",
        "suffix_len",
        "rag_store",
        "tokenizer",
        "seed",
    ),
    "load": ("request_rate", "burstiness", "max_concurrency", "skip_initial_test"),
    "report": ("percentiles", "goodput", "save_result", "plot", "disable_tqdm", "quiet"),
}


def build_dataset(args: ServeBenchConfig | argparse.Namespace, tokenizer) -> list[ds.SampleRequest]:
    if args.num_prompts < 1:
        raise UserError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    out_len = args.output_len
    if out_len is not None and out_len < 1:
        raise UserError(f"--output-len must be >= 1, got {out_len}")
    name = args.dataset_name
    if name == "random":
        prefix = args.prefix_len or 0
        if args.input_len < 0 or prefix < 0 or args.input_len + prefix < 1:
            raise UserError("--input-len (+ --prefix-len) must be at least 1 token")
        return ds.random_dataset(
            tokenizer, args.num_prompts, args.input_len, out_len or 128, args.range_ratio, prefix, args.seed
        )
    if name == "prefix-repetition":
        prefix = 256 if args.prefix_len is None else args.prefix_len
        if prefix < 0 or args.suffix_len < 0 or prefix + args.suffix_len < 1:
            raise UserError("--prefix-len + --suffix-len must be at least 1 token")
        return ds.prefix_repetition_dataset(
            tokenizer, args.num_prompts, args.num_prefixes, prefix, args.suffix_len, out_len or 128, args.seed
        )
    if name == "sharegpt":
        return ds.sharegpt_dataset(tokenizer, args.dataset_path, args.num_prompts, out_len, args.seed)
    if name == "rag":
        return ds.rag_dataset(tokenizer, args.num_prompts, out_len or 128, args.seed, args.rag_store)
    raise UserError(f"--dataset-name: unknown {name!r}")


def add_serve_parser(bench_sub) -> argparse.ArgumentParser:
    p = bench_sub.add_parser(
        "serve",
        help="measure an OpenAI-compatible server (pagedllm, vLLM, llama.cpp) with a streamed workload",
        description="Send a workload to any OpenAI-compatible server and report TTFT, TPOT, ITL, E2E latency, "
        "throughput, goodput and the server's prefix-cache hit rate (vLLM's definitions).",
    )
    for title, names in FLAG_GROUPS.items():
        add_flags(p.add_argument_group(title), ServeBenchConfig, only=names)
    p.set_defaults(func=run_serve)
    return p


def format_result(res: dict, percentiles) -> str:
    lines = ["{s:{c}^60}".format(s=" Serving Benchmark Result ", c="=")]

    def row(label, value, fmt="{:<40} {:<20}"):
        lines.append(fmt.format(label, value))

    row("Successful requests:", res["completed"])
    row("Failed requests:", res["failed"])
    if res.get("max_concurrency"):
        row("Maximum request concurrency:", res["max_concurrency"])
    rate = res["request_rate"]
    row("Request rate configured (RPS):", f"{rate:.2f}" if isinstance(rate, float) else rate)
    row("Benchmark duration (s):", f"{res['duration']:.2f}")
    row("Total input tokens:", res["total_input_tokens"])
    row("Total generated tokens:", res["total_output_tokens"])
    row("Request throughput (req/s):", f"{res['request_throughput']:.2f}")
    if res.get("request_goodput") is not None:
        row("Request goodput (req/s):", f"{res['request_goodput']:.2f}")
    row("Output token throughput (tok/s):", f"{res['output_throughput']:.2f}")
    row("Peak output token throughput (tok/s):", f"{res['max_output_tokens_per_s']:.2f}")
    row("Peak concurrent requests (1 s buckets):", res["max_concurrent_requests"])
    row("Total token throughput (tok/s):", f"{res['total_token_throughput']:.2f}")
    if res.get("prefix_cache_hit_rate") is not None:
        row("Server prefix-cache hit rate:", f"{res['prefix_cache_hit_rate']:.2%}")
    elif "prefix_cache_hit_rate" in res:
        row("Server prefix-cache hit rate:", "n/a (no prefix_cache counters in /metrics)")
    for key, short, long in METRICS:
        lines.append("{s:{c}^60}".format(s=f" {long} ", c="-"))
        row(f"Mean {short} (ms):", f"{res[f'mean_{key}_ms']:.2f}")
        row(f"Median {short} (ms):", f"{res[f'median_{key}_ms']:.2f}")
        row(f"Std {short} (ms):", f"{res[f'std_{key}_ms']:.2f}")
        for p in percentiles:
            row(f"P{percentile_key(p)} {short} (ms):", f"{res[f'p{percentile_key(p)}_{key}_ms']:.2f}")
    if res.get("spec_decode_acceptance_rate") is not None:
        lines.append("{s:{c}^60}".format(s=" Speculative Decoding ", c="-"))
        row("Acceptance rate (%):", f"{res['spec_decode_acceptance_rate']:.2f}")
        row("Acceptance length:", f"{res['spec_decode_acceptance_length']:.2f}")
        row("Drafts:", res["spec_decode_num_drafts"])
        row("Draft tokens:", res["spec_decode_draft_tokens"])
        row("Accepted tokens:", res["spec_decode_accepted_tokens"])
        for i, rate in enumerate(res["spec_decode_per_position_acceptance_rates"]):
            row(f"  Position {i} acceptance (%):", f"{100 * rate:.2f}")
    lines.append("=" * 60)
    errs = [e for e in res.get("errors", []) if e]
    if errs:
        lines.append(f"first error ({len(errs)} failed): {errs[0][:300]}")
    return "\n".join(lines)


async def _run(args: ServeBenchConfig, settings: RequestSettings, requests, tokenizer, percentiles, goodput) -> dict:
    async with make_client() as client:
        if not settings.model:
            settings.model = await fetch_default_model(client, settings.base_url, settings.api_key)
        if not args.skip_initial_test:
            # a short prompt of its own: checks the server, the endpoint and the flags without putting any of the
            # workload's prompts in the server's prefix cache (vLLM sends the first prompt, which does)
            probe = ds.SampleRequest("Hello! Who are you?", 0, min(4, requests[0].expected_output_len))
            test = await send_request(client, settings, probe)
            if not test.success:
                raise UserError(f"the initial test request to {settings.url} failed: {test.error}")
        before = await fetch_metrics_text(client, settings.base_url, settings.api_key) or ""
        times = arrival_times(len(requests), args.request_rate, args.burstiness, args.seed)
        results, duration = await run_load(
            client, settings, requests, times, args.max_concurrency, progress=not args.disable_tqdm
        )
        after = await fetch_metrics_text(client, settings.base_url, settings.api_key) or ""
    res = compute_metrics(results, duration, lambda t: len(tokenizer.encode(t)), percentiles, goodput)
    cache = prefix_cache_delta(parse_prefix_cache_counters(before), parse_prefix_cache_counters(after))
    res.update(cache or {"prefix_cache_queries": None, "prefix_cache_hits": None, "prefix_cache_hit_rate": None})
    res.update(spec_decode_delta(parse_spec_decode_counters(before), parse_spec_decode_counters(after)) or {})
    res["server_prompt_tokens"] = [r.prompt_tokens for r in results]
    res["server_completion_tokens"] = [r.output_tokens for r in results]
    res["dataset_input_lens"] = [r.prompt_len for r in results]
    return res


def _extra_body(text: str | None) -> dict[str, Any]:
    """--extra-body: a JSON object merged into every request body."""
    if not text:
        return {}
    try:
        extra = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"--extra-body: not JSON: {e}") from e
    if not isinstance(extra, dict):
        raise UserError("--extra-body must be a JSON object")
    return extra


def _save(res: dict[str, Any], path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(res, f, indent=1, default=lambda o: None)
    print(f"saved {path}", file=sys.stderr)


def run_serve(namespace: argparse.Namespace) -> int:
    args = from_args(ServeBenchConfig, namespace)
    percentiles = parse_percentiles(args.percentiles)
    goodput = parse_goodput(args.goodput)
    extra = _extra_body(args.extra_body)
    arrival_times(1, args.request_rate, args.burstiness)  # validates rate and burstiness up front
    from pagedllm.bench.tokenizer import load_bench_tokenizer

    tokenizer = load_bench_tokenizer(args.tokenizer)
    requests = build_dataset(args, tokenizer)
    settings = RequestSettings(
        base_url=args.base_url,
        endpoint=args.endpoint,
        model=args.model or "",
        api_key=args.api_key or os.environ.get("OPENAI_API_KEY"),
        ignore_eos=args.ignore_eos,
        temperature=args.temperature,
        include_usage=args.usage,
        extra_body=extra,
    )
    started = datetime.now().strftime("%Y%m%d-%H%M%S")
    res = asyncio.run(_run(args, settings, requests, tokenizer, percentiles, goodput))
    meta = {
        "date": started,
        "backend": "openai-chat" if "chat" in settings.endpoint else "openai",
        "base_url": settings.base_url,
        "endpoint": settings.endpoint,
        "model_id": settings.model,
        "tokenizer_id": args.tokenizer,
        "dataset_name": args.dataset_name,
        "num_prompts": args.num_prompts,
        "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "seed": args.seed,
        "percentiles": percentiles,
        "goodput_slos_ms": goodput or None,
        "ignore_eos": settings.ignore_eos,
    }
    res = {**meta, **res}
    if not args.quiet:
        print(format_result(res, percentiles))
    if args.save_result:
        _save(res, args.save_result)
    if args.plot:
        from pagedllm.bench.plot import plot_serve_result

        plot_serve_result(res, args.plot, title=f"{settings.model} @ {settings.base_url}{settings.endpoint}")
        print(f"saved {args.plot}", file=sys.stderr)
    return 0 if res["completed"] > 0 else 1
