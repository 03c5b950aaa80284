"""POST /v1/chat/completions: the messages rendered with the model's chat template, then one engine request
with n samples, answered whole or streamed. The RAG route reuses `prepare`, `full` and `stream`; the Responses
and Messages APIs are chat requests too (`prepare_chat`, `full`, `deltas`).

With --reasoning-parser, each answer is split into `reasoning_content` and `content` (reasoning.py), and a
constraint (structured outputs, a tool choice) holds only the content: the engine's grammar starts after the
thinking ends.

With tools and tool_choice "required" or a named function, the answer is decoded under the tools' schema and
returned as `tool_calls` (tool_parsers/); "auto" is parsed in the format --tool-call-parser names, or the one
the chat template asks for."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Depends, Request, Response
from pydantic import ValidationError

from pagedllm.engine.outputs import CompletionOutput, RequestOutput
from pagedllm.errors import UserError
from pagedllm.sampling_params import SamplingParams
from pagedllm.server.errors import ERROR_RESPONSES, APIError, from_errors
from pagedllm.server.protocol import Usage
from pagedllm.server.protocol_chat import (
    ChatChoice,
    ChatCompletionMessage,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatStreamChoice,
    DeltaMessage,
)
from pagedllm.server.reasoning import ReasoningParser, State, reasoning_tokens
from pagedllm.server.serving_engine import (
    ChatTemplateArgs,
    EngineRequest,
    ServingContext,
    cancel_on_disconnect,
    json_response,
    request_id,
    serving,
)
from pagedllm.server.streaming import Chunks, Piece, SSEResponse, pieces, stream_schema
from pagedllm.server.tool_parsers import ToolParser, auto_parser, tool_parser
from pagedllm.server.tools import ToolMode

router = APIRouter()


@dataclass
class Prepared:
    model: str
    prompt_ids: list[int]
    params: SamplingParams
    reasoning: State | None = None  # with a reasoning parser: where the answers start


def _reasoning_parser(ctx: ServingContext, prep: Prepared) -> ReasoningParser | None:
    """A fresh parser for one choice (it keeps the choice's streaming state), or None without --reasoning-parser."""
    if ctx.reasoning is None or prep.reasoning is None:
        return None
    return ReasoningParser(ctx.reasoning, prep.reasoning)


async def prepare(ctx: ServingContext, req: ChatCompletionRequest) -> Prepared:
    model = ctx.check_model(req.model)
    ctx.check_n(req.n)
    mode = req.tool_mode
    calls = parser(ctx, mode) if mode is not None else None  # "auto" with no format to parse: a 400 up front
    tools = req.tools if mode is not None else None
    args = ChatTemplateArgs(
        req.add_generation_prompt, req.continue_final_message, req.chat_template, req.chat_template_kwargs
    )
    text, ids = await ctx.chat_prompt(req.messages, args, tools)
    ids = ctx.truncate(ids, req.truncate_prompt_tokens)
    max_tokens = ctx.check_length(len(ids), req.effective_max_tokens, req.min_tokens, "messages")
    state = ctx.reasoning.initial_state(text) if ctx.reasoning is not None else None
    if mode is None and req.constraint() is None:
        params = req.to_sampling_params(max_tokens)
    else:  # compiling a schema's grammar to check it takes milliseconds: off the event loop
        params = await asyncio.to_thread(req.to_sampling_params, max_tokens)
    if calls is not None:
        calls.adjust_request(params)  # mistral's [TOOL_CALLS] is a special token: kept in the text
    if ctx.reasoning is not None:
        ctx.reasoning.adjust_request(params)  # harmony's channels are special tokens: kept in the text
        if state != "after" and params.structured_outputs is not None:
            params.structured_outputs.reasoning_end = ctx.reasoning.end  # the thinking is free, the answer held
    return Prepared(model, ids, params, state)


def renamed(e: APIError | UserError, fields: dict[str, str]) -> APIError:
    """An error of the chat request as one of this API's: the field it names is the one the client sent."""
    param = getattr(e, "param", None)
    head = (param or "").split(".")[0]
    message = str(e.message if isinstance(e, APIError) else e)
    for chat_name, own in fields.items():
        message = message.replace(f"'{chat_name}", f"'{own}").replace(f"{chat_name}:", f"{own}:")
    status = e.status if isinstance(e, APIError) else 400
    return APIError(message, status, param=fields.get(head, param) if param else None)


async def prepare_chat(
    ctx: ServingContext, body: dict[str, Any], fields: dict[str, str]
) -> tuple[ChatCompletionRequest, Prepared]:
    """The chat request a Responses or Messages request is, prepared (everything checked before it runs);
    errors name the request's own fields (`fields`: chat field -> its own)."""
    try:
        chat = ChatCompletionRequest.model_validate(body)
        return chat, await prepare(ctx, chat)
    except ValidationError as e:
        raise renamed(from_errors([dict(d) for d in e.errors()]), fields) from None
    except (APIError, UserError) as e:
        raise renamed(e, fields) from None


def parser(ctx: ServingContext, mode: ToolMode) -> ToolParser:
    """A fresh parser of one choice's tool calls: for "auto", the server's --tool-call-parser or the one the
    chat template asks for (a 400 naming tool_choice when neither says)."""
    try:
        auto = auto_parser(ctx.engine.tokenizer.chat_template, ctx.tool_call_parser) if mode.kind == "auto" else None
    except ValueError as e:
        raise APIError(str(e), 400, param="tool_choice") from None
    return tool_parser(mode, auto) if auto is not None else tool_parser(mode)


def _finish_reason(mode: ToolMode | None, reason: str | None, called: bool) -> str | None:
    """OpenAI finishes a "required" or "auto" answer that made calls with "tool_calls" and a named one with
    "stop"; one cut by max_tokens keeps "length", whatever it holds, so a client can tell a call cut off from a
    finished one. The same whole or streamed."""
    if mode is not None and called and reason == "stop" and mode.kind != "named":
        return "tool_calls"
    return reason


def _message(
    ctx: ServingContext, mode: ToolMode | None, c: CompletionOutput, reasoner: ReasoningParser | None
) -> tuple[ChatCompletionMessage, str | None]:
    """The assistant message and finish reason (`_chunks` sends the pieces of this): the reasoning apart (with a
    reasoning parser), and with tools, the calls as far as they were generated, by the parser a stream uses too."""
    reasoning, text = reasoner.extract(c.text) if reasoner is not None else (None, c.text)
    if mode is None:
        content = text if reasoner is None else text or None
        message = ChatCompletionMessage(role="assistant", content=content, tool_calls=[])
        finish_reason = c.finish_reason
    else:
        calls = parser(ctx, mode)
        got = calls.extract(c.text if calls.reads_answer else text)
        message = ChatCompletionMessage(role="assistant", content=got.content, tool_calls=got.tool_calls)
        finish_reason = _finish_reason(mode, c.finish_reason, bool(got.tool_calls))
    if reasoner is not None:
        message.reasoning_content = reasoning
    return message, finish_reason


def _usage(ctx: ServingContext, prep: Prepared, subs: list[EngineRequest]) -> Usage:
    """The usage, with the thinking's share of the completion tokens when a reasoning parser splits it."""
    fmt, state = ctx.reasoning, prep.reasoning
    if fmt is None or state is None:
        return ctx.usage(subs)
    skip = prep.params.skip_special_tokens

    def decode(ids: list[int]) -> str:
        return ctx.decode(ids, skip_special_tokens=skip)

    finals = [c for s in subs if s.final is not None for c in s.final.outputs]
    return ctx.usage(subs, sum(reasoning_tokens(fmt, state, c.token_ids, decode) for c in finals))


def _choice(
    ctx: ServingContext, req: ChatCompletionRequest, prep: Prepared, s: EngineRequest, c: CompletionOutput
) -> ChatChoice:
    ctx.check_error(c, req.constraint_field)
    k = req.top_k_logprobs
    message, finish_reason = _message(ctx, req.tool_mode, c, _reasoning_parser(ctx, prep))
    return ChatChoice(
        index=s.base + c.index,
        message=message,
        logprobs=ctx.chat_logprobs(c, 0, len(c.token_ids), k) if k is not None else None,
        finish_reason=finish_reason,
        stop_reason=c.stop_reason,
    )


async def full(
    ctx: ServingContext, req: ChatCompletionRequest, prep: Prepared, subs: list[EngineRequest], rid: str
) -> ChatCompletionResponse:
    """The whole answer (the RAG route adds its chunks to it)."""
    await ctx.run_to_end(subs)
    final: RequestOutput | None = subs[0].final
    assert final is not None
    return ChatCompletionResponse(
        id=rid,
        object="chat.completion",
        created=int(time.time()),
        model=prep.model,
        choices=[_choice(ctx, req, prep, subs[0], c) for c in final.outputs],
        usage=_usage(ctx, prep, subs),
        system_fingerprint=None,
        prompt_logprobs=ctx.prompt_logprobs(final) if req.prompt_logprobs is not None else None,
    )


@dataclass
class ChoiceDelta:
    """What one choice's answer adds as it grows (`deltas`), with what it grew from."""

    sub: EngineRequest
    out: RequestOutput
    choice: CompletionOutput
    piece: Piece
    delta: DeltaMessage
    parser: ToolParser | None  # the choice's tool-call parser (its ids: the calls streamed so far)
    finish_reason: str | None  # on the choice's last delta


async def deltas(
    ctx: ServingContext,
    req: ChatCompletionRequest,
    subs: list[EngineRequest],
    reasoner: ReasoningParser | None = None,
) -> AsyncGenerator[ChoiceDelta]:
    """Each choice's deltas as the engine produces them: the reasoning apart (with a reasoning parser), content,
    tool calls in pieces (the parsers `_message` uses, so they add up to its message), the finish reason on the
    last; a delta that adds nothing is left out but the last. What every streaming API over chat (chat chunks,
    Responses, Messages events) wraps."""
    mode = req.tool_mode
    choices: dict[int, _StreamedChoice] = {}
    async for s, out, c, p in pieces(ctx, subs, req.constraint_field):
        state = choices.setdefault(p.index, _StreamedChoice(ctx, mode, reasoner))
        delta = state.delta(c.text, p.done)
        if not delta.model_fields_set and not p.done:
            continue
        found = state.tools
        finish = _finish_reason(mode, c.finish_reason, found is not None and bool(found.ids)) if p.done else None
        yield ChoiceDelta(s, out, c, p, delta, found, finish)


async def _chunks(
    ctx: ServingContext, req: ChatCompletionRequest, prep: Prepared, subs: list[EngineRequest], chunk: Chunks
) -> AsyncGenerator[str]:
    """OpenAI's chunks: the role first (content "" for text, null for an answer that is tool calls), then only
    deltas that say something (a piece that adds nothing, e.g. a token that is half a character or the start of
    a call's name, waits: its logprobs go with the next chunk), the finish reason on the last one; they add up
    to `_message`'s message, the reasoning in `reasoning_content` deltas."""
    k, mode = req.top_k_logprobs, req.tool_mode
    for i in range(req.n):
        role = DeltaMessage(role="assistant", content="" if mode is None else None)
        yield chunk([ChatStreamChoice(index=i, delta=role, logprobs=None, finish_reason=None)])
    logged: dict[int, int] = {}  # per choice, the tokens whose logprobs were sent
    async for d in deltas(ctx, req, subs, _reasoning_parser(ctx, prep)):
        p, c = d.piece, d.choice
        start, logged[p.index] = logged.get(p.index, 0), p.tokens_to
        choice = ChatStreamChoice(
            index=p.index,
            delta=d.delta,
            logprobs=ctx.chat_logprobs(c, start, p.tokens_to, k) if k is not None else None,
            finish_reason=d.finish_reason,
            stop_reason=c.stop_reason if p.done else None,
        )
        yield chunk([choice], ctx.partial_usage(d.sub, d.out) if chunk.continuous else None)
    if chunk.include_usage:
        yield chunk([], _usage(ctx, prep, subs))


class _StreamedChoice:
    """One streamed choice's parsers: the reasoning's (if any) first, then the tools' (if any) on the content."""

    def __init__(self, ctx: ServingContext, mode: ToolMode | None, reasoner: ReasoningParser | None) -> None:
        self.reasoner = reasoner
        self.tools: ToolParser | None = None if mode is None else parser(ctx, mode)
        self.content_sent = 0

    def delta(self, text: str, done: bool) -> DeltaMessage:
        """What the answer grown to `text` adds (empty: nothing to send yet)."""
        reasoning, content = self.reasoner.extract_streaming(text, done) if self.reasoner else ("", text)
        if self.tools is not None:
            delta = self.tools.extract_streaming(text if self.tools.reads_answer else content, done)
        else:
            new, self.content_sent = content[self.content_sent :], max(self.content_sent, len(content))
            delta = DeltaMessage(content=new) if new else DeltaMessage()
        if reasoning:
            delta.reasoning_content = reasoning
        return delta


def stream(
    ctx: ServingContext,
    req: ChatCompletionRequest,
    prep: Prepared,
    subs: list[EngineRequest],
    rid: str,
    headers: dict[str, str] | None = None,
) -> SSEResponse:
    chunk = Chunks.for_request(req.stream_options, rid, "chat.completion.chunk", prep.model)
    return SSEResponse(ctx, _chunks(ctx, req, prep, subs, chunk), subs, headers)


@router.post(
    "/v1/chat/completions",
    response_model=None,
    responses={
        200: {
            "model": ChatCompletionResponse,
            "content": {"text/event-stream": stream_schema(ChatCompletionStreamResponse)},
            "description": "the answer, or with stream: true server-sent events of chunks",
        },
        **ERROR_RESPONSES,
    },
)
async def create_chat_completion(
    req: ChatCompletionRequest, request: Request, ctx: ServingContext = Depends(serving)
) -> Response:
    """OpenAI's chat completions (text only), with structured outputs, tool calls and vLLM's extra sampling
    parameters."""
    rid = request_id(request, req.request_id, "chatcmpl")
    prep = await prepare(ctx, req)
    subs = await ctx.submit(
        [prep.prompt_ids],
        prep.params,
        rid,
        cache_salt=req.cache_salt,
        priority=req.priority,
        kv_blend=req.kv_blend,
        lora_request=ctx.lora_request(prep.model),
    )
    if req.stream:
        return stream(ctx, req, prep, subs, rid)
    return json_response(await cancel_on_disconnect(request, full(ctx, req, prep, subs, rid)))
