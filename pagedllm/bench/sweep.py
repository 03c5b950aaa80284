"""`pagedllm bench sweep`: the chapter's table, measured. One workload, several in-process engines, one row each.

Rows (default `--rows all`):
- allocation: contiguous vs paged KV allocation at the same KV budget (`--kv-budget-tokens`, default
  `--contiguous-requests` x max-model-len), block size 16, prefix caching off, on the long-tail workload;
- block: paged at block sizes 8 / 16 / 32 / 128 (same budget, prefix caching off, long-tail workload);
- prefix: paged, block 16, prefix caching off vs on, on the prefix-repetition workload;
- dtype: paged b16 on the long-tail workload with each --kv-cache-dtype (float32, bfloat16, int8, fp8) in the same
  budget of bytes: a narrower cache holds more tokens, so more requests run at once;
- disk: the prefix rows' workload with caching on in a RAM pool of `--disk-pool-tokens` only (too small for its
  prefixes), without and with the prefix cache's disk tier (--kv-offload-dir, a fresh temporary folder);
- window: paged b16 on the long-tail workload, the model with full attention vs the same shape with every layer
  sliding by `--sliding-window` tokens (load_model's hf_overrides, as vLLM's --hf-overrides): the pool gives back
  the blocks out of each request's window, so the same budget runs more requests. A memory row: the window changes
  the model, so its tokens are not the full model's.

Columns: peak requests running at once, KV slots allocated vs tokens stored (averaged over the engine steps
that had requests running; stored / allocated is the chapter's "used share"), output tokens/s, TTFT median
and p99, prefix-cache hit rate, preemptions.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from pagedllm.bench import datasets as ds
from pagedllm.bench.arrivals import arrival_times
from pagedllm.errors import UserError

if TYPE_CHECKING:  # the engine (torch) loads only when a sweep runs
    from pagedllm.engine import KVCacheDType

GROUPS = ("allocation", "block", "prefix", "dtype", "disk", "window")


@dataclass
class Setting:
    name: str
    workload: str  # "long-tail" | "prefix-repetition"
    kv_allocation: Literal["paged", "contiguous"] = "paged"
    block_size: int = 16
    enable_prefix_caching: bool = False
    groups: set[str] = field(default_factory=set)
    small_pool: bool = False  # a RAM pool of --disk-pool-tokens instead of the common budget
    kv_offload: bool = False  # with a disk tier under the prefix cache
    kv_cache_dtype: KVCacheDType = "auto"
    window: int | None = None  # hf_overrides' sliding_window: None keeps the model's attention
    full_attention: bool = False  # hf_overrides: no window on any layer


def default_settings(groups: set[str], sliding_window: int = 256) -> list[Setting]:
    rows = [
        Setting("contiguous b16", "long-tail", "contiguous", 16, False, {"allocation"}),
        Setting("paged b16", "long-tail", "paged", 16, False, {"allocation", "block"}),
        Setting("paged b8", "long-tail", "paged", 8, False, {"block"}),
        Setting("paged b32", "long-tail", "paged", 32, False, {"block"}),
        Setting("paged b128", "long-tail", "paged", 128, False, {"block"}),
        Setting("prefix-rep, caching off", "prefix-repetition", "paged", 16, False, {"prefix"}),
        Setting("prefix-rep, caching on", "prefix-repetition", "paged", 16, True, {"prefix"}),
        *[
            Setting(f"paged b16, KV {d}", "long-tail", "paged", 16, False, {"dtype"}, kv_cache_dtype=d)
            for d in ("float32", "bfloat16", "int8", "fp8")
        ],
        Setting("prefix-rep, small pool", "prefix-repetition", "paged", 16, True, {"disk"}, small_pool=True),
        Setting(
            "prefix-rep, small pool + disk tier",
            "prefix-repetition",
            "paged",
            16,
            True,
            {"disk"},
            small_pool=True,
            kv_offload=True,
        ),
        Setting("paged b16, full attention", "long-tail", "paged", 16, False, {"window"}, full_attention=True),
        Setting(
            f"paged b16, sliding window {sliding_window}",
            "long-tail",
            "paged",
            16,
            False,
            {"window"},
            window=sliding_window,
        ),
    ]
    return [r for r in rows if r.groups & groups]


def add_sweep_parser(bench_sub) -> argparse.ArgumentParser:
    p = bench_sub.add_parser(
        "sweep",
        help="the same workload on in-process engines with different KV settings, one row each",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default=None, help="HF folder or GGUF file (default: SmolLM2-135M GGUF)")
    p.add_argument("--dtype", default="auto")
    p.add_argument(
        "--rows",
        default="all",
        help="comma-separated groups: allocation, block, prefix, dtype, disk, window (or all)",
    )
    p.add_argument("--sliding-window", type=int, default=256, help="the window of the window rows, in tokens")
    p.add_argument("--max-model-len", type=int, default=4096, help="also the longest prompt of the long tail")
    p.add_argument(
        "--kv-budget-tokens",
        type=int,
        default=None,
        help="KV cache size in tokens for every row (default: --contiguous-requests x --max-model-len)",
    )
    p.add_argument(
        "--contiguous-requests",
        type=int,
        default=4,
        help="requests the default budget holds under contiguous allocation",
    )
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    g = p.add_argument_group("long-tail workload (allocation and block rows)")
    g.add_argument("--num-prompts", type=int, default=16)
    g.add_argument("--median-len", type=int, default=200, help="median prompt length (log-normal, sigma 1)")
    g.add_argument("--output-len", type=int, default=16)
    g = p.add_argument_group("prefix-repetition workload (prefix rows)")
    g.add_argument("--prefix-num-prompts", type=int, default=16)
    g.add_argument("--num-prefixes", type=int, default=3)
    g.add_argument("--prefix-len", type=int, default=512)
    g.add_argument("--suffix-len", type=int, default=32)
    g.add_argument("--prefix-output-len", type=int, default=8)
    g.add_argument("--disk-pool-tokens", type=int, default=1024, help="the RAM pool of the disk rows, in tokens")
    g = p.add_argument_group("load and report")
    g.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (inf: all at the start)")
    g.add_argument("--burstiness", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument(
        "--no-reuse-weights",
        dest="reuse_weights",
        action="store_false",
        help="load the model afresh for every row (slower; the default loads it once)",
    )
    g.add_argument("--save-result", default=None, metavar="FILE.json")
    g.add_argument("--plot", default=None, metavar="FILE.png")
    g.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    p.set_defaults(func=run_sweep)
    return p


# ---- running one engine -----------------------------------------------------------------------------------


def kv_bytes_per_token(model: str | None, dtype: str) -> int:
    """KV bytes per token of `model` at `dtype` ("auto": the dtype the engine would load it in)."""
    import torch

    from pagedllm import kv
    from pagedllm.model import load_model_config, resolve_dtype

    cfg = load_model_config(model)
    elem = torch.empty((), dtype=resolve_dtype(dtype, cfg)).element_size()
    return kv.kv_bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, elem)


def run_engine(
    engine,
    prompts: list[list[int]],
    output_len: int,
    send_times: np.ndarray,
    on_peak: Callable[[Any], None] | None = None,
) -> dict:
    """Feed the requests at their send times, step until done; per-request TTFT and the stats over steps.

    `on_peak(engine)` is called between steps whenever (KV slots allocated, tokens stored) reaches a new high, so
    the last call sees the fullest moment of the fullest allocation (the sweep's block-map pictures take their
    snapshot there); None costs nothing.
    """
    from pagedllm.sampling_params import SamplingParams

    s0 = engine.stats()
    n = len(prompts)
    arrival, out_tokens = [0.0] * n, [0] * n
    first: list[float | None] = [None] * n
    done: list[float | None] = [None] * n
    allocated: list[int] = []
    stored: list[int] = []
    peak_running = nxt = 0
    peak = (0, 0)
    t0 = time.monotonic()
    while nxt < n or engine.has_unfinished_requests():
        now = time.monotonic()
        while nxt < n and now - t0 >= send_times[nxt]:
            engine.add_request(
                str(nxt), prompts[nxt], SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)
            )
            arrival[nxt] = time.monotonic()
            nxt += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, t0 + send_times[nxt] - time.monotonic()))
            continue
        outs = engine.step()
        t = time.monotonic()
        for o in outs:
            i = int(o.request_id)
            k = len(o.outputs[0].token_ids) if o.outputs else 0
            if k and first[i] is None:
                first[i] = t
            out_tokens[i] = k
            if o.finished:
                done[i] = t
        s = engine.stats()
        peak_running = max(peak_running, s.num_running)
        if s.num_running:
            if on_peak is not None and (s.slots_allocated, s.num_stored_tokens) > peak:
                peak = (s.slots_allocated, s.num_stored_tokens)
                on_peak(engine)
            allocated.append(s.slots_allocated)
            stored.append(s.num_stored_tokens)
    ttfts = [(f - a) for f, a in zip(first, arrival) if f is not None]
    return _summary(engine, s0, time.monotonic() - t0, done, out_tokens, ttfts, allocated, stored, peak_running)


def _summary(
    engine,
    s0,
    duration: float,
    done: list,
    out_tokens: list[int],
    ttfts: list[float],
    allocated: list[int],
    stored: list[int],
    peak_running: int,
) -> dict:
    """A row's figures from what run_engine saw (stats over running steps; counters as differences)."""
    s1 = engine.stats()
    q = s1.prefix_cache_queries - s0.prefix_cache_queries
    h = s1.prefix_cache_hits - s0.prefix_cache_hits
    alloc_mean = float(np.mean(allocated)) if allocated else 0.0
    stored_mean = float(np.mean(stored)) if stored else 0.0
    return {
        "completed": sum(d is not None for d in done),
        "duration": duration,
        "peak_running": max(peak_running, s1.peak_running),  # the engine's own peak catches in-step ones
        "kv_slots_allocated": alloc_mean,
        "kv_tokens_stored": stored_mean,
        "used_share": stored_mean / alloc_mean if alloc_mean else None,
        "peak_kv_slots_allocated": int(max(allocated)) if allocated else 0,
        "output_tokens": sum(out_tokens),
        "output_throughput": sum(out_tokens) / duration if duration > 0 else 0.0,
        "median_ttft_ms": float(np.median(ttfts) * 1000) if ttfts else None,
        "p99_ttft_ms": float(np.percentile(ttfts, 99) * 1000) if ttfts else None,
        "prefix_cache_queries": q,
        "prefix_cache_hits": h,
        "prefix_cache_hit_rate": h / q if q else None,
        "preemptions": s1.num_preemptions - s0.num_preemptions,
        "ttfts": ttfts,
    }


