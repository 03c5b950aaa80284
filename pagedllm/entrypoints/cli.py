"""The `pagedllm` command: one subcommand per module, so each feature owns its own parser."""

from __future__ import annotations

import argparse
import sys

from pagedllm.entrypoints import bench, generate, kv_calc, rag, serve
from pagedllm.errors import UserError

# Each module defines `add_parser(subparsers)` that registers its subcommand(s) with `func=...`; their heavy
# imports (torch, the server) happen inside the commands, so `pagedllm -h` stays fast.
COMMAND_MODULES = [kv_calc, generate, serve, rag, bench]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedllm", description="LLM inference and serving with PagedAttention")
    sub = parser.add_subparsers(dest="command", required=True)
    for module in COMMAND_MODULES:
        module.add_parser(sub)
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
