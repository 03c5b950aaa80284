"""`pagedllm bench sweep`: whole vs paged KV allocation, block size, prefix caching and KV dtype, measured.
One workload, several in-process engines, one row each.

Rows (default `--rows all`):
- allocation: contiguous vs paged KV allocation at the same KV budget (`--kv-budget-tokens`, default
  `--contiguous-requests` x max-model-len), block size 16, prefix caching off, on the long-tail workload;
- block: paged at block sizes 8 / 16 / 32 / 128 (same budget, prefix caching off, long-tail workload);
- prefix: paged, block 16, prefix caching off vs on, on the prefix-repetition workload;
- dtype: paged b16 with each --kv-cache-dtype (float32, bfloat16, int8, fp8) in one budget of bytes: a narrower
  cache holds more tokens, so more requests run at once. By default the budget is half the tokens of the long-tail
  workload without its longest request, at bfloat16, and that workload runs; with --kv-budget-tokens, that budget
  and the whole long tail;
- disk: the prefix rows' workload with caching on in a RAM pool of `--disk-pool-tokens` only (too small for its
  prefixes), without and with the prefix cache's disk tier (--kv-offload-dir, a fresh temporary folder);
- window: paged b16 on the long-tail workload, the model with full attention vs the same shape with every layer
  sliding by `--sliding-window` tokens (load_model's hf_overrides, as vLLM's --hf-overrides): the pool gives back
  the blocks out of each request's window, so the same budget runs more requests. A memory row: the window changes
  the model, so its tokens are not the full model's.

Columns: peak requests running at once, KV slots allocated vs tokens stored (averaged over the engine steps
that had requests running; stored / allocated is the "used share"), output tokens/s, TTFT median
and p99, prefix-cache hit rate, preemptions.
"""

from __future__ import annotations

import argparse
import dataclasses
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
from typing import TYPE_CHECKING, Annotated, Any, Literal

import numpy as np

from pagedllm import report
from pagedllm.bench import datasets as ds
from pagedllm.bench.arrivals import arrival_times
from pagedllm.errors import UserError
from pagedllm.report import Column, Latency
from pagedllm.settings import Field, Flag, add_flags, from_args, settings

if TYPE_CHECKING:  # the engine (torch) loads only when a sweep runs
    from pagedllm.engine import EngineConfig, KVCacheDType

GROUPS = ("allocation", "block", "prefix", "dtype", "disk", "window")


@dataclass
class Setting:
    name: str
    workload: str  # "long-tail" | "long-tail-body" (its longest request dropped) | "prefix-repetition"
    kv_allocation: Literal["paged", "contiguous"] = "paged"
    block_size: int = 16
    enable_prefix_caching: bool = False
    groups: set[str] = field(default_factory=set)
    small_pool: bool = False  # a RAM pool of --disk-pool-tokens instead of the common budget
    kv_offload: bool = False  # with a disk tier under the prefix cache
    kv_cache_dtype: KVCacheDType = "auto"
    window: int | None = None  # hf_overrides' sliding_window: None keeps the model's attention
    full_attention: bool = False  # hf_overrides: no window on any layer