def _build_workloads(args, tokenizer, settings: list[Setting]) -> dict[str, tuple[list, int]]:
    out = {}
    if any(s.workload == "long-tail" for s in settings):
        lens = ds.long_tail_lengths(
            args.num_prompts, max_len=args.max_model_len - args.output_len, median=args.median_len, seed=args.seed
        )
        reqs = ds.lengths_dataset(tokenizer, lens, args.output_len, seed=args.seed)
        out["long-tail"] = ([tokenizer.encode(r.prompt) for r in reqs], args.output_len)
    if any(s.workload == "prefix-repetition" for s in settings):
        reqs = ds.prefix_repetition_dataset(
            tokenizer,
            args.prefix_num_prompts,
            args.num_prefixes,
            args.prefix_len,
            args.suffix_len,
            args.prefix_output_len,
            args.seed,
        )
        out["prefix-repetition"] = ([tokenizer.encode(r.prompt) for r in reqs], args.prefix_output_len)
    return out


COLUMNS = [
    ("setting", "setting", "{}"),
    ("workload", "workload", "{}"),
    ("peak_running", "peak running", "{}"),
    ("kv_slots_allocated", "KV slots alloc", "{:,.0f}"),
    ("kv_tokens_stored", "tokens stored", "{:,.0f}"),
    ("used_share", "used share", "{:.1%}"),
    ("output_throughput", "out tok/s", "{:.1f}"),
    ("median_ttft_ms", "TTFT p50 ms", "{:,.0f}"),
    ("p99_ttft_ms", "TTFT p99 ms", "{:,.0f}"),
    ("prefix_cache_hit_rate", "prefix hit", "{:.1%}"),
    ("preemptions", "preempt", "{}"),
]


