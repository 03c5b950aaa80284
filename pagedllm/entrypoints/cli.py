"""The `pagedllm` command: one subcommand per module, so each feature owns its own parser."""
from __future__ import annotations

import argparse
import importlib
import sys

from pagedllm.errors import UserError

# Each module defines `add_parser(subparsers)` that registers its subcommand(s) with `func=...`.
COMMAND_MODULES = [
    "pagedllm.entrypoints.kv_calc",
    "pagedllm.entrypoints.generate",
    "pagedllm.entrypoints.serve",
    "pagedllm.entrypoints.rag",
    "pagedllm.entrypoints.bench",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedllm", description="LLM inference and serving with PagedAttention")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args) or 0
    except UserError as e:  # a user mistake: one line naming the flag, no traceback
        print(f"pagedllm {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
