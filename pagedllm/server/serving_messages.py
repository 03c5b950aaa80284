"""POST /v1/messages: Anthropic's Messages API over the chat serving, for clients written against it (the
`anthropic` SDK): the request is made a chat request (`MessagesRequest.to_chat`), prepared, run and parsed for
tool calls as one; its answer is given as text and `tool_use` blocks, whole or as Anthropic's stream events
(message_start ... message_stop); every error in Anthropic's shape (errors.py, on this path)."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Depends, Request, Response

from pagedllm.server import serving_chat
from pagedllm.server.errors import ANTHROPIC_ERROR_RESPONSES, APIError, anthropic_error_sse
from pagedllm.server.protocol import Usage
from pagedllm.server.protocol_chat import ChatCompletionRequest, DeltaMessage
from pagedllm.server.protocol_messages import (
    CHAT_FIELDS,
    AnthropicUsage,
    MessageObject,
    MessagesRequest,
    MessageStreamEvent,
    StopReason,
    TextBlock,
    ToolUseBlock,
)
from pagedllm.server.serving_engine import (
    EngineRequest,
    ServingContext,
    cancel_on_disconnect,
    json_response,
    request_id,
    serving,
)
from pagedllm.server.streaming import SSEResponse, stream_schema, typed_sse

router = APIRouter()


def _tool_id(call_id: str) -> str:
    """Anthropic's tool_use ids (`toolu_...`) for the chat's call ids, the same whole or streamed."""
    return "toolu_" + call_id.removeprefix("call_")


def _input(arguments: str) -> dict[str, Any]:
    """A call's arguments as the object `tool_use.input` is; {} for arguments cut off (max_tokens) or not an
    object, which a stream's client reads from its partial JSON as far as it goes."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _stop(finish_reason: str | None, stop_reason: int | str | None, called: bool) -> tuple[StopReason, str | None]:
    """Anthropic's stop_reason and stop_sequence for the chat's finish and stop reasons."""
    if finish_reason == "length":
        return "max_tokens", None
    if called:
        return "tool_use", None
    if isinstance(stop_reason, str):
        return "stop_sequence", stop_reason
    return "end_turn", None


def _usage(u: Usage, output_tokens: int | None = None) -> AnthropicUsage:
    cached = u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details else None
    return AnthropicUsage(
        input_tokens=u.prompt_tokens,
        output_tokens=u.completion_tokens if output_tokens is None else output_tokens,
        cache_read_input_tokens=cached,
    )


async def _whole(
    ctx: ServingContext, chat: ChatCompletionRequest, prep: serving_chat.Prepared, subs: list[EngineRequest], rid: str
) -> MessageObject:
    answer = await serving_chat.full(ctx, chat, prep, subs, rid)
    choice = answer.choices[0]
    blocks: list[TextBlock | ToolUseBlock] = []
    if choice.message.content:
        blocks.append(TextBlock(type="text", text=choice.message.content))
    for call in choice.message.tool_calls:
        blocks.append(
            ToolUseBlock(
                type="tool_use", id=_tool_id(call.id), name=call.function.name, input=_input(call.function.arguments)
            )
        )
    reason, sequence = _stop(choice.finish_reason, choice.stop_reason, bool(choice.message.tool_calls))
    return MessageObject(
        id=rid,
        type="message",
        role="assistant",
        model=prep.model,
        content=blocks,
        stop_reason=reason,
        stop_sequence=sequence,
        usage=_usage(answer.usage),
    )


def _event(kind: str, **fields: Any) -> str:
    return typed_sse(MessageStreamEvent(type=kind, **fields).body())


