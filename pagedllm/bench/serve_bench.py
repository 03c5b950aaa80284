"""`pagedllm bench serve`: measure any OpenAI-compatible server with a streamed workload (like `vllm bench serve`)."""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys

from datetime import datetime

from pagedllm.bench import datasets as ds
from pagedllm.bench.arrivals import arrival_times
from pagedllm.bench.client import (ENDPOINTS, RequestSettings, fetch_default_model, fetch_metrics_text, make_client,
                                   run_load, send_request)
from pagedllm.bench.metrics import (METRICS, compute_metrics, parse_goodput, parse_percentiles,
                                    parse_prefix_cache_counters, parse_spec_decode_counters, percentile_key,
                                    prefix_cache_delta, spec_decode_delta)
from pagedllm.errors import UserError


def add_dataset_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--dataset-name", choices=ds.DATASETS, default="random")
    g.add_argument("--dataset-path", default=None, help="sharegpt: a local JSON file in the ShareGPT format")
    g.add_argument("--num-prompts", type=int, default=100)
    g.add_argument("--input-len", type=int, default=1024, help="random: prompt tokens (after the shared prefix)")
    g.add_argument("--output-len", type=int, default=None,
                   help="max_tokens per request (random / prefix-repetition / rag: default 128; sharegpt: the "
                        "dataset reply's length)")
    g.add_argument("--range-ratio", type=float, default=0.0,
                   help="random: lengths uniform in [len*(1-r), len*(1+r)]")
    g.add_argument("--prefix-len", type=int, default=None,
                   help="random: tokens shared by all prompts (default 0); prefix-repetition: each prefix's "
                        "length (default 256)")
    g.add_argument("--num-prefixes", type=int, default=10, help="prefix-repetition: distinct prefixes")
    g.add_argument("--suffix-len", type=int, default=256, help="prefix-repetition: tokens after the prefix")
    g.add_argument("--rag-store", default=None, help="rag: the store `pagedllm rag ingest` wrote (its default if unset)")
    g.add_argument("--tokenizer", default=None,
                   help="tokenizer for exact token counts (GGUF file, HF folder); default: the default model's")
    g.add_argument("--seed", type=int, default=0)


def build_dataset(args: argparse.Namespace, tokenizer) -> list[ds.SampleRequest]:
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
        return ds.random_dataset(tokenizer, args.num_prompts, args.input_len, out_len or 128, args.range_ratio,
                                 prefix, args.seed)
    if name == "prefix-repetition":
        prefix = 256 if args.prefix_len is None else args.prefix_len
        if prefix < 0 or args.suffix_len < 0 or prefix + args.suffix_len < 1:
            raise UserError("--prefix-len + --suffix-len must be at least 1 token")
        return ds.prefix_repetition_dataset(tokenizer, args.num_prompts, args.num_prefixes, prefix, args.suffix_len,
                                            out_len or 128, args.seed)
    if name == "sharegpt":
        return ds.sharegpt_dataset(tokenizer, args.dataset_path, args.num_prompts, out_len, args.seed)
    if name == "rag":
        return ds.rag_dataset(tokenizer, args.num_prompts, out_len or 128, args.seed, args.rag_store)
    raise UserError(f"--dataset-name: unknown {name!r}")


def add_serve_parser(bench_sub) -> argparse.ArgumentParser:
    p = bench_sub.add_parser(
        "serve", help="measure an OpenAI-compatible server (pagedllm, vLLM, llama.cpp) with a streamed workload",
        description="Send a workload to any OpenAI-compatible server and report TTFT, TPOT, ITL, E2E latency, "
                    "throughput, goodput and the server's prefix-cache hit rate (vLLM's definitions).")
    g = p.add_argument_group("server")
    g.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root, e.g. http://127.0.0.1:8000")
    g.add_argument("--endpoint", choices=ENDPOINTS, default="/v1/completions")
    g.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="sent as a Bearer token")
    g.add_argument("--model", default=None, help="model name to send (default: the first of /v1/models)")
    g.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="do not send ignore_eos (for servers that reject it; output lengths then vary)")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--no-usage", dest="include_usage", action="store_false",
                   help="do not ask for stream_options.include_usage (output tokens are then counted locally)")
    g.add_argument("--extra-body", default=None, help="JSON object merged into every request body")
    add_dataset_args(p)
    g = p.add_argument_group("load")
    g.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second (inf: all at once); gaps are gamma-distributed, Poisson at burstiness 1")
    g.add_argument("--burstiness", type=float, default=1.0, help="gamma shape: < 1 burstier, > 1 more even")
    g.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    g.add_argument("--skip-initial-test", action="store_true",
                   help="do not send one short unmeasured request before the run to check the server")
    g = p.add_argument_group("report")
    g.add_argument("--percentiles", default="50,90,99", help="percentiles to report, e.g. 50,90,99")
    g.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                   help="SLOs for goodput, e.g. --goodput ttft:500 tpot:50 e2el:5000")
    g.add_argument("--save-result", default=None, metavar="FILE.json", help="write the result as JSON (vLLM keys)")
    g.add_argument("--plot", default=None, metavar="FILE.png", help="latency histograms and throughput over time")
    g.add_argument("--disable-tqdm", action="store_true")
    g.add_argument("--quiet", action="store_true", help="do not print the result table")
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


