"""Reading an OpenAI-compatible server's streamed answer (server-sent events), for every client in pagedllm:
`pagedllm bench serve` and the RAG generator share this one parser, so they agree on where a stream ends and
on what an error event is."""
from __future__ import annotations

import json
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator
from typing import Any


class SSEError(Exception):
    """The server sent an error event, or data that is not JSON."""


def parse_line(line: str) -> dict[str, Any] | None:
    """The JSON object one `data:` line carries; None for lines that carry none (blank, comments, other fields).
    Raises StopIteration at `data: [DONE]`, SSEError for an error event or undecodable data."""
    line = line.strip()
    if not line.startswith("data:"):
        return None
    data = line[len("data:"):].strip()
    if data == "[DONE]":
        raise StopIteration
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
    """The stream's chunks, up to `[DONE]` (or the end of the lines)."""
    for line in lines:
        try:
            obj = parse_line(line)
        except StopIteration:
            return
        if obj is not None:
            yield obj


async def aiter_events(lines: AsyncIterable[str]) -> AsyncIterator[dict[str, Any]]:
    """`iter_events` over an async line source (httpx's `aiter_lines()`)."""
    async for line in lines:
        try:
            obj = parse_line(line)
        except StopIteration:
            return
        if obj is not None:
            yield obj
