"""A server in a child process for a benchmark (or a test) to measure: a free port, `pagedllm serve` started and
waited for until /health answers, stopped as a user's Ctrl-C would. One copy for every script that does it."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from typing import IO, Any

import httpx

PAGEDLLM = [sys.executable, "-m", "pagedllm.entrypoints.cli"]


def free_port() -> int:
    """A loopback port nobody listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(cmd: list[str], base_url: str, timeout: float = 300.0, log: IO[Any] | None = None,
                 env: dict[str, str] | None = None, ready: Callable[[Any], bool] | None = None) -> subprocess.Popen:
    """Start `cmd` and return once GET {base_url}/health answers 200 with a body `ready` accepts; if the process
    exits first or `timeout` passes, it is stopped and RuntimeError says so (with the tail of `log`, a file)."""
    proc = subprocess.Popen(cmd, env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}, stdout=log,
                            stderr=subprocess.STDOUT if log is not None else None)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd[3:5]} exited with status {proc.returncode} while starting{_tail(log)}")
        try:
            r = httpx.get(base_url + "/health", timeout=30)
            if r.status_code == 200 and (ready is None or ready(r.json())):
                return proc
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.5)
    stop(proc)
    raise RuntimeError(f"{cmd[3:5]} did not answer /health within {timeout:g} s{_tail(log)}")


def serve(port: int, *flags: str, timeout: float = 300.0, log: IO[Any] | None = None,
          env: dict[str, str] | None = None) -> subprocess.Popen:
    """`pagedllm serve --port PORT FLAGS...`, ready."""
    return start_server(PAGEDLLM + ["serve", "--port", str(port), *flags], f"http://127.0.0.1:{port}", timeout,
                        log, env)


def stop(proc: subprocess.Popen, timeout: float = 120.0) -> None:
    """SIGINT, as a user's Ctrl-C (a cluster takes Serve and its local Ray down with it); killed if it lingers."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _tail(log: IO[Any] | None) -> str:
    if log is None or not hasattr(log, "name"):
        return ""
    log.flush()
    with open(log.name, errors="replace") as f:
        return ":\n" + f.read()[-2000:]
