"""What watching the /kv page costs a busy server: `pagedllm bench serve` with nobody watching, with a client
polling the page's data route as the page does (GET /v1/kv/blocks twice a second), and with the page open in
headless Chromium on the same machine (the browser's own CPU is then part of the cost: the worst case).

    .venv/bin/python -m benchmarks.kv.page_cost --rounds 3

    .venv/bin/python -m benchmarks.kv.page_cost --in-process     # the page's work per poll, pools up to 100,000 blocks

One `pagedllm serve` (engine defaults) serves every run; the modes alternate within each round, in a rotated
order, so a drift of this shared machine spreads over all of them. Prints each run's output tokens/s, the median
per mode and its ratio to nobody watching, and the data route's latency and size as the poller saw them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import httpx

from pagedllm.bench.server_process import serve

MODES = ("none", "poll", "browser")


def start_server(port: int, extra: list[str]) -> subprocess.Popen:
    return serve(port, "--log-level", "warning", *extra)


class Poller:
    """Fetches the page's data as kv.js does: the next request half a second after the last answer."""

    def __init__(self, base: str) -> None:
        self.base, self.stop, self.latencies, self.sizes = base, threading.Event(), [], []
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(base_url=self.base, timeout=30) as http:
            while not self.stop.is_set():
                t = time.perf_counter()
                body = http.get("/v1/kv/blocks?max_cells=8192").content
                self.latencies.append(time.perf_counter() - t)
                self.sizes.append(len(body))
                self.stop.wait(0.5)

    def __enter__(self) -> Poller:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()


class Page:
    """The /kv page open in headless Chromium for the length of a run."""

    def __init__(self, base: str) -> None:
        self.base = base

    def __enter__(self) -> Page:
        from devkit.browser import chromium_driver

        self.driver = chromium_driver()
        self.driver.get(f"{self.base}/kv")
        deadline = time.monotonic() + 30
        while "live" not in self.driver.find_element("id", "status").text:
            if time.monotonic() > deadline:
                raise SystemExit("the page did not start updating")
            time.sleep(0.2)
        return self

    def __exit__(self, *exc) -> None:
        self.driver.quit()