@dataclass
class _Blocks:
    """The content blocks of a streamed message: which one is open (its index), and of which kind."""

    count: int = 0
    open: str | None = None  # "text" or "tool_use"
    events: list[str] = field(default_factory=list)

    def start(self, block: TextBlock | ToolUseBlock) -> None:
        self.stop()
        self.events.append(_event("content_block_start", index=self.count, content_block=block))
        self.open = block.type

    def delta(self, delta: dict[str, Any]) -> None:
        self.events.append(_event("content_block_delta", index=self.count, delta=delta))

    def stop(self) -> None:
        if self.open is not None:
            self.events.append(_event("content_block_stop", index=self.count))
            self.count += 1
            self.open = None

    def add(self, delta: DeltaMessage) -> list[str]:
        """The events of what one chat delta adds."""
        if delta.content:
            if self.open != "text":
                self.start(TextBlock(type="text", text=""))
            self.delta({"type": "text_delta", "text": delta.content})
        for t in delta.tool_calls or []:
            if t.id is not None:
                self.start(ToolUseBlock(type="tool_use", id=_tool_id(t.id), name=t.function.name or "", input={}))
            elif t.function.arguments:
                self.delta({"type": "input_json_delta", "partial_json": t.function.arguments})
        sent, self.events = self.events, []
        return sent


async def _stream(
    ctx: ServingContext, chat: ChatCompletionRequest, prep: serving_chat.Prepared, subs: list[EngineRequest], rid: str
) -> AsyncGenerator[str]:
    """message_start goes with the first delta: only then is the prefix cache's share known (Anthropic's
    message_start carries cache_read_input_tokens); message_delta's usage says it again, as Anthropic's does."""
    pending = serving_chat.deltas(ctx, chat, subs)
    first = await anext(pending, None)
    cached = first.out.num_cached_tokens if first is not None else 0
    start_usage = AnthropicUsage(input_tokens=len(prep.prompt_ids), output_tokens=0, cache_read_input_tokens=cached)
    start = MessageObject(
        id=rid,
        type="message",
        role="assistant",
        model=prep.model,
        content=[],
        stop_reason=None,
        stop_sequence=None,
        usage=start_usage,
    )
    yield _event("message_start", message=start)
    blocks, last = _Blocks(), first
    for sent in blocks.add(first.delta) if first is not None else []:
        yield sent
    async for d in pending:
        for sent in blocks.add(d.delta):
            yield sent
        last = d
    blocks.stop()
    for sent in blocks.events:
        yield sent
    assert last is not None  # a choice's last delta is always sent
    called = last.parser is not None and bool(last.parser.ids)
    reason, sequence = _stop(last.choice.finish_reason, last.choice.stop_reason, called)
    u = _usage(ctx.usage(subs))
    usage = {"input_tokens": u.input_tokens, "output_tokens": u.output_tokens, "cache_read_input_tokens": cached}
    yield _event("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence}, usage=usage)
    yield _event("message_stop")


@router.post(
    "/v1/messages",
    response_model=None,
    responses={
        200: {
            "model": MessageObject,
            "content": {"text/event-stream": stream_schema(MessageStreamEvent)},
            "description": "the message, or with stream: true Anthropic's server-sent events",
        },
        **ANTHROPIC_ERROR_RESPONSES,
    },
)
async def create_message(req: MessagesRequest, request: Request, ctx: ServingContext = Depends(serving)) -> Response:
    """Anthropic's Messages API: text and tool_use blocks, stop sequences, streaming."""
    rid = request_id(request, None, "msg").replace("msg-", "msg_", 1)  # Anthropic's ids: msg_...
    try:
        body = req.to_chat()
    except ValueError as e:
        raise APIError(str(e), 400, param="messages") from None
    chat, prep = await serving_chat.prepare_chat(ctx, body, CHAT_FIELDS)
    subs = await ctx.submit([prep.prompt_ids], prep.params, rid)
    if req.stream:
        return SSEResponse(ctx, _stream(ctx, chat, prep, subs, rid), subs, error_event=anthropic_error_sse, done=None)
    return json_response(await cancel_on_disconnect(request, _whole(ctx, chat, prep, subs, rid)))
