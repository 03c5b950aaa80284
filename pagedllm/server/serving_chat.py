"""POST /v1/chat/completions: the messages rendered with the model's chat template, then one engine request
with n samples, answered whole or streamed. The RAG route reuses `prepare`, `full` and `stream`.

With tools and tool_choice "required" or a named function, the answer is decoded under the tools' schema and
returned as `tool_calls` (tool_parsers/); "auto" needs a chat template that shows the model its tools."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass

from fastapi import APIRouter, Depends, Request, Response

from pagedllm.engine.outputs import CompletionOutput, RequestOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.server.errors import ERROR_RESPONSES, APIError
from pagedllm.server.protocol import (
    ChatChoice,
    ChatCompletionMessage,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatStreamChoice,
    DeltaMessage,
    ToolMode,
)
from pagedllm.server.serving_engine import (
    EngineRequest,
    ServingContext,
    cancel_on_disconnect,
    json_response,
    request_id,
    serving,
)
from pagedllm.server.streaming import Chunks, SSEResponse, pieces, stream_schema
from pagedllm.server.tool_parsers import ToolParser, auto_tools_supported, tool_parser

router = APIRouter()


@dataclass
class Prepared:
    model: str
    prompt_ids: list[int]
    params: SamplingParams


async def prepare(ctx: ServingContext, req: ChatCompletionRequest) -> Prepared:
    model = ctx.check_model(req.model)
    ctx.check_n(req.n)
    mode = req.tool_mode
    if mode is not None and mode.kind == "auto" and not auto_tools_supported(ctx.engine.tokenizer.chat_template):
        raise APIError(
            'tool_choice "auto" needs a chat template that shows the model its tools and a parser '
            "for its tool-call format; this model's template has no tools: send tool_choice "
            '"required", a named function or "none"',
            400,
            param="tool_choice",
        )
    tools = req.tools if mode is not None else None
    ids = await ctx.chat_prompt_ids(req.messages, req.add_generation_prompt, tools)
    max_tokens = ctx.check_length(len(ids), req.effective_max_tokens, req.min_tokens, "messages")
    if mode is None and req.constraint() is None:
        return Prepared(model, ids, req.to_sampling_params(max_tokens))
    # compiling a schema's grammar to check it takes milliseconds: off the event loop
    return Prepared(model, ids, await asyncio.to_thread(req.to_sampling_params, max_tokens))


def _finish_reason(mode: ToolMode | None, reason: str | None, called: bool) -> str | None:
    """OpenAI finishes a "required" or "auto" answer that made calls with "tool_calls" and a named one with
    "stop"; one cut by max_tokens keeps "length", whatever it holds, so a client can tell a call cut off from a
    finished one. The same whole or streamed."""
    if mode is not None and called and reason == "stop" and mode.kind != "named":
        return "tool_calls"
    return reason


def _message(
    ctx: ServingContext, mode: ToolMode | None, c: CompletionOutput
) -> tuple[ChatCompletionMessage, str | None]:
    """The assistant message and finish reason (`_chunks` sends the pieces of this): with tools, the calls as far
    as they were generated, by the parser a stream uses too."""
    if mode is None:
        return ChatCompletionMessage(role="assistant", content=c.text, tool_calls=[]), c.finish_reason
    got = tool_parser(mode, ctx.engine.tokenizer.chat_template).extract(c.text)
    message = ChatCompletionMessage(role="assistant", content=got.content, tool_calls=got.tool_calls)
    return message, _finish_reason(mode, c.finish_reason, bool(got.tool_calls))


def _choice(ctx: ServingContext, req: ChatCompletionRequest, s: EngineRequest, c: CompletionOutput) -> ChatChoice:
    ctx.check_error(c, req.constraint_field)
    k = req.top_k_logprobs
    message, finish_reason = _message(ctx, req.tool_mode, c)
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
        choices=[_choice(ctx, req, subs[0], c) for c in final.outputs],
        usage=ctx.usage(subs),
        system_fingerprint=None,
        prompt_logprobs=ctx.prompt_logprobs(final) if req.prompt_logprobs is not None else None,
    )


async def _chunks(
    ctx: ServingContext, req: ChatCompletionRequest, subs: list[EngineRequest], chunk: Chunks
) -> AsyncGenerator[str]:
    """OpenAI's chunks: the role first (content "" for text, null for an answer that is tool calls), then only
    deltas that say something (a piece that adds nothing, e.g. a token that is half a character or the start of
    a call's name, waits: its logprobs go with the next chunk), the finish reason on the last one; they add up
    to `_message`'s message."""
    k, mode = req.top_k_logprobs, req.tool_mode
    for i in range(req.n):
        role = DeltaMessage(role="assistant", content="" if mode is None else None)
        yield chunk([ChatStreamChoice(index=i, delta=role, logprobs=None, finish_reason=None)])
    parsers: dict[int, ToolParser] = {}
    logged: dict[int, int] = {}  # per choice, the tokens whose logprobs were sent
    template = ctx.engine.tokenizer.chat_template
    async for s, out, c, p in pieces(ctx, subs, req.constraint_field):
        if mode is None:
            delta = DeltaMessage(content=p.text) if p.text else DeltaMessage()
        else:
            delta = parsers.setdefault(p.index, tool_parser(mode, template)).extract_streaming(c.text, p.done)
        if not delta.model_fields_set and not p.done:
            continue
        start, logged[p.index] = logged.get(p.index, 0), p.tokens_to
        called = p.index in parsers and bool(parsers[p.index].ids)
        choice = ChatStreamChoice(
            index=p.index,
            delta=delta,
            logprobs=ctx.chat_logprobs(c, start, p.tokens_to, k) if k is not None else None,
            finish_reason=_finish_reason(mode, c.finish_reason, called) if p.done else None,
            stop_reason=c.stop_reason if p.done else None,
        )
        yield chunk([choice], ctx.partial_usage(s, out) if chunk.continuous else None)
    if chunk.include_usage:
        yield chunk([], ctx.usage(subs))


def stream(
    ctx: ServingContext,
    req: ChatCompletionRequest,
    prep: Prepared,
    subs: list[EngineRequest],
    rid: str,
    headers: dict[str, str] | None = None,
) -> SSEResponse:
    chunk = Chunks.for_request(req.stream_options, rid, "chat.completion.chunk", prep.model)
    return SSEResponse(ctx, _chunks(ctx, req, subs, chunk), subs, headers)


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
    subs = await ctx.submit([prep.prompt_ids], prep.params, rid)
    if req.stream:
        return stream(ctx, req, prep, subs, rid)
    return json_response(await cancel_on_disconnect(request, full(ctx, req, prep, subs, rid)))
