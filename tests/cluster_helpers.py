"""Starting `pagedllm serve --replicas N` as a user does, for the cluster tests (test_cluster.py,
test_cluster_lora.py): a subprocess in its own session, as from a terminal, stopped by Ctrl-C."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Cluster:
    """`pagedllm serve --replicas N` as a user runs it, and whether this process joined its Ray as a second
    driver (test_cluster.py does, for its round-robin front door and `ray.kill`)."""

    url: str
    process: subprocess.Popen
    stderr_path: Path
    joined: bool = False

    def stderr(self) -> str:
        return self.stderr_path.read_text()

    def stop(self) -> tuple[int, str, str]:
        """Leave its Ray, then Ctrl-C it (SIGINT to its process group): its exit code, its whole stderr and what
        it printed from the Ctrl-C on (what the tests in between did, e.g. killing a replica, is not its stop)."""
        if self.joined:
            import ray

            ray.shutdown()  # a joined driver only disconnects
            self.joined = False
        before = len(self.stderr())
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGINT)
        rc = self.process.wait(timeout=180)
        whole = self.stderr()
        return rc, whole, whole[before:]


def start_cli(port: int, stderr_path: Path, flags: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    """`pagedllm serve --port PORT FLAGS...` with this environment and `env`, once it says it serves (its stderr
    in `stderr_path`)."""
    argv = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--port", str(port), *flags]
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")} | (env or {})  # Ray's defaults
    with stderr_path.open("w") as err:
        process = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
    deadline = time.monotonic() + 300  # a hang guard, not a speed bound
    while "pagedllm serve: serving" not in stderr_path.read_text():
        if process.poll() is not None or time.monotonic() > deadline:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
            raise AssertionError(f"pagedllm serve did not start:\n{stderr_path.read_text()}")
        time.sleep(0.5)
    return process
