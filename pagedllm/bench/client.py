"""Async streaming client for any OpenAI-compatible server (pagedllm, vLLM, llama.cpp), and the load loop."""

from __future__ import annotations

import asyncio
import time
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import httpx
import numpy as np

from pagedllm.bench.datasets import SampleRequest
from pagedllm.bench.serve_metrics import RequestResult
from pagedllm.errors import UserError
from pagedllm.sse import SSEError, aiter_events

Endpoint = Literal["/v1/completions", "/v1/chat/completions"]
ENDPOINTS: tuple[str, ...] = typing.get_args(Endpoint)


@dataclass
class RequestSettings:
    base_url: str
    endpoint: str = "/v1/completions"
    model: str = ""
    api_key: str | None = None
    ignore_eos: bool = True
    temperature: float = 0.0
    include_usage: bool = True
    extra_body: dict = field(default_factory=dict)

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + self.endpoint

    def headers(self) -> dict[str, str]:
        h = {"Content-Type": "application/json"}
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        return h

    def body(self, req: SampleRequest) -> dict:
        body: dict = {
            "model": self.model,
            "stream": True,
            "max_tokens": req.expected_output_len,
            "temperature": self.temperature,
        }
        if self.endpoint.endswith("/chat/completions"):
            body["messages"] = [{"role": "user", "content": req.prompt}]
        else:
            body["prompt"] = req.prompt
        if self.include_usage:
            body["stream_options"] = {"include_usage": True}
        if self.ignore_eos:
            body["ignore_eos"] = True
        body.update(self.extra_body)
        return body


def _chunk_text(choice: dict) -> str:
    if "delta" in choice:  # chat
        d = choice.get("delta") or {}
        return (d.get("content") or "") + (d.get("reasoning_content") or d.get("reasoning") or "")
    return choice.get("text") or ""


def _take_chunk(r: RequestResult, obj: dict, start: float, last: float | None, text_parts: list[str]) -> float | None:
    """Record one chunk's text (its arrival is a token time) and usage; the time of the last text chunk."""
    now = time.perf_counter()
    text = "".join(_chunk_text(c) for c in obj.get("choices") or [] if isinstance(c, dict))
    if text:
        if last is None:
            r.ttft = now - start
        else:
            r.itl.append(now - last)
        last = now
        text_parts.append(text)
    usage = obj.get("usage")
    if isinstance(usage, dict):
        if usage.get("completion_tokens") is not None:
            r.output_tokens = int(usage["completion_tokens"])
        if usage.get("prompt_tokens") is not None:
            r.prompt_tokens = int(usage["prompt_tokens"])
    return last


async def send_request(client: httpx.AsyncClient, s: RequestSettings, req: SampleRequest) -> RequestResult:
    """One streamed request. A chunk counts as a token when it carries text (vLLM also counts a chat reply's
    role-only first chunk, which makes its TTFT too small)."""
    r = RequestResult(prompt_len=req.prompt_len)
    text_parts: list[str] = []
    st = time.perf_counter()
    r.start_time = st
    last = None
    try:
        async with client.stream("POST", s.url, json=s.body(req), headers=s.headers()) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode("utf-8", "replace")
                r.error = f"HTTP {resp.status_code}: {body[:500]}"
                return r
            try:
                async for obj in aiter_events(resp.aiter_lines()):
                    last = _take_chunk(r, obj, st, last, text_parts)
            except SSEError as e:
                r.error = str(e)
                return r
        end = time.perf_counter()
        r.generated_text = "".join(text_parts)
        if last is None:  # nothing visible came back: first token = end
            r.ttft = end - st
            last = end
        r.latency = last - st
        r.success = True
    except (httpx.HTTPError, OSError) as e:
        r.error = f"{type(e).__name__}: {e}"
    return r


async def fetch_default_model(client: httpx.AsyncClient, base_url: str, api_key: str | None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    url = base_url.rstrip("/") + "/v1/models"
    try:
        resp = await client.get(url, headers=headers)
    except httpx.HTTPError as e:
        raise UserError(f"--base-url: cannot reach {url}: {type(e).__name__}: {e}") from e
    if resp.status_code != 200:
        raise UserError(f"--model not given and {url} answered HTTP {resp.status_code}; pass --model")
    try:
        return resp.json()["data"][0]["id"]
    except (ValueError, KeyError, IndexError, TypeError) as e:
        raise UserError(f"--model not given and {url} lists no model; pass --model") from e


async def fetch_metrics_text(client: httpx.AsyncClient, base_url: str, api_key: str | None) -> str | None:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        resp = await client.get(base_url.rstrip("/") + "/metrics", headers=headers)
    except httpx.HTTPError:
        return None
    return resp.text if resp.status_code == 200 else None


async def run_load(
    client: httpx.AsyncClient,
    settings: RequestSettings,
    requests: Sequence[SampleRequest],
    send_times: np.ndarray,
    max_concurrency: int | None = None,
    progress: bool = True,
) -> tuple[list[RequestResult], float]:
    """Send request i at `send_times[i]` seconds after the start (waiting for a free slot when
    `max_concurrency` is reached); returns the results in request order and the duration in seconds."""
    from tqdm.auto import tqdm

    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(requests), disable=not progress, desc="requests", unit="req")
    start = time.perf_counter()

    async def one(i: int) -> RequestResult:
        delay = start + float(send_times[i]) - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if sem is None:
            res = await send_request(client, settings, requests[i])
        else:
            async with sem:
                res = await send_request(client, settings, requests[i])
        bar.update(1)
        return res

    results = await asyncio.gather(*(one(i) for i in range(len(requests))))
    duration = time.perf_counter() - start
    bar.close()
    return list(results), duration


def make_client(max_connections: int | None = None) -> httpx.AsyncClient:
    limits = httpx.Limits(
        max_connections=max_connections or 10_000, max_keepalive_connections=max_connections or 10_000
    )
    return httpx.AsyncClient(timeout=httpx.Timeout(6 * 3600.0, connect=30.0), limits=limits, trust_env=False)
