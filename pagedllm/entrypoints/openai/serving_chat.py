"""POST /v1/chat/completions: the messages rendered with the model's chat template, then one engine request
with n samples, answered whole or streamed. The RAG route reuses `prepare`, `full` and `stream`."""
from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Depends, Request, Response

from pagedllm.engine.outputs import CompletionOutput, RequestOutput
from pagedllm.entrypoints.openai.errors import ERROR_RESPONSES
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, ChatCompletionResponse
from pagedllm.entrypoints.openai.serving_engine import (ServingContext, EngineRequest, cancel_on_disconnect, request_id,
                                                        serving)
from pagedllm.entrypoints.openai.streaming import Chunks, SSEResponse, pieces
from pagedllm.sampling_params import SamplingParams

router = APIRouter()


@dataclass
class Prepared:
    model: str
    prompt_ids: list[int]
    params: SamplingParams


async def prepare(ctx: ServingContext, req: ChatCompletionRequest) -> Prepared:
    model = ctx.check_model(req.model)
    ctx.check_n(req.n)
    ids = await ctx.chat_prompt_ids(req.messages, req.add_generation_prompt)
    max_tokens = ctx.check_length(len(ids), req.effective_max_tokens, req.min_tokens, "messages")
    return Prepared(model, ids, req.to_sampling_params(max_tokens))


def _choice(ctx: ServingContext, req: ChatCompletionRequest, s: EngineRequest, c: CompletionOutput) -> dict[str, Any]:
    ctx.check_error(c)
    k = req.top_k_logprobs
    return {"index": s.base + c.index, "message": {"role": "assistant", "content": c.text, "tool_calls": []},
            "logprobs": ctx.chat_logprobs(c, 0, len(c.token_ids), k) if k is not None else None,
            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}


async def full(ctx: ServingContext, req: ChatCompletionRequest, prep: Prepared, subs: list[EngineRequest],
               rid: str) -> dict[str, Any]:
    """The whole answer, as a JSON-ready dict (the RAG route adds its chunks to it)."""
    await ctx.run_to_end(subs)
    final: RequestOutput | None = subs[0].final
    assert final is not None
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": prep.model,
            "choices": [_choice(ctx, req, subs[0], c) for c in final.outputs], "usage": ctx.usage(subs),
            "system_fingerprint": None,
            "prompt_logprobs": ctx.prompt_logprobs(final) if req.prompt_logprobs is not None else None}


async def _chunks(ctx: ServingContext, req: ChatCompletionRequest, subs: list[EngineRequest],
                  chunk: Chunks) -> AsyncIterator[str]:
    for i in range(req.n):
        yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None}])
    k = req.top_k_logprobs
    async for s, out, c, p in pieces(ctx, subs):
        yield chunk([{"index": p.index, "delta": {"content": p.text} if p.text or not p.done else {},
                      "logprobs": ctx.chat_logprobs(c, p.tokens_from, p.tokens_to, k) if k is not None else None,
                      "finish_reason": c.finish_reason if p.done else None,
                      "stop_reason": c.stop_reason if p.done else None}],
                    ctx.partial_usage(s, out) if chunk.continuous else None)
    if chunk.include_usage:
        yield chunk([], ctx.usage(subs))


def stream(ctx: ServingContext, req: ChatCompletionRequest, prep: Prepared, subs: list[EngineRequest], rid: str,
           headers: dict[str, str] | None = None) -> SSEResponse:
    chunk = Chunks.for_request(req.stream_options, rid, "chat.completion.chunk", prep.model)
    return SSEResponse(ctx, _chunks(ctx, req, subs, chunk), subs, headers)


@router.post("/v1/chat/completions", response_model=None, responses={
    200: {"model": ChatCompletionResponse, "content": {"text/event-stream": {}},
          "description": "the answer, or with stream: true server-sent events of chunks"},
    **ERROR_RESPONSES})
async def create_chat_completion(req: ChatCompletionRequest, request: Request,
                                 ctx: ServingContext = Depends(serving)) -> Response | dict[str, Any]:
    """OpenAI's chat completions (text only, no tool calling), with vLLM's extra sampling parameters."""
    rid = request_id(request, req.request_id, "chatcmpl")
    prep = await prepare(ctx, req)
    subs = await ctx.submit([prep.prompt_ids], prep.params, rid)
    if req.stream:
        return stream(ctx, req, prep, subs, rid)
    return await cancel_on_disconnect(request, full(ctx, req, prep, subs, rid))