def bench(base: str, args: argparse.Namespace) -> float:
    """One `pagedllm bench serve` run; its output tokens/s."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "r.json")
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pagedllm.entrypoints.cli",
                "bench",
                "serve",
                "--base-url",
                base,
                "--dataset-name",
                "random",
                "--input-len",
                str(args.input_len),
                "--output-len",
                str(args.output_len),
                "--num-prompts",
                str(args.num_prompts),
                "--max-concurrency",
                str(args.max_concurrency),
                "--seed",
                "0",
                "--disable-tqdm",
                "--save-result",
                out,
            ],
            check=True,
            stdout=subprocess.DEVNULL,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )
        with open(out) as f:
            return json.load(f)["output_throughput"]


def run_rounds(base: str, args: argparse.Namespace) -> tuple[dict[str, list[float]], Poller | None]:
    results: dict[str, list[float]] = {m: [] for m in args.modes}
    last_poller = None
    for r in range(args.rounds):
        order = args.modes[r % len(args.modes) :] + args.modes[: r % len(args.modes)]
        for mode in order:
            if mode == "none":
                tps = bench(base, args)
            elif mode == "poll":
                with Poller(base) as last_poller:
                    tps = bench(base, args)
            else:
                with Page(base):
                    tps = bench(base, args)
            results[mode].append(tps)
            print(f"round {r + 1} {mode:>7}: {tps:6.1f} output tok/s   (load {os.getloadavg()[0]:.2f})", flush=True)
    return results, last_poller


def timed(fn, repeat: int) -> tuple[float, float, object]:
    """(best, median) seconds of `repeat` calls, and the last result: on a shared machine the best is the code's
    own cost, the median says how much the neighbours added."""
    times, out = [], None
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return min(times), statistics.median(times), out


def per_poll_cost(pools: str, repeat: int) -> None:
    """The page's work per poll, in-process, on a real `PagedKVCacheManager` filled as a busy server's would be
    (requests of 300 blocks, half sharing a 1,000-token prefix, some finished so that their blocks stay cached in
    the free queue): `take_snapshot` (with the page's token memo, as GET /v1/kv/blocks?max_cells=8192 takes it:
    the part on the engine thread, between two steps; at two polls a second its share of that thread is the time
    x 2), then `block_map` + its JSON through the route's response model (the part on the server's event loop)."""
    from devkit.kv_pool import busy_engine
    from pagedllm.engine.block_map import block_map
    from pagedllm.engine.kv_snapshot import BlockTokens, take_snapshot
    from pagedllm.server.kv_page import kv_blocks_json

    for num_blocks in (int(x) for x in pools.split(",")):
        engine = busy_engine(num_blocks)
        memo = BlockTokens()
        # As the page's poll (GET /v1/kv/blocks?max_cells=8192, no ?detail): no walk of the LRU queue.
        snap_best, snap_med, snap = timed(lambda: take_snapshot(engine, memo=memo, evict_order=False), repeat)
        map_best, map_med, m = timed(lambda: block_map(snap), repeat)
        json_best, json_med, body = timed(lambda: kv_blocks_json(m), repeat)
        c = m.counters
        print(
            f"{num_blocks:>7,} blocks ({c.num_used_blocks:,} held, {c.num_shared_blocks:,} shared, "
            f"{c.num_evictable_blocks:,} cached-free; {m.map.blocks_per_cell} per cell), best / median "
            f"ms: snapshot {1000 * snap_best:.1f} / {1000 * snap_med:.1f} on the engine thread "
            f"({200 * snap_best:.1f}% of it at 2 polls/s); layout {1000 * map_best:.1f} / {1000 * map_med:.1f} + "
            f"JSON {1000 * json_best:.1f} / {1000 * json_med:.1f} on the event loop; {len(body) / 1024:.0f} KiB"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated: none, poll, browser")
    p.add_argument("--port", type=int, default=8631)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--max-concurrency", type=int, default=16)
    p.add_argument("--serve-args", default="", help="extra `pagedllm serve` flags, e.g. '--kv-cache-memory 1GiB'")
    p.add_argument("--in-process", action="store_true", help="time the page's work per poll in-process instead")
    p.add_argument(
        "--pools",
        default="2912,5825,100000",
        help="--in-process pool sizes in blocks (2,912 / 5,825: SmolLM2-135M's default 2 GiB in float32 / bfloat16)",
    )
    p.add_argument("--repeat", type=int, default=10, help="--in-process: calls timed per figure")
    args = p.parse_args()
    if args.in_process:
        per_poll_cost(args.pools, args.repeat)
        return
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not args.modes or set(args.modes) - set(MODES):
        raise SystemExit(f"--modes: a comma-separated subset of {', '.join(MODES)}")
    base = f"http://127.0.0.1:{args.port}"
    print(f"load average before: {os.getloadavg()}", flush=True)
    server = start_server(args.port, args.serve_args.split())
    try:
        info = httpx.get(f"{base}/v1/kv/blocks?max_cells=1").json()
        print(f"pool: {info['num_blocks']:,} blocks of {info['block_size']}", flush=True)
        bench(base, args)  # warm-up, unmeasured
        results, poller = run_rounds(base, args)
    finally:
        server.terminate()
        server.wait(30)
    base_tps = statistics.median(results["none"]) if "none" in results else None
    for mode, values in results.items():
        med = statistics.median(values)
        ratio = f"  {med / base_tps:.3f}x of none" if base_tps else ""
        print(f"{mode:>7}: median {med:6.1f} output tok/s over {values}{ratio}")
    if poller is not None and poller.latencies:
        lat = sorted(poller.latencies)
        print(
            f"GET /v1/kv/blocks: {len(lat)} calls, p50 {1000 * lat[len(lat) // 2]:.1f} ms, max "
            f"{1000 * lat[-1]:.1f} ms, {statistics.median(poller.sizes) / 1024:.0f} KiB"
        )
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
