"""POST /v1/responses: OpenAI's Responses API, stateless (nothing is stored, so no previous_response_id), over
the chat serving: the request is made a chat request (`ResponsesRequest.to_chat`), prepared, run and parsed for
tool calls as one, and its answer is given as the Responses API's output items (a message with its text, a
function_call per call), whole or as its typed events (response.created ... response.completed)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Depends, Request, Response

from pagedllm.server import serving_chat
from pagedllm.server.errors import ERROR_RESPONSES, APIError
from pagedllm.server.protocol import Usage
from pagedllm.server.protocol_chat import ChatCompletionRequest, DeltaMessage
from pagedllm.server.protocol_responses import (
    CHAT_FIELDS,
    FunctionCallItem,
    IncompleteDetails,
    InputTokensDetails,
    OutputItem,
    OutputMessage,
    OutputText,
    OutputTokensDetails,
    ResponseObject,
    ResponsesRequest,
    ResponseStreamEvent,
    ResponseUsage,
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


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class _Output:
    """A response's output items as they are made (whole or streamed: the same items, the same ids)."""

    items: list[OutputItem] = field(default_factory=list)
    open: bool = False  # the last item is still growing

    def text(self, piece: str) -> tuple[OutputMessage, bool]:
        """The message item the piece of text goes to; whether it was opened for it."""
        last = self.items[-1] if self.items and self.open else None
        if isinstance(last, OutputMessage):
            last.content[0].text += piece
            return last, False
        part = OutputText(type="output_text", text=piece, annotations=[], logprobs=[])
        item = OutputMessage(type="message", id=_item_id("msg"), status="in_progress", role="assistant", content=[part])
        self.items.append(item)
        self.open = True
        return item, True

    def call(self, call_id: str, name: str) -> FunctionCallItem:
        item = FunctionCallItem(
            type="function_call", id=_item_id("fc"), call_id=call_id, name=name, arguments="", status="in_progress"
        )
        self.items.append(item)
        self.open = True
        return item

    def finish(self, status: str) -> None:
        for item in self.items:
            item.status = "completed" if status == "completed" else "incomplete"
        self.open = False


