"""`pagedllm bench ...`: the benchmark subcommand group.

Each entry of BENCH_COMMANDS names a function `add_X_parser(bench_subparsers)` that registers one
sub-subcommand (with `func=...`); to add one (e.g. `throughput`), append its "module:function" here.
"""
from __future__ import annotations

import importlib

BENCH_COMMANDS = [
    "pagedllm.bench.serve:add_serve_parser",
    "pagedllm.bench.sweep:add_sweep_parser",
    "pagedllm.bench.throughput:add_throughput_parser",
]


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("bench", help="benchmarks: serve (any OpenAI-compatible server), sweep (KV settings)",
                              description="Benchmarks. `pagedllm bench <command> -h` for each.")
    bench_sub = p.add_subparsers(dest="bench_command", required=True)
    for spec in BENCH_COMMANDS:
        module, func = spec.split(":")
        getattr(importlib.import_module(module), func)(bench_sub)