async def _run(args, settings: RequestSettings, requests, tokenizer, percentiles, goodput) -> dict:
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
        results, duration = await run_load(client, settings, requests, times, args.max_concurrency,
                                           progress=not args.disable_tqdm)
        after = await fetch_metrics_text(client, settings.base_url, settings.api_key) or ""
    res = compute_metrics(results, duration, lambda t: len(tokenizer.encode(t)), percentiles, goodput)
    cache = prefix_cache_delta(parse_prefix_cache_counters(before), parse_prefix_cache_counters(after))
    res.update(cache or {"prefix_cache_queries": None, "prefix_cache_hits": None, "prefix_cache_hit_rate": None})
    res.update(spec_decode_delta(parse_spec_decode_counters(before), parse_spec_decode_counters(after)) or {})
    res["server_prompt_tokens"] = [r.prompt_tokens for r in results]
    res["server_completion_tokens"] = [r.output_tokens for r in results]
    res["dataset_input_lens"] = [r.prompt_len for r in results]
    return res


def run_serve(args: argparse.Namespace) -> int:
    percentiles = parse_percentiles(args.percentiles)
    goodput = parse_goodput(args.goodput)
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise UserError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    extra = {}
    if args.extra_body:
        try:
            extra = json.loads(args.extra_body)
        except json.JSONDecodeError as e:
            raise UserError(f"--extra-body: not JSON: {e}") from e
        if not isinstance(extra, dict):
            raise UserError("--extra-body must be a JSON object")
    arrival_times(1, args.request_rate, args.burstiness)  # validates rate and burstiness up front
    from pagedllm.bench.tokenizer import load_bench_tokenizer

    tokenizer = load_bench_tokenizer(args.tokenizer)
    requests = build_dataset(args, tokenizer)
    settings = RequestSettings(base_url=args.base_url, endpoint=args.endpoint, model=args.model or "",
                               api_key=args.api_key, ignore_eos=args.ignore_eos, temperature=args.temperature,
                               include_usage=args.include_usage, extra_body=extra)
    started = datetime.now().strftime("%Y%m%d-%H%M%S")
    res = asyncio.run(_run(args, settings, requests, tokenizer, percentiles, goodput))
    meta = {"date": started, "backend": "openai-chat" if "chat" in settings.endpoint else "openai",
            "base_url": settings.base_url, "endpoint": settings.endpoint, "model_id": settings.model,
            "tokenizer_id": args.tokenizer, "dataset_name": args.dataset_name, "num_prompts": args.num_prompts,
            "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf", "burstiness": args.burstiness,
            "max_concurrency": args.max_concurrency, "seed": args.seed, "percentiles": percentiles,
            "goodput_slos_ms": goodput or None, "ignore_eos": settings.ignore_eos}
    res = {**meta, **res}
    if not args.quiet:
        print(format_result(res, percentiles))
    if args.save_result:
        d = os.path.dirname(os.path.abspath(args.save_result))
        os.makedirs(d, exist_ok=True)
        with open(args.save_result, "w", encoding="utf-8") as f:
            json.dump(res, f, indent=1, default=lambda o: None)
        print(f"saved {args.save_result}", file=sys.stderr)
    if args.plot:
        from pagedllm.bench.plot import plot_serve_result

        plot_serve_result(res, args.plot, title=f"{settings.model} @ {settings.base_url}{settings.endpoint}")
        print(f"saved {args.plot}", file=sys.stderr)
    return 0 if res["completed"] > 0 else 1