def format_table(rows: list[dict], markdown: bool = False) -> str:
    cells = [[h for _, h, _ in COLUMNS]]
    for r in rows:
        cells.append(["-" if r.get(k) is None else f.format(r[k]) for k, _, f in COLUMNS])
    if markdown:
        lines = ["| " + " | ".join(cells[0]) + " |", "|" + "|".join("---" for _ in COLUMNS) + "|"]
        lines += ["| " + " | ".join(c) + " |" for c in cells[1:]]
        return "\n".join(lines)
    widths = [max(len(c[i]) for c in cells) for i in range(len(COLUMNS))]
    return "\n".join(
        "  ".join(c[i].rjust(widths[i]) if i > 1 else c[i].ljust(widths[i]) for i in range(len(COLUMNS))) for c in cells
    )


def _save(args, rows: list[dict], budget_tokens: int, kv_bytes: int) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(args.save_result)), exist_ok=True)
    tmp = args.save_result + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(
            {
                "args": {k: v for k, v in vars(args).items() if k != "func"},
                "kv_budget_tokens": budget_tokens,
                "kv_cache_memory": kv_bytes,
                "rows": rows,
            },
            f,
            indent=1,
            default=str,
        )
    os.replace(tmp, args.save_result)


def _budget_tokens(args: argparse.Namespace, groups: set[str]) -> int:
    """The KV budget every row gets, after checking the flags that must fit in it."""
    budget_tokens = args.kv_budget_tokens or args.contiguous_requests * args.max_model_len
    if budget_tokens < args.max_model_len:
        raise UserError(f"--kv-budget-tokens: {budget_tokens} is less than --max-model-len {args.max_model_len}")
    if "prefix" in groups and args.prefix_len + args.suffix_len + args.prefix_output_len > args.max_model_len:
        raise UserError(
            f"--prefix-len + --suffix-len + --prefix-output-len must fit in --max-model-len {args.max_model_len}"
        )
    if "disk" in groups and args.prefix_len + args.suffix_len + args.prefix_output_len > args.disk_pool_tokens:
        raise UserError(f"--disk-pool-tokens: {args.disk_pool_tokens} cannot hold one prefix-repetition request")
    if args.output_len >= args.max_model_len:
        raise UserError(f"--output-len must be less than --max-model-len {args.max_model_len}")
    return math.ceil(budget_tokens / 128) * 128  # a whole number of blocks at every block size


