"""A bounded mixed load against a pagedllm server on loopback, for N minutes: does it stay up, answer every bad
request with a 4xx, keep its memory flat and give back every KV block?

Usage: python -m benchmarks.serving.soak [--minutes 10] [--concurrency 8] [--base-url URL --api-key KEY --pid PID]
Without --base-url it starts `pagedllm serve` itself (default model, small limits so bursts hit
--max-waiting-requests). Prints requests, outcomes by kind, p50/p99 latency of completed requests, the server's
RSS at the start and after every minute, and the KV blocks still held once the load stopped (must be 0).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time
from collections import Counter

import httpx
import psutil

from pagedllm.bench.server_process import free_port, serve

WORDS = "the a cat dog sat ran on under mat tree Paris river is was of and but quickly slowly".split()
BAD_BODIES = [
    b'{"prompt": "a\\ud800b", "max_tokens": 2}',
    b'{"prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
    b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}",
    b'{"prompt": "hi", "temperature": Infinity}',
    b'{"prompt": [true, false]}',
    b'{"prompt": "hi", "best_of": 5}',
    b'{"prompt": "hi", "logit_bias": {"abc": 5}}',
    b'{"prompt": "hi", "top_k": 1180591620717411303424}',
    b'{"prompt": "hi", "n": 1000}',
    b'{"prompt": "hi",',
    b'{"messages": [{"role": "wizard", "content": "hi"}]}',
    b"[1, 2, 3]",
]


def _server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = serve(
        port,
        "--api-key",
        args.api_key,
        "--max-num-seqs",
        "8",
        "--max-waiting-requests",
        "8",
        "--max-model-len",
        "1024",
        "--kv-cache-memory",
        "64MiB",
        "--log-level",
        "warning",
    )
    return proc, f"http://127.0.0.1:{port}"


def _body(rng: random.Random) -> tuple[str, dict]:
    prompt = " ".join(rng.choices(WORDS, k=rng.randint(3, 200)))
    body = {
        "max_tokens": rng.randint(1, 32),
        "temperature": rng.choice([0, 0.7, 1.0]),
        "seed": rng.randint(0, 99),
        "n": rng.choice([1, 1, 1, 2]),
        "stream": rng.random() < 0.5,
    }
    if rng.random() < 0.3:
        body["stop"] = rng.sample(WORDS, 2)
    if rng.random() < 0.5:
        return "/v1/completions", {**body, "prompt": prompt, "logprobs": rng.choice([None, 1])}
    return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": prompt}]}


async def _one(
    client: httpx.AsyncClient, rng: random.Random, stats: Counter, latencies: list[float], bad_share: float
) -> None:
    """One request of a random kind; its outcome counted as kind:status (or kind:ExceptionName)."""
    kind = rng.choices(["normal", "cut", "bad"], weights=[0.8 * (1 - bad_share), 0.2 * (1 - bad_share), bad_share])[0]
    t0 = time.perf_counter()
    try:
        if kind == "bad":
            r = await client.post("/v1/completions", content=rng.choice(BAD_BODIES))
            stats[f"bad:{r.status_code}"] += 1
            return
        path, body = _body(rng)
        if kind == "cut":
            body["stream"] = True
        async with client.stream("POST", path, json=body) as r:
            events = 0
            async for line in r.aiter_lines():
                events += line.startswith("data: ")
                if kind == "cut" and events >= rng.randint(1, 4):
                    break
                if r.status_code == 200 and '"code":5' in line.replace(" ", ""):
                    stats[f"{kind}:stream-error"] += 1
        stats[f"{kind}:{r.status_code}"] += 1
        if kind == "normal" and r.status_code == 200:
            latencies.append(time.perf_counter() - t0)
        if r.status_code == 503:  # overloaded: back off as Retry-After says, as a real client would
            await asyncio.sleep(float(r.headers.get("retry-after", 1)))
    except httpx.HTTPError as e:
        stats[f"{kind}:{type(e).__name__}"] += 1


async def _rss_every(server: psutil.Process | None, seconds: float, deadline: float, samples: list[float]) -> None:
    """The server's RSS (MiB) every `seconds`: a leak climbs all along, warm-up (buffers for the largest batch,
    the allocator's arenas) levels off."""
    while server is not None and time.monotonic() < deadline:
        samples.append(round(server.memory_info().rss / 2**20, 1))
        await asyncio.sleep(seconds)


