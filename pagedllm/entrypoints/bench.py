"""`pagedllm bench ...`: the benchmark subcommand group; each module in BENCH_COMMANDS registers one
sub-subcommand (with `func=...`) through its add_*_parser function."""
from __future__ import annotations

import argparse

from pagedllm.bench import serve_bench, sweep, throughput

BENCH_COMMANDS = [serve_bench.add_serve_parser, sweep.add_sweep_parser, throughput.add_throughput_parser]


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("bench", help="benchmarks: serve (any OpenAI-compatible server), sweep (KV settings)",
                              description="Benchmarks. `pagedllm bench <command> -h` for each.")
    bench_sub = p.add_subparsers(dest="bench_command", required=True)
    for add in BENCH_COMMANDS:
        add(bench_sub)