def _run_row(
    args: argparse.Namespace,
    s: Setting,
    workload: tuple[list, int],
    kv_bytes: int,
    loaded: Any,
    peaks: dict[str, Any] | None,
) -> dict:
    """One setting on a fresh engine; with `peaks`, an allocation row leaves its snapshot at peak KV there."""
    from pagedllm.engine import EngineConfig, LLMEngine, take_snapshot

    prompts, out_len = workload
    tier = tempfile.mkdtemp(prefix="pagedllm-sweep-kv-") if s.kv_offload else None
    cfg = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        block_size=s.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        enable_prefix_caching=s.enable_prefix_caching,
        kv_allocation=s.kv_allocation,
        kv_cache_memory=kv_bytes,
        seed=args.seed,
        log_stats_interval=0,
        kv_offload_dir=tier,
        kv_cache_dtype=s.kv_cache_dtype,
    )
    engine = LLMEngine(cfg, _row_model(args, s) or loaded)

    def on_peak(e: Any) -> None:
        if peaks is not None:
            peaks[s.name] = take_snapshot(e)

    wanted = peaks is not None and "allocation" in s.groups
    times = arrival_times(len(prompts), args.request_rate, args.burstiness, args.seed)
    try:
        res = run_engine(engine, prompts, out_len, times, on_peak if wanted else None)
    finally:
        if tier is not None:
            shutil.rmtree(tier, ignore_errors=True)
    return {
        "setting": s.name,
        "workload": s.workload,
        "kv_allocation": s.kv_allocation,
        "kv_cache_dtype": s.kv_cache_dtype,
        "block_size": s.block_size,
        "enable_prefix_caching": s.enable_prefix_caching,
        "num_blocks": engine.stats().num_blocks,
        **res,
    }