def _response(
    req: ResponsesRequest, model: str, rid: str, created: int, out: _Output, status: str, usage: Usage | None
) -> ResponseObject:
    fmt = req.text.format if req.text is not None and req.text.format is not None else None
    return ResponseObject(
        id=rid,
        object="response",
        created_at=created,
        status=status,
        model=model,
        output=[item.model_copy(deep=True) for item in out.items],
        instructions=req.instructions,
        max_output_tokens=req.max_output_tokens,
        parallel_tool_calls=req.parallel_tool_calls,
        temperature=req.temperature,
        top_p=req.top_p,
        tool_choice=req.tool_choice if req.tool_choice is not None else "auto",
        tools=[t.model_dump(exclude_none=True) for t in req.tools or []],
        text={"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
        metadata=req.metadata or {},
        incomplete_details=IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None,
        error=None,
        usage=_usage(usage) if usage is not None else None,
        store=False,
    )


def _usage(u: Usage) -> ResponseUsage:
    cached = u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details else 0
    return ResponseUsage(
        input_tokens=u.prompt_tokens,
        input_tokens_details=InputTokensDetails(cached_tokens=cached),
        output_tokens=u.completion_tokens,
        output_tokens_details=OutputTokensDetails(reasoning_tokens=0),
        total_tokens=u.total_tokens,
    )


def _status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


async def _whole(
    ctx: ServingContext,
    req: ResponsesRequest,
    chat: ChatCompletionRequest,
    prep: serving_chat.Prepared,
    subs: list[EngineRequest],
    rid: str,
) -> ResponseObject:
    answer = await serving_chat.full(ctx, chat, prep, subs, rid)
    choice, out = answer.choices[0], _Output()
    if choice.message.content:
        out.text(choice.message.content)
    for call in choice.message.tool_calls:
        out.call(call.id, call.function.name).arguments = call.function.arguments
    status = _status(choice.finish_reason)
    out.finish(status)
    return _response(req, prep.model, rid, answer.created, out, status, answer.usage)


@dataclass
class _Events:
    """The typed events of one streamed response, numbered as OpenAI numbers them."""

    seq: int = 0

    def __call__(self, kind: str, **fields: Any) -> str:
        event = ResponseStreamEvent(type=kind, sequence_number=self.seq, **fields)
        self.seq += 1
        return typed_sse(event.body())


def _closed(ev: _Events, out: _Output) -> list[str]:
    """The events that finish the item still growing: its text or arguments done, then the item."""
    if not out.open:
        return []
    i, item = len(out.items) - 1, out.items[-1]
    item.status = "completed"
    out.open = False
    if isinstance(item, FunctionCallItem):
        done = ev("response.function_call_arguments.done", item_id=item.id, output_index=i, arguments=item.arguments)
        return [done, ev("response.output_item.done", output_index=i, item=item)]
    part = item.content[0]
    return [
        ev("response.output_text.done", item_id=item.id, output_index=i, content_index=0, text=part.text, logprobs=[]),
        ev("response.content_part.done", item_id=item.id, output_index=i, content_index=0, part=part),
        ev("response.output_item.done", output_index=i, item=item),
    ]


def _delta_events(ev: _Events, out: _Output, delta: DeltaMessage) -> list[str]:
    """The events of what one chat delta adds: text, a call's start, a piece of its arguments."""
    sent: list[str] = []
    if delta.content:
        if out.open and isinstance(out.items[-1], FunctionCallItem):
            sent += _closed(ev, out)
        item, opened = out.text(delta.content)
        i = len(out.items) - 1
        if opened:
            empty = item.model_copy(update={"content": []})
            sent.append(ev("response.output_item.added", output_index=i, item=empty))
            blank = OutputText(type="output_text", text="", annotations=[], logprobs=[])
            sent.append(ev("response.content_part.added", item_id=item.id, output_index=i, content_index=0, part=blank))
        sent.append(
            ev(
                "response.output_text.delta",
                item_id=item.id,
                output_index=i,
                content_index=0,
                delta=delta.content,
                logprobs=[],
            )
        )
    for t in delta.tool_calls or []:
        if t.id is not None:
            sent += _closed(ev, out)
            call = out.call(t.id, t.function.name or "")
            sent.append(ev("response.output_item.added", output_index=len(out.items) - 1, item=call))
        elif t.function.arguments:
            growing = out.items[-1]
            assert isinstance(growing, FunctionCallItem)
            growing.arguments += t.function.arguments
            i, piece = len(out.items) - 1, t.function.arguments
            sent.append(ev("response.function_call_arguments.delta", item_id=growing.id, output_index=i, delta=piece))
    return sent


async def _stream(
    ctx: ServingContext,
    req: ResponsesRequest,
    chat: ChatCompletionRequest,
    prep: serving_chat.Prepared,
    subs: list[EngineRequest],
    rid: str,
) -> AsyncGenerator[str]:
    ev, out, created, finish = _Events(), _Output(), int(time.time()), None
    yield ev("response.created", response=_response(req, prep.model, rid, created, out, "in_progress", None))
    yield ev("response.in_progress", response=_response(req, prep.model, rid, created, out, "in_progress", None))
    async for d in serving_chat.deltas(ctx, chat, subs):
        for sent in _delta_events(ev, out, d.delta):
            yield sent
        finish = d.finish_reason or finish
    for sent in _closed(ev, out):
        yield sent
    status = _status(finish)
    out.finish(status)
    final = _response(req, prep.model, rid, created, out, status, ctx.usage(subs))
    yield ev("response.completed" if status == "completed" else "response.incomplete", response=final)


@router.post(
    "/v1/responses",
    response_model=None,
    responses={
        200: {
            "model": ResponseObject,
            "content": {"text/event-stream": stream_schema(ResponseStreamEvent)},
            "description": "the response, or with stream: true its typed server-sent events",
        },
        **ERROR_RESPONSES,
    },
)
async def create_response(req: ResponsesRequest, request: Request, ctx: ServingContext = Depends(serving)) -> Response:
    """OpenAI's Responses API, stateless: text and function-call output items, structured outputs through
    `text.format`."""
    rid = request_id(request, None, "resp").replace("resp-", "resp_", 1)  # OpenAI's ids: resp_...
    try:
        body = req.to_chat()
    except ValueError as e:
        raise APIError(str(e), 400, param="input") from None
    chat, prep = await serving_chat.prepare_chat(ctx, body, CHAT_FIELDS)
    subs = await ctx.submit([prep.prompt_ids], prep.params, rid)
    if req.stream:
        return SSEResponse(ctx, _stream(ctx, req, chat, prep, subs, rid), subs, done=None)
    return json_response(await cancel_on_disconnect(request, _whole(ctx, req, chat, prep, subs, rid)))
