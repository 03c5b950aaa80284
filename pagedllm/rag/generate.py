"""Answering a RAG prompt: with an in-process engine, or against any OpenAI-compatible server (streaming)."""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Iterator

from pagedllm.errors import UserError
from pagedllm.sse import SSEError, iter_events


@dataclass
class Answer:
    """What one generation returned; filled while streaming, complete when the iterator ends."""

    text: str = ""
    prompt_tokens: int = 0
    cached_tokens: int | None = None  # None: the server did not say
    output_tokens: int = 0
    ttft: float | None = None  # seconds from submission to the first token
    e2e: float | None = None
    finish_reason: str | None = None
    extra: dict = field(default_factory=dict)


def stream_engine(engine, prompt_ids: list[int], params, answer: Answer, request_id: str | None = None
                  ) -> Iterator[str]:
    """Run one request on an in-process `LLMEngine` to completion, yielding text deltas. Other requests already in
    the engine keep running (their outputs are dropped here): use a dedicated engine."""
    rid = request_id or f"rag-{uuid.uuid4().hex[:12]}"
    engine.add_request(rid, prompt_ids, params)
    sent = 0
    try:
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id != rid:
                    continue
                comp = out.outputs[0]
                if len(comp.text) > sent:
                    delta = comp.text[sent:]
                    sent = len(comp.text)
                    yield delta
                if out.finished:
                    if comp.finish_reason == "error":
                        raise RuntimeError(f"generation failed: {comp.error}")
                    answer.text = comp.text
                    answer.prompt_tokens = len(out.prompt_token_ids)
                    answer.cached_tokens = out.num_cached_tokens
                    answer.output_tokens = len(comp.token_ids)
                    answer.ttft = out.metrics.ttft
                    answer.e2e = out.metrics.e2e
                    answer.finish_reason = comp.finish_reason
                    return
    finally:
        if answer.finish_reason is None:
            engine.abort_request(rid)


def chat_completions_url(base_url: str) -> str:
    base = base_url.rstrip("/")
    if base.endswith("/chat/completions"):
        return base
    if not base.endswith("/v1"):
        base += "/v1"
    return base + "/chat/completions"


def default_server_model(client, base_url: str) -> str:
    base = base_url.rstrip("/")
    if not base.endswith("/v1"):
        base += "/v1"
    try:
        r = client.get(base + "/models")
        r.raise_for_status()
        data = r.json().get("data") or []
        if data:
            return data[0]["id"]
    except Exception:
        pass
    return "default"


def _take_chunk(answer: Answer, chunk: dict) -> list[str]:
    """Record one chunk's usage and finish reason in `answer`; its content deltas."""
    usage = chunk.get("usage")
    if usage:
        answer.prompt_tokens = usage.get("prompt_tokens", 0)
        answer.output_tokens = usage.get("completion_tokens", 0)
        details = usage.get("prompt_tokens_details") or {}
        if details.get("cached_tokens") is not None:
            answer.cached_tokens = details["cached_tokens"]
    deltas = []
    for choice in chunk.get("choices") or []:
        delta = (choice.get("delta") or {}).get("content")
        if delta:
            deltas.append(delta)
        if choice.get("finish_reason"):
            answer.finish_reason = choice["finish_reason"]
    return deltas


def stream_openai(base_url: str, messages: list[dict], answer: Answer, model: str | None = None,
                  max_tokens: int = 256, temperature: float = 0.0, timeout: float = 600.0,
                  api_key: str | None = None, client=None) -> Iterator[str]:
    """POST /v1/chat/completions with stream=true and yield content deltas (httpx, server-sent events)."""
    import httpx

    own = client is None
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    client = client or httpx.Client(timeout=timeout, headers=headers)
    try:
        body = {
            "model": model or default_server_model(client, base_url),
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        t0 = time.monotonic()
        parts: list[str] = []
        try:
            with client.stream("POST", chat_completions_url(base_url), json=body) as r:
                if r.status_code >= 400:
                    r.read()
                    raise UserError(f"--base-url: the server answered {r.status_code}: {r.text[:300]}")
                for chunk in iter_events(r.iter_lines()):
                    for delta in _take_chunk(answer, chunk):
                        if answer.ttft is None:
                            answer.ttft = time.monotonic() - t0
                        parts.append(delta)
                        yield delta
        except SSEError as e:
            raise UserError(f"--base-url {base_url}: the stream failed: {e}") from None
        except httpx.HTTPError as e:
            raise UserError(f"--base-url {base_url}: {e}") from None
        answer.text = "".join(parts)
        answer.e2e = time.monotonic() - t0
    finally:
        if own:
            client.close()