def _row_model(args: argparse.Namespace, s: Setting) -> Any:
    """The window rows' own copy of the model, its attention overridden; None: the row takes the shared one."""
    from pagedllm.model import load_model

    if s.window is None and not s.full_attention:
        return None
    overrides = {"sliding_window": s.window, "layer_types": None}
    return load_model(args.model, args.dtype, verbose=False, hf_overrides=overrides)


def _plot(path: str, rows: list[dict], peaks: dict[str, Any], budget_tokens: int) -> None:
    """The sweep's bars, and beside them (FILE_blocks.png) the allocation rows' block maps at their peak."""
    from pagedllm.bench.block_map_plot import plot_block_maps
    from pagedllm.bench.plot import plot_sweep
    from pagedllm.engine import block_map

    plot_sweep(rows, path, title=f"pagedllm bench sweep: KV budget {budget_tokens:,} tokens")
    if peaks:
        root, ext = os.path.splitext(path)
        maps = {name: block_map(snap) for name, snap in peaks.items()}
        plot_block_maps(
            maps,
            f"{root}_blocks{ext or '.png'}",
            title=f"the same KV budget ({budget_tokens:,} tokens) at peak use: contiguous vs paged",
        )
        print(f"block maps at peak: {root}_blocks{ext or '.png'}", file=sys.stderr)


def run_sweep(args: argparse.Namespace) -> int:
    groups = set(GROUPS) if args.rows == "all" else {g.strip() for g in args.rows.split(",") if g.strip()}
    if not groups or groups - set(GROUPS):
        raise UserError(f"--rows: expected a comma-separated subset of {', '.join(GROUPS)} (or all), got {args.rows!r}")
    if args.sliding_window < 1:
        raise UserError(f"--sliding-window: must be at least 1 token, got {args.sliding_window}")
    settings = default_settings(groups, args.sliding_window)
    budget_tokens = _budget_tokens(args, groups)
    per_token = kv_bytes_per_token(args.model, args.dtype)
    kv_bytes = budget_tokens * per_token
    print(
        f"KV budget: {budget_tokens:,} tokens = {kv_bytes / 2**20:.1f} MiB for every row "
        f"({per_token:,} bytes/token); max-model-len {args.max_model_len}",
        file=sys.stderr,
    )
    from pagedllm.bench.tokenizer import load_bench_tokenizer

    tokenizer = load_bench_tokenizer(args.model)
    workloads = _build_workloads(args, tokenizer, settings)
    for name, (prompts, out_len) in workloads.items():
        lens = sorted(len(p) for p in prompts)
        print(
            f"workload {name}: {len(prompts)} prompts, lengths {lens[0]}..{lens[-1]} (median "
            f"{lens[len(lens) // 2]}), {out_len} output tokens each",
            file=sys.stderr,
        )
    from pagedllm.model import load_model

    shared = args.reuse_weights and any(s.window is None and not s.full_attention for s in settings)
    loaded = load_model(args.model, args.dtype) if shared else None  # one copy of the weights for all rows
    rows: list[dict[str, Any]] = []
    peaks: dict[str, Any] | None = {} if args.plot else None
    for s in settings:
        t = time.monotonic()
        memory = args.disk_pool_tokens * per_token if s.small_pool else kv_bytes
        row = _run_row(args, s, workloads[s.workload], memory, loaded, peaks)
        rows.append({**row, "kv_budget_tokens": budget_tokens})
        print(
            f"[{len(rows)}/{len(settings)}] {s.name}: {time.monotonic() - t:.1f} s, peak running "
            f"{row['peak_running']}, {row['output_throughput']:.1f} out tok/s",
            file=sys.stderr,
        )
        gc.collect()
        if args.save_result:  # after every row, so a long sweep that is cut short keeps what it measured
            _save(args, rows, budget_tokens, kv_bytes)
    print(format_table(rows, args.markdown))
    if args.plot and peaks is not None:
        _plot(args.plot, rows, peaks, budget_tokens)
    return 0
