"""Reading an OpenAI-compatible server's streamed answer (server-sent events), for every client in pagedllm:
`pagedllm bench serve` and the RAG generator share this one parser, so they agree on where a stream ends and
on what an error event is."""
from __future__ import annotations

import json
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator
from typing import Any


class SSEError(Exception):
    """The server sent an error event, or data that is not JSON."""


def _data(line: str) -> str | None:
    """What a `data:` line carries; None for lines that carry none (blank, comments, other fields)."""
    line = line.strip()
    return line[len("data:"):].strip() if line.startswith("data:") else None


def _chunk(data: str) -> dict[str, Any]:
    """One event's JSON object; SSEError for an error event or data that is not a JSON object."""
    try:
        obj = json.loads(data)
    except json.JSONDecodeError:
        raise SSEError(f"bad SSE data: {data[:200]}") from None
    if not isinstance(obj, dict):
        raise SSEError(f"bad SSE data: {data[:200]}")
    err = obj.get("error")
    if err:
        raise SSEError(str(err.get("message", err) if isinstance(err, dict) else err))
    return obj


def iter_events(lines: Iterable[str]) -> Iterator[dict[str, Any]]:
    """The stream's chunks, up to `data: [DONE]` (or the end of the lines)."""
    for line in lines:
        data = _data(line)
        if data == "[DONE]":
            return
        if data is not None:
            yield _chunk(data)


async def aiter_events(lines: AsyncIterable[str]) -> AsyncIterator[dict[str, Any]]:
    """`iter_events` over an async line source (httpx's `aiter_lines()`)."""
    async for line in lines:
        data = _data(line)
        if data == "[DONE]":
            return
        if data is not None:
            yield _chunk(data)
