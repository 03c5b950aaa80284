"""Server-sent events for both streaming endpoints: the chunk maker, the per-choice pieces, how every stream ends
(an error event, the abort of its engine requests, `[DONE]`) and the response that aborts them on disconnect."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi.responses import StreamingResponse
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from pagedllm.engine.async_engine import EngineDeadError, RequestAbortedError
from pagedllm.engine.outputs import CompletionOutput, RequestOutput
from pagedllm.server.errors import APIError, error_sse
from pagedllm.server.protocol import Usage
from pagedllm.server.protocol_chat import ChatCompletionStreamResponse, ChatStreamChoice
from pagedllm.server.protocol_completion import CompletionStreamChoice, CompletionStreamResponse
from pagedllm.server.protocol_sampling import StreamOptions
from pagedllm.server.serving_engine import EngineRequest, ServingContext

logger = logging.getLogger("pagedllm.server")


def sse(body: dict[str, Any]) -> str:
    return "data: " + json.dumps(body, ensure_ascii=False, separators=(",", ":")) + "\n\n"


def typed_sse(body: dict[str, Any]) -> str:
    """An event of the APIs that name each one (Responses, Messages): `event: <its type>` before its data."""
    return f"event: {body['type']}\n" + sse(body)


# The chunk model of each streamed object.
STREAM_RESPONSES: dict[str, type[CompletionStreamResponse] | type[ChatCompletionStreamResponse]] = {
    "text_completion": CompletionStreamResponse,
    "chat.completion.chunk": ChatCompletionStreamResponse,
}


def stream_schema(model: type[BaseModel]) -> dict[str, Any]:
    """A stream's entry in a route's responses. Before OpenAPI 3.2 a text/event-stream `schema` describes one
    server-sent event, its fields as strings (schemathesis validates each event so): an optional `event` name and
    a `data` that is `model` as JSON (build_app puts its schema in /openapi.json's components), or OpenAI's end
    marker `[DONE]`."""
    payload = {
        "contentMediaType": "application/json",
        "contentSchema": {"$ref": f"#/components/schemas/{model.__name__}"},
    }
    return {
        "schema": {
            "type": "object",
            "required": ["data"],
            "properties": {
                "event": {"type": "string"},
                "data": {"type": "string", "anyOf": [{"const": "[DONE]"}, payload]},
            },
        }
    }


@dataclass
class Chunks:
    """Makes the SSE chunks of one streamed response, completion or chat, each one its object's chunk model
    (STREAM_RESPONSES): every chunk carries the same id, object, creation time and model, and a usage field
    exactly when the request's stream_options ask for one."""

    request_id: str
    object: str
    model: str
    include_usage: bool
    continuous: bool  # usage on every chunk, not only the last
    created: int = field(default_factory=lambda: int(time.time()))

    @classmethod
    def for_request(cls, opts: StreamOptions | None, request_id: str, obj: str, model: str) -> Chunks:
        return cls(
            request_id, obj, model, bool(opts and opts.include_usage), bool(opts and opts.continuous_usage_stats)
        )

    def __call__(
        self, choices: list[CompletionStreamChoice] | list[ChatStreamChoice], usage: Usage | None = None
    ) -> str:
        body: dict[str, Any] = {
            "id": self.request_id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if self.include_usage:
            body["usage"] = usage
        return sse(STREAM_RESPONSES[self.object].model_validate(body).body())


@dataclass
class Piece:
    """What one choice produced since its last chunk: text[text_from:], tokens [tokens_from, tokens_to)."""

    index: int
    text: str
    text_from: int
    tokens_from: int
    tokens_to: int
    done: bool
    first: bool  # the choice's first piece


@dataclass
class _ChoiceState:
    text_sent: int = 0
    tokens_sent: int = 0
    started: bool = False
    finished: bool = False


async def pieces(
    ctx: ServingContext, subs: list[EngineRequest], param: str | None = None
) -> AsyncIterator[tuple[EngineRequest, RequestOutput, CompletionOutput, Piece]]:
    """Each choice's new text and tokens as the engine produces them, skipping outputs that add nothing and
    anything after a choice finished: what both streaming endpoints send, each in its own wrapping. A request
    that fails for its own fault raises a 400 naming `param`, the field of its constraint."""
    states: dict[int, _ChoiceState] = {}
    async for s, out in ctx.merged(subs):
        for c in out.outputs:
            ctx.check_error(c, param)
            idx = s.base + c.index
            st = states.setdefault(idx, _ChoiceState())
            if st.finished:
                continue
            ntok, done = len(c.token_ids), c.finish_reason is not None
            if len(c.text) == st.text_sent and ntok == st.tokens_sent and not done:
                continue
            piece = Piece(idx, c.text[st.text_sent :], st.text_sent, st.tokens_sent, ntok, done, not st.started)
            st.text_sent, st.tokens_sent, st.finished, st.started = len(c.text), ntok, done, True
            yield s, out, c, piece


ErrorEvent = Callable[[APIError], str]


async def events(
    ctx: ServingContext,
    chunks: AsyncGenerator[str],
    subs: list[EngineRequest],
    error_event: ErrorEvent = error_sse,
    done: str | None = "data: [DONE]\n\n",
) -> AsyncGenerator[str]:
    """How every stream ends, whatever ended it: an error becomes an SSE error event (`error_event`: in the
    API's own shape), the engine requests are aborted (freeing their blocks), and `done` (OpenAI's `[DONE]`;
    None for the APIs whose last event says it) closes it unless the client is already gone."""
    try:
        async for chunk in chunks:
            yield chunk
    except asyncio.CancelledError:
        raise
    except (RequestAbortedError, EngineDeadError) as e:
        yield error_event(APIError(f"The request was aborted: {e}", 503))
    except APIError as e:
        yield error_event(e)
    except Exception as e:
        logger.exception("streaming failed")
        yield error_event(APIError(f"Internal server error: {type(e).__name__}: {e}", 500))
    finally:
        await chunks.aclose()
        ctx.abort(subs)
    if done is not None:
        yield done


class SSEResponse(StreamingResponse):
    """Server-sent events; however the response ends (done, disconnect, error), its engine requests are aborted."""

    def __init__(
        self,
        ctx: ServingContext,
        chunks: AsyncGenerator[str],
        subs: list[EngineRequest],
        headers: dict[str, str] | None = None,
        error_event: ErrorEvent = error_sse,
        done: str | None = "data: [DONE]\n\n",
    ) -> None:
        self._gen = events(ctx, chunks, subs, error_event, done)
        self._on_close: Callable[[], None] = lambda: ctx.abort(subs)
        super().__init__(
            self._gen,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})},
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with contextlib.suppress(BaseException):
                await self._gen.aclose()
            self._on_close()
