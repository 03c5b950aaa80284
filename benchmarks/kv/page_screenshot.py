"""A screenshot of the /kv page while a server runs requests, for the docs.

    .venv/bin/python -m benchmarks.kv.page_screenshot --serve-args "--kv-allocation contiguous --max-model-len 512" \
        --out docs/img/kv_page_contiguous.png

Starts `pagedllm serve` with the given flags, sends `--requests` completions whose prompts share one prefix (so a
paged server shows shared blocks; a contiguous one shares nothing and shows its reserved lockers), opens the page
in headless Chromium, waits until they all run, lets them generate for `--settle` seconds and saves the screenshot.
"""

from __future__ import annotations

import argparse
import threading
import time

import httpx

from benchmarks.kv.page_cost import start_server  # noqa: E402

PREFIX = (
    "The library gives every visitor a locker. A whole locker for a small bag wastes the wall, so the "
    "librarian hands out small shelves one at a time. "
)


def send(base: str, n: int, max_tokens: int) -> list[threading.Thread]:
    def one(i: int) -> None:
        httpx.post(
            f"{base}/v1/completions",
            timeout=600,
            json={
                "prompt": PREFIX + f"Visitor {i} asks: " + "why? " * (3 * i + 1),
                "max_tokens": max_tokens,
                "ignore_eos": True,
                "temperature": 0,
            },
        )

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    return threads


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--serve-args", default="", help="`pagedllm serve` flags")
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--settle", type=float, default=3.0, help="seconds of generation before the screenshot")
    p.add_argument("--port", type=int, default=8632)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    from devkit.browser import chromium_driver

    server = start_server(args.port, args.serve_args.split())
    base = f"http://127.0.0.1:{args.port}"
    driver = chromium_driver()
    try:
        driver.get(f"{base}/kv")
        deadline = time.monotonic() + 300
        while "live" not in driver.find_element("id", "status").text:  # the counters exist after a first update
            time.sleep(0.2)
        send(base, args.requests, args.max_tokens)
        while driver.find_element("id", "c-running").text != str(args.requests):
            if time.monotonic() > deadline:
                raise SystemExit("the requests never all ran")
            time.sleep(0.2)
        time.sleep(args.settle)
        driver.save_screenshot(args.out)
        print(f"wrote {args.out}")
    finally:
        driver.quit()
        server.terminate()
        server.wait(30)


if __name__ == "__main__":
    main()