async def _load(
    base: str,
    key: str,
    minutes: float,
    concurrency: int,
    seed: int,
    bad_share: float,
    server: psutil.Process | None,
    rss: list[float],
) -> tuple[Counter, list[float]]:
    stats: Counter = Counter()
    latencies: list[float] = []
    deadline = time.monotonic() + minutes * 60
    headers = {"Authorization": f"Bearer {key}"}
    limits = httpx.Limits(max_connections=concurrency + 32)
    async with httpx.AsyncClient(base_url=base, headers=headers, timeout=300, limits=limits) as client:

        async def worker(i: int) -> None:
            rng = random.Random(seed * 1000 + i)
            while time.monotonic() < deadline:
                await _one(client, rng, stats, latencies, bad_share)

        async def bursts() -> None:  # 24 at once every 20 s: over --max-waiting-requests on purpose
            rng = random.Random(seed)
            while time.monotonic() < deadline - 20:
                await asyncio.sleep(20)
                await asyncio.gather(*(_one(client, rng, stats, latencies, bad_share) for _ in range(24)))

        await asyncio.gather(bursts(), _rss_every(server, 60, deadline, rss), *(worker(i) for i in range(concurrency)))
    return stats, latencies


def _drained(base: str, key: str, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        state = httpx.get(base + "/v1/kv", headers={"Authorization": f"Bearer {key}"}).json()
        if (state["num_running"] == state["num_waiting"] == state["used_blocks"] == 0) or time.monotonic() > deadline:
            return state
        time.sleep(0.5)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--bad-share",
        type=float,
        default=0.2,
        help="share of malformed requests (0: valid traffic only, to compare memory across versions)",
    )
    p.add_argument("--base-url", default=None)
    p.add_argument("--api-key", default="sk-soak")
    p.add_argument("--pid", type=int, default=None, help="the server's pid, for RSS (with --base-url)")
    args = p.parse_args()
    proc = None
    if args.base_url is None:
        proc, args.base_url = _server(args)
        args.pid = proc.pid
    server = psutil.Process(args.pid) if args.pid else None
    rss: list[float] = []
    t0 = time.monotonic()
    stats, lat = asyncio.run(
        _load(args.base_url, args.api_key, args.minutes, args.concurrency, args.seed, args.bad_share, server, rss)
    )
    elapsed = time.monotonic() - t0
    state = _drained(args.base_url, args.api_key)
    lat.sort()
    report = {
        "minutes": round(elapsed / 60, 2),
        "requests": sum(stats.values()),
        "outcomes": dict(sorted(stats.items())),
        # 503 + Retry-After is the designed answer to overload; anything else 5xx is a failure
        "server_errors_5xx": sum(
            v for k, v in stats.items() if (k.split(":")[1].startswith("5") and not k.endswith(":503")) or "error" in k
        ),
        "latency_p50_s": round(lat[len(lat) // 2], 3) if lat else None,
        "latency_p99_s": round(lat[int(len(lat) * 0.99)], 3) if lat else None,
        "rss_mib_each_minute": rss + ([round(server.memory_info().rss / 2**20, 1)] if server else []),
        "blocks_leaked": state["used_blocks"],
        "running_after": state["num_running"],
        "waiting_after": state["num_waiting"],
        "healthy_after": httpx.get(args.base_url + "/health").status_code,
    }
    print(json.dumps(report, indent=1))
    if proc is not None:
        proc.terminate()
        report["exit_status"] = proc.wait(60)
        print(f"server exit status after SIGTERM: {report['exit_status']}")
    if report["blocks_leaked"] or report["server_errors_5xx"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
