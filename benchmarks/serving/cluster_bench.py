"""`pagedllm bench serve` against the cluster, one configuration after another in one sitting: 1 vs N replicas,
round-robin vs prefix (vs kv-events) routing. Each configuration is a fresh `pagedllm serve --replicas N --routing
R` (cold caches), measured with the same workload, then stopped; the table at the end has throughput, TTFT and the
cluster-wide prefix-cache hit rate (from the replicas' /metrics, summed over the `replica` label).

    python -m benchmarks.serving.cluster_bench --configs 1:prefix 2:round-robin 2:prefix 2:kv-events \\
        --serve-args "--kv-cache-memory 256MiB --max-model-len 2048" \\
        --bench-args "--dataset-name prefix-repetition --num-prompts 64 --num-prefixes 8 --prefix-len 256 \\
                      --suffix-len 32 --output-len 16 --max-concurrency 4"
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys

from pagedllm.bench.server_process import PAGEDLLM, free_port, start_server, stop


def start_cluster(replicas: int, routing: str, port: int, serve_args: list[str], log: str) -> subprocess.Popen:
    cmd = PAGEDLLM + ["serve", "--replicas", str(replicas), "--routing", routing, "--port", str(port), *serve_args]
    print("$", shlex.join(cmd[1:]), file=sys.stderr, flush=True)
    with open(log, "w") as out:
        return start_server(
            cmd,
            f"http://127.0.0.1:{port}",
            timeout=900,
            log=out,
            ready=lambda health: len(health.get("replicas", {})) == replicas,
        )


def run_one(replicas: int, routing: str, args: argparse.Namespace) -> dict:
    port = free_port()
    name = f"{replicas}x-{routing}"
    server = start_cluster(replicas, routing, port, shlex.split(args.serve_args), os.path.join(args.out, name + ".log"))
    try:
        load = os.getloadavg()[0]
        result = os.path.join(args.out, name + ".json")
        cmd = PAGEDLLM + [
            "bench",
            "serve",
            "--base-url",
            f"http://127.0.0.1:{port}",
            "--save-result",
            result,
            "--disable-tqdm",
            *shlex.split(args.bench_args),
        ]
        print("$", shlex.join(cmd[1:]), file=sys.stderr, flush=True)
        subprocess.run(cmd, check=True)
    finally:
        stop(server)
    with open(result, encoding="utf-8") as f:
        res = json.load(f)
    return {
        "config": name,
        "load": load,
        **{
            k: res.get(k)
            for k in (
                "completed",
                "failed",
                "duration",
                "request_throughput",
                "output_throughput",
                "mean_ttft_ms",
                "median_ttft_ms",
                "p99_ttft_ms",
                "prefix_cache_hit_rate",
            )
        },
    }


def table(rows: list[dict]) -> str:
    head = (
        "| config | load (1 min) | done | req/s | output tok/s | mean TTFT ms | median TTFT ms | p99 TTFT ms "
        "| cluster hit rate |\n|---|---|---|---|---|---|---|---|---|"
    )
    lines = [
        f"| {r['config']} | {r['load']:.1f} | {r['completed']} | {r['request_throughput']:.2f} | "
        f"{r['output_throughput']:.1f} | {r['mean_ttft_ms']:.0f} | {r['median_ttft_ms']:.0f} | "
        f"{r['p99_ttft_ms']:.0f} | {r['prefix_cache_hit_rate']:.1%} |"
        for r in rows
    ]
    return "\n".join([head, *lines])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--configs",
        nargs="+",
        default=["1:prefix", "2:round-robin", "2:prefix"],
        help="REPLICAS:ROUTING, each measured on a fresh cluster",
    )
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
