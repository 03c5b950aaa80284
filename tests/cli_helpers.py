"""`pagedllm ...` for the tests of what the CLI prints on bad input (test_kv_calc.py, test_model_errors.py): one
set of flags as a user runs it (a new process), the rest through the same `main` in this process.

Why not a process for each: a new process is ~3 s of imports on a CI core, the same every time, and what the
flags change is what `main` does, not what starting Python does; the one real process keeps the claim that a fresh
start prints nothing more than the error's line."""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys

from pagedllm.entrypoints.cli import main


def start_cli(argv: list[str]) -> subprocess.Popen:
    """`pagedllm ARGV` in a new process, its stderr piped (read it with `finish`)."""
    command = [sys.executable, "-m", "pagedllm.entrypoints.cli", *argv]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen) -> subprocess.CompletedProcess:
    _, stderr = proc.communicate(timeout=300)
    return subprocess.CompletedProcess(proc.args, proc.returncode, "", stderr)


def run_cli_here(argv: list[str]) -> subprocess.CompletedProcess:
    """`pagedllm ARGV` through `main` in this process: its exit code (argparse's SystemExit included) and what it
    wrote to stderr, as a process's would be."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
    return subprocess.CompletedProcess(["pagedllm", *argv], code, "", err.getvalue())