def default_settings(
    groups: set[str], dtype_workload: str = "long-tail-body", sliding_window: int = 256
) -> list[Setting]:
    """The rows of `groups`; the dtype rows run `dtype_workload` (the whole long tail when the user sets the
    budget, its body in the default budget: see dtype_rows_bytes); the window rows slide by `sliding_window`."""
    from pagedllm.kv import KV_DTYPE_ROWS

    rows = [
        Setting("contiguous b16", "long-tail", "contiguous", 16, False, {"allocation"}),
        Setting("paged b16", "long-tail", "paged", 16, False, {"allocation", "block"}),
        Setting("paged b8", "long-tail", "paged", 8, False, {"block"}),
        Setting("paged b32", "long-tail", "paged", 32, False, {"block"}),
        Setting("paged b128", "long-tail", "paged", 128, False, {"block"}),
        Setting("prefix-rep, caching off", "prefix-repetition", "paged", 16, False, {"prefix"}),
        Setting("prefix-rep, caching on", "prefix-repetition", "paged", 16, True, {"prefix"}),
        *[
            Setting(f"paged b16, KV {d}", dtype_workload, "paged", 16, False, {"dtype"}, kv_cache_dtype=d)
            for d in KV_DTYPE_ROWS
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


@settings
class SweepConfig:
    """`bench sweep`'s own settings; the engine's (--model, --dtype, --max-model-len, ...) are EngineConfig's."""

    rows: str = "all"
    """comma-separated row groups to run: allocation, block, prefix, dtype, disk, window, or all (default: all)"""
    sliding_window: int = Field(default=256, ge=1)
    """the window rows' sliding window, in tokens: the model's shape with every layer sliding by it, next to the
    same shape with full attention (default: 256)"""
    kv_budget_tokens: Annotated[int, Field(ge=1)] | None = None
    """KV cache size in tokens for the allocation, block, prefix and dtype rows (default: --contiguous-requests x
    --max-model-len, and for the dtype rows half the long-tail workload's tokens at bfloat16, so that the cache's
    dtype decides how many requests run at once)"""
    contiguous_requests: int = Field(default=4, ge=1)
    """requests the default budget holds under contiguous allocation (default: 4)"""
    num_prompts: int = Field(default=16, ge=1)
    """prompts of the long-tail workload (default: 16)"""
    median_len: int = Field(default=200, ge=1)
    """median prompt length of the long-tail workload, in tokens, log-normal with sigma 1 (default: 200)"""
    output_len: int = Field(default=16, ge=1)
    """output tokens per long-tail request (default: 16)"""
    prefix_num_prompts: int = Field(default=16, ge=1)
    """prompts of the prefix-repetition workload (default: 16)"""
    num_prefixes: int = Field(default=3, ge=1)
    """distinct shared prefixes the prefix-repetition prompts start with (default: 3)"""
    prefix_len: int = Field(default=512, ge=1)
    """tokens of each shared prefix (default: 512)"""
    suffix_len: int = Field(default=32, ge=0)
    """tokens after the prefix, different in every prompt (default: 32)"""
    prefix_output_len: int = Field(default=8, ge=1)
    """output tokens per prefix-repetition request (default: 8)"""
    disk_pool_tokens: int = Field(default=1024, ge=1)
    """the disk rows' RAM pool, in tokens: too small for the prefixes, so the disk tier has to serve them
    (default: 1024)"""
    request_rate: float = Field(default=float("inf"), gt=0)
    """requests per second, gaps gamma-distributed (default: inf, all at the start)"""
    burstiness: float = Field(default=1.0, gt=0)
    """gamma shape of the gaps: below 1 burstier, above 1 more even (default: 1, Poisson)"""
    reuse_weights: bool = True
    """load the model once for every row (default); --no-reuse-weights loads it afresh for each (slower)"""
    save_result: Annotated[str | None, Flag(metavar="FILE.json")] = None
    """write the settings and rows as JSON, after every row (default: not written)"""
    plot: Annotated[str | None, Flag(metavar="FILE.png")] = None
    """draw the rows as bars, and the allocation rows' block maps at peak beside it (default: no picture)"""
    markdown: bool = False
    """print the table as Markdown (default: plain text)"""

    def __post_init__(self) -> None:
        if not self.groups or self.groups - set(GROUPS):
            raise UserError(
                f"--rows: expected a comma-separated subset of {', '.join(GROUPS)} (or all), got {self.rows!r}"
            )

    @property
    def groups(self) -> set[str]:
        return set(GROUPS) if self.rows == "all" else {g.strip() for g in self.rows.split(",") if g.strip()}


ENGINE_FLAGS = ("model", "dtype", "max_model_len", "max_num_seqs", "max_num_batched_tokens", "seed")
FLAG_GROUPS = {
    "rows and KV budget": ("rows", "kv_budget_tokens", "contiguous_requests", "sliding_window"),
    "long-tail workload (allocation, block and dtype rows)": ("num_prompts", "median_len", "output_len"),
    "prefix-repetition workload (prefix and disk rows)": (
        "prefix_num_prompts",
        "num_prefixes",
        "prefix_len",
        "suffix_len",
        "prefix_output_len",
        "disk_pool_tokens",
    ),
    "load and report": ("request_rate", "burstiness", "reuse_weights", "save_result", "plot", "markdown"),
}


def add_sweep_parser(bench_sub) -> argparse.ArgumentParser:
    from pagedllm.engine import EngineConfig

    p = bench_sub.add_parser(
        "sweep",
        help="the same workload on in-process engines with different KV settings, one row each",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_flags(
        p.add_argument_group("engine (every row; --seed also seeds the workloads)"), EngineConfig, only=ENGINE_FLAGS
    )
    for title, names in FLAG_GROUPS.items():
        add_flags(p.add_argument_group(title), SweepConfig, only=names)
    p.set_defaults(func=run_sweep)
    return p


# ---- running one engine -----------------------------------------------------------------------------------


def kv_bytes_per_token(model: str | None, kv_cache_dtype: str, dtype: str = "auto") -> int:
    """KV bytes per token of `model` in a cache of `kv_cache_dtype` (kv/sizing's formula, as the engine counts
    them); "auto" is the model's `dtype`, itself "auto": the dtype the engine would load it in."""
    from pagedllm import kv
    from pagedllm import model as model_api

    cfg = model_api.load_model_config(model)
    name = kv_cache_dtype
    if name == "auto":
        name, _ = model_api.kv_cache_dtype("auto", model_api.resolve_dtype(dtype, cfg))
    return kv.kv_dtype_bytes_per_token(cfg.kv_layout().num_kv_layers, cfg.num_kv_heads, cfg.head_dim, name)


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
    ttft_ms = Latency.of([t * 1000 for t in ttfts])
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
        "median_ttft_ms": ttft_ms.median,
        "p99_ttft_ms": ttft_ms.p99,
        "prefix_cache_queries": q,
        "prefix_cache_hits": h,
        "prefix_cache_hit_rate": h / q if q else None,
        "preemptions": s1.num_preemptions - s0.num_preemptions,
        "ttfts": ttfts,
    }


def _build_workloads(plan: Plan, tokenizer, settings: list[Setting]) -> dict[str, Workload]:
    cfg, seed = plan.sweep, plan.engine.seed
    out = {}
    if any(s.workload.startswith("long-tail") for s in settings):
        lens = ds.long_tail_lengths(
            cfg.num_prompts, max_len=plan.max_model_len - cfg.output_len, median=cfg.median_len, seed=seed
        )
        reqs = ds.lengths_dataset(tokenizer, lens, cfg.output_len, seed=seed)
        out["long-tail"] = Workload([tokenizer.encode(r.prompt) for r in reqs], cfg.output_len)
        prompts = out["long-tail"].prompts
        longest = max(range(len(prompts)), key=lambda i: len(prompts[i]))
        body = [p for i, p in enumerate(prompts) if i != longest] or prompts
        out["long-tail-body"] = Workload(body, cfg.output_len)
    if any(s.workload == "prefix-repetition" for s in settings):
        reqs = ds.prefix_repetition_dataset(
            tokenizer,
            cfg.prefix_num_prompts,
            cfg.num_prefixes,
            cfg.prefix_len,
            cfg.suffix_len,
            cfg.prefix_output_len,
            seed,
        )
        out["prefix-repetition"] = Workload([tokenizer.encode(r.prompt) for r in reqs], cfg.prefix_output_len)
    return out


COLUMNS = [
    Column("setting", "setting", align="<"),
    Column("workload", "workload", align="<"),
    Column("peak_running", "peak running"),
    Column("kv_slots_allocated", "KV slots alloc", "{:,.0f}"),
    Column("kv_tokens_stored", "tokens stored", "{:,.0f}"),
    Column("used_share", "used share", "{:.1%}"),
    Column("output_throughput", "out tok/s", "{:.1f}"),
    Column("median_ttft_ms", "TTFT p50 ms", "{:,.0f}"),
    Column("p99_ttft_ms", "TTFT p99 ms", "{:,.0f}"),
    Column("prefix_cache_hit_rate", "prefix hit", "{:.1%}"),
    Column("preemptions", "preempt"),
]


def format_table(rows: list[dict], markdown: bool = False) -> str:
    return report.format_table(rows, COLUMNS, markdown)


def _save(plan: Plan, rows: list[dict]) -> None:
    path = str(plan.sweep.save_result)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    engine = {k: getattr(plan.engine, k) for k in ENGINE_FLAGS} | {"max_model_len": plan.max_model_len}
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(
            {
                "args": dataclasses.asdict(plan.sweep) | engine,
                "kv_budget_tokens": plan.budget_tokens,
                "kv_cache_memory": plan.budget_tokens * plan.per_token,
                "dtype_rows_kv_cache_memory": plan.dtype_bytes,
                "rows": rows,
            },
            f,
            indent=1,
            default=str,
        )
    os.replace(path + ".tmp", path)


@dataclass
class Workload:
    prompts: list[list[int]]
    output_len: int

    @property
    def longest(self) -> int:
        """Tokens of the longest request, output included: the max-model-len its rows need."""
        return max(len(p) for p in self.prompts) + self.output_len


@dataclass
class Plan:
    """What every row is run with: the settings, the model's bytes per KV token and each kind of row's budget."""

    sweep: SweepConfig
    engine: EngineConfig
    max_model_len: int  # --max-model-len, or the model's
    budget_tokens: int  # the common budget
    per_token: int  # KV bytes per token in a cache of the model's dtype (--kv-cache-dtype auto)
    dtype_bytes: int = 0  # the dtype rows' budget


def check_budget(cfg: SweepConfig, max_model_len: int) -> int:
    """The common KV budget in tokens, after checking the flags that must fit in it."""
    budget_tokens = cfg.kv_budget_tokens or cfg.contiguous_requests * max_model_len
    if budget_tokens < max_model_len:
        raise UserError(f"--kv-budget-tokens: {budget_tokens} is less than --max-model-len {max_model_len}")
    prefix_request = cfg.prefix_len + cfg.suffix_len + cfg.prefix_output_len
    if cfg.groups & {"prefix", "disk"} and prefix_request > max_model_len:
        raise UserError(
            f"--prefix-len + --suffix-len + --prefix-output-len must fit in --max-model-len {max_model_len}"
        )
    if "disk" in cfg.groups and prefix_request > cfg.disk_pool_tokens:
        raise UserError(f"--disk-pool-tokens: {cfg.disk_pool_tokens} cannot hold one prefix-repetition request")
    if cfg.output_len >= max_model_len:
        raise UserError(f"--output-len must be less than --max-model-len {max_model_len}")
    return math.ceil(budget_tokens / 128) * 128  # a whole number of blocks at every block size


def _row_memory(plan: Plan, s: Setting, workload: Workload) -> tuple[int, int]:
    """(KV bytes, max-model-len) of one row. The disk and dtype rows run in a pool smaller than the common one;
    their max-model-len is their longest request, so no engine warns about a --max-model-len nobody set."""
    if s.small_pool:
        return plan.sweep.disk_pool_tokens * plan.per_token, workload.longest
    if "dtype" in s.groups and plan.sweep.kv_budget_tokens is None:
        return plan.dtype_bytes, workload.longest
    return plan.budget_tokens * plan.per_token, plan.max_model_len


def _run_row(plan: Plan, s: Setting, workload: Workload, loaded: Any, peaks: dict[str, Any] | None) -> dict:
    """One setting on a fresh engine; with `peaks`, an allocation row leaves its snapshot at peak KV there."""
    from pagedllm.engine import LLMEngine, take_snapshot

    tier = tempfile.mkdtemp(prefix="pagedllm-sweep-kv-") if s.kv_offload else None
    kv_bytes, max_model_len = _row_memory(plan, s, workload)
    cfg = dataclasses.replace(
        plan.engine,
        block_size=s.block_size,
        max_model_len=max_model_len,
        enable_prefix_caching=s.enable_prefix_caching,
        kv_allocation=s.kv_allocation,
        kv_cache_memory=kv_bytes,
        log_stats_interval=0,
        kv_offload_dir=tier,
        kv_cache_dtype=s.kv_cache_dtype,
    )
    engine = LLMEngine(cfg, _row_model(plan, s) or loaded)

    def on_peak(e: Any) -> None:
        if peaks is not None:
            peaks[s.name] = take_snapshot(e)

    wanted = peaks is not None and "allocation" in s.groups
    times = arrival_times(len(workload.prompts), plan.sweep.request_rate, plan.sweep.burstiness, plan.engine.seed)
    try:
        res = run_engine(engine, workload.prompts, workload.output_len, times, on_peak if wanted else None)
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


def _row_model(plan: Plan, s: Setting) -> Any:
    """The window rows' own copy of the model, its attention overridden; None: the row takes the shared one."""
    from pagedllm.model import load_model

    if s.window is None and not s.full_attention:
        return None
    overrides = {"sliding_window": s.window, "layer_types": None}
    return load_model(plan.engine.model, plan.engine.dtype, verbose=False, hf_overrides=overrides)


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


def model_max_len(model: str | None) -> int:
    """The model's longest context: what --max-model-len defaults to, as in every engine."""
    from pagedllm.model import load_model_config

    return load_model_config(model).max_position_embeddings


def dtype_rows_bytes(plan: Plan, workload: Workload) -> int:
    """The dtype rows' KV bytes: --kv-budget-tokens if given, else half their workload's tokens at bfloat16 (at
    least two of its longest requests), so float32 holds a quarter of the workload, bfloat16 half and the one-byte
    dtypes nearly all of it: how many requests run at once shows what a narrower cache buys. Their workload is
    the long tail without its longest request (max-model-len long), which would otherwise set the budget alone."""
    if plan.sweep.kv_budget_tokens is not None:
        return plan.budget_tokens * plan.per_token
    tokens = sum(len(p) + workload.output_len for p in workload.prompts)
    tokens = math.ceil(max(tokens // 2, 2 * workload.longest) / 256) * 256  # float32 holds whole 128-token blocks
    return tokens * kv_bytes_per_token(plan.engine.model, "bfloat16")


def _plan(args: argparse.Namespace) -> Plan:
    from pagedllm.engine import EngineConfig

    sweep, engine = from_args(SweepConfig, args), EngineConfig.from_args(args)
    max_model_len = engine.max_model_len or model_max_len(engine.model)
    budget_tokens = check_budget(sweep, max_model_len)
    return Plan(sweep, engine, max_model_len, budget_tokens, kv_bytes_per_token(engine.model, "auto", engine.dtype))


def _announce(plan: Plan, workloads: dict[str, Workload]) -> None:
    print(
        f"KV budget: {plan.budget_tokens:,} tokens = {plan.budget_tokens * plan.per_token / 2**20:.1f} MiB "
        f"({plan.per_token:,} bytes/token); max-model-len {plan.max_model_len}"
        + (f"; dtype rows: {plan.dtype_bytes / 2**20:.1f} MiB" if plan.dtype_bytes else ""),
        file=sys.stderr,
    )
    for name, w in workloads.items():
        lens = sorted(len(p) for p in w.prompts)
        print(
            f"workload {name}: {len(lens)} prompts, lengths {lens[0]}..{lens[-1]} (median "
            f"{lens[len(lens) // 2]}), {w.output_len} output tokens each",
            file=sys.stderr,
        )


def run_sweep(args: argparse.Namespace) -> int:
    from pagedllm.bench.tokenizer import load_bench_tokenizer
    from pagedllm.model import load_model

    plan = _plan(args)
    dtype_workload = "long-tail" if plan.sweep.kv_budget_tokens else "long-tail-body"
    settings = default_settings(plan.sweep.groups, dtype_workload, plan.sweep.sliding_window)
    workloads = _build_workloads(plan, load_bench_tokenizer(plan.engine.model), settings)
    if "dtype" in plan.sweep.groups:
        dtype_row = next(s for s in settings if "dtype" in s.groups)
        plan.dtype_bytes = dtype_rows_bytes(plan, workloads[dtype_row.workload])
    _announce(plan, workloads)
    # one copy of the weights for all rows
    shared = plan.sweep.reuse_weights and any(s.window is None and not s.full_attention for s in settings)
    loaded = load_model(plan.engine.model, plan.engine.dtype) if shared else None
    rows: list[dict[str, Any]] = []
    peaks: dict[str, Any] | None = {} if plan.sweep.plot else None
    for s in settings:
        t = time.monotonic()
        row = _run_row(plan, s, workloads[s.workload], loaded, peaks)
        rows.append({**row, "kv_budget_tokens": plan.budget_tokens})
        print(
            f"[{len(rows)}/{len(settings)}] {s.name}: {time.monotonic() - t:.1f} s, peak running "
            f"{row['peak_running']}, {row['output_throughput']:.1f} out tok/s",
            file=sys.stderr,
        )
        gc.collect()
        if plan.sweep.save_result:  # after every row, so a long sweep that is cut short keeps what it measured
            _save(plan, rows)
    print(format_table(rows, plan.sweep.markdown))
    if plan.sweep.plot and peaks is not None:
        _plot(plan.sweep.plot, rows, peaks, plan.budget_tokens)
    return 0
