"""`pagedllm bench serve` against the cluster, one configuration after another in one sitting: 1 vs N replicas,
round-robin vs prefix (vs kv-events) routing. Each configuration is a fresh `pagedllm serve --replicas N --routing
R` (cold caches), measured with the same workload, then stopped; the table at the end has throughput, TTFT and the
cluster-wide prefix-cache hit rate (from the replicas' /metrics, summed over the `replica` label).

    python benchmarks/cluster_bench.py --configs 1:prefix 2:round-robin 2:prefix 2:kv-events \\
        --serve-args "--kv-cache-memory 256MiB --max-model-len 2048" \\
        --bench-args "--dataset-name prefix-repetition --num-prompts 64 --num-prefixes 8 --prefix-len 256 \\
                      --suffix-len 32 --output-len 16 --max-concurrency 4"
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time

import httpx

CLI = [sys.executable, "-m", "pagedllm.entrypoints.cli"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_cluster(replicas: int, routing: str, port: int, serve_args: list[str], log: str) -> subprocess.Popen:
    cmd = CLI + ["serve", "--replicas", str(replicas), "--routing", routing, "--port", str(port), *serve_args]
    print("$", shlex.join(cmd[1:]), file=sys.stderr, flush=True)
    server = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the cluster exited ({server.returncode}); see {log}")
        try:
            health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=30).json()
            if len(health.get("replicas", {})) == replicas:
                return server
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(2)
    stop(server)
    raise RuntimeError(f"the cluster did not come up in 15 minutes; see {log}")


def stop(server: subprocess.Popen) -> None:
    """SIGINT, as a user's Ctrl-C: the command takes Serve and its local Ray down with it."""
    server.send_signal(signal.SIGINT)
    try:
        server.wait(120)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


def run_one(replicas: int, routing: str, args: argparse.Namespace) -> dict:
    port = free_port()
    name = f"{replicas}x-{routing}"
    server = start_cluster(replicas, routing, port, shlex.split(args.serve_args), os.path.join(args.out, name + ".log"))
    try:
        load = os.getloadavg()[0]
        result = os.path.join(args.out, name + ".json")
        cmd = CLI + ["bench", "serve", "--base-url", f"http://127.0.0.1:{port}", "--save-result", result,
                     "--disable-tqdm", *shlex.split(args.bench_args)]
        print("$", shlex.join(cmd[1:]), file=sys.stderr, flush=True)
        subprocess.run(cmd, check=True)
    finally:
        stop(server)
    with open(result, encoding="utf-8") as f:
        res = json.load(f)
    return {"config": name, "load": load, **{k: res.get(k) for k in (
        "completed", "failed", "duration", "request_throughput", "output_throughput", "mean_ttft_ms",
        "median_ttft_ms", "p99_ttft_ms", "prefix_cache_hit_rate")}}


def table(rows: list[dict]) -> str:
    head = ("| config | load (1 min) | done | req/s | output tok/s | mean TTFT ms | median TTFT ms | p99 TTFT ms "
            "| cluster hit rate |\n|---|---|---|---|---|---|---|---|---|")
    lines = [f"| {r['config']} | {r['load']:.1f} | {r['completed']} | {r['request_throughput']:.2f} | "
             f"{r['output_throughput']:.1f} | {r['mean_ttft_ms']:.0f} | {r['median_ttft_ms']:.0f} | "
             f"{r['p99_ttft_ms']:.0f} | {r['prefix_cache_hit_rate']:.1%} |" for r in rows]
    return "\n".join([head, *lines])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", nargs="+", default=["1:prefix", "2:round-robin", "2:prefix"],
                   help="REPLICAS:ROUTING, each measured on a fresh cluster")
    p.add_argument("--serve-args", default="", help="more `pagedllm serve` flags (engine and server)")
    p.add_argument("--bench-args", default="--dataset-name prefix-repetition", help="`pagedllm bench serve` flags")
    p.add_argument("--out", default="out/cluster-bench")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for spec in args.configs:
        replicas, routing = spec.split(":")
        rows.append(run_one(int(replicas), routing, args))
        print(table(rows), flush=True)
    with open(os.path.join(args.out, "rows.json"), "w", encoding="utf-8") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
