"""Answering a RAG prompt: with an in-process engine, or against any OpenAI-compatible server (streaming, through
the `openai` SDK)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, cast

import openai
from openai.types.chat import ChatCompletionChunk

from pagedllm.engine import stream_request
from pagedllm.errors import UserError


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


def stream_engine(
    engine, prompt_ids: list[int], params, answer: Answer, request_id: str | None = None
) -> Iterator[str]:
    """Run one request on an in-process `LLMEngine` to completion, yielding text deltas and filling `answer`.
    Other requests already in the engine keep running (their outputs are dropped here): use a dedicated engine."""
    for delta, out in stream_request(engine, request_id or f"rag-{uuid.uuid4().hex[:12]}", prompt_ids, params):
        if delta:
            yield delta
        if out.finished:
            comp = out.outputs[0]
            answer.text, answer.finish_reason = comp.text, comp.finish_reason
            answer.prompt_tokens, answer.cached_tokens = len(out.prompt_token_ids), out.num_cached_tokens
            answer.output_tokens, answer.ttft, answer.e2e = len(comp.token_ids), out.metrics.ttft, out.metrics.e2e


def openai_base_url(base_url: str) -> str:
    """The server's OpenAI base (ending in /v1) from what a user passes: the host, /v1, or the chat URL."""
    base = base_url.rstrip("/").removesuffix("/chat/completions")
    return base if base.endswith("/v1") else base + "/v1"


def first_served_model(client: openai.OpenAI) -> str:
    """The first model the server lists, for a request that names none."""
    try:
        models = client.models.list().data
    except openai.APIError as e:
        raise UserError(f"--base-url: cannot list the models of {client.base_url}: {e}") from None
    if not models:
        raise UserError(f"--base-url: {client.base_url} lists no model; pass --server-model")
    return models[0].id


def _take_chunk(answer: Answer, chunk: ChatCompletionChunk) -> list[str]:
    """Record one chunk's usage and finish reason in `answer`; its content deltas."""
    if chunk.usage:
        answer.prompt_tokens = chunk.usage.prompt_tokens
        answer.output_tokens = chunk.usage.completion_tokens
        details = chunk.usage.prompt_tokens_details
        if details is not None and details.cached_tokens is not None:
            answer.cached_tokens = details.cached_tokens
    deltas = []
    for choice in chunk.choices:
        if choice.delta.content:
            deltas.append(choice.delta.content)
        if choice.finish_reason:
            answer.finish_reason = choice.finish_reason
    return deltas


def stream_openai(
    base_url: str,
    messages: list[dict],
    answer: Answer,
    model: str | None = None,
    max_tokens: int = 256,
    temperature: float = 0.0,
    timeout: float = 600.0,
    api_key: str | None = None,
    client: Any = None,
    frequency_penalty: float = 0.0,
    repetition_penalty: float = 1.0,
) -> Iterator[str]:
    """Chat completion streamed from any OpenAI-compatible server (the `openai` SDK); yields content deltas and
    fills `answer`. `client`: the httpx client the SDK sends through. repetition_penalty (vLLM's and pagedllm's,
    not OpenAI's) is sent only when it asks for something."""
    sdk = openai.OpenAI(
        base_url=openai_base_url(base_url),
        api_key=api_key or "none",
        timeout=timeout,
        max_retries=0,
        http_client=client,
    )
    t0 = time.monotonic()
    parts: list[str] = []
    try:
        stream = sdk.chat.completions.create(
            model=model or first_served_model(sdk),
            messages=cast(Any, messages),  # OpenAI's message dicts
            max_tokens=max_tokens,
            temperature=temperature,
            stream=True,
            stream_options={"include_usage": True},
            frequency_penalty=frequency_penalty,
            extra_body={"repetition_penalty": repetition_penalty} if repetition_penalty != 1.0 else None,
        )
        for chunk in stream:
            for delta in _take_chunk(answer, chunk):
                if answer.ttft is None:
                    answer.ttft = time.monotonic() - t0
                parts.append(delta)
                yield delta
    except openai.APIStatusError as e:
        raise UserError(f"--base-url: the server answered {e.status_code}: {str(e.message)[:300]}") from None
    except openai.APIError as e:
        raise UserError(f"--base-url {base_url}: the stream failed: {e}") from None
    answer.text = "".join(parts)
    answer.e2e = time.monotonic() - t0
