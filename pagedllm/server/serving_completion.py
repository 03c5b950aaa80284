"""POST /v1/completions: one engine request per prompt (n samples each), answered whole or streamed.

Scoring, as evaluation tools use it: `echo` + `logprobs` returns the prompt's own tokens with their logprobs
(first None, as OpenAI and vLLM) ahead of the generated ones, and `max_tokens: 0` generates nothing, so
lm-evaluation-harness's loglikelihood requests are answered from one prefill.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Depends, Request, Response

from pagedllm.engine.outputs import CompletionOutput, RequestOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.server.errors import ERROR_RESPONSES
from pagedllm.server.protocol_completion import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamChoice,
    CompletionStreamResponse,
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

router = APIRouter()


@dataclass
class _Prepared:
    model: str
    prompts: list[list[int]]
    echo_texts: list[str]  # per prompt: the text sent, or the ids decoded ("" without echo)
    params: SamplingParams


async def _prepare(ctx: ServingContext, req: CompletionRequest) -> _Prepared:
    model = ctx.check_model(req.model)
    raw = req.prompt
    given: list[Any] = [raw] if isinstance(raw, str) or (raw and isinstance(raw[0], int)) else list(raw)
    ctx.check_n(req.n, len(given))
    prompts, texts = [], []
    for p in given:
        ids = ctx.truncate(await ctx.encode(p) if isinstance(p, str) else list(p), req.truncate_prompt_tokens)
        ctx.check_token_ids(ids, "prompt")
        ctx.check_length(len(ids), req.max_tokens, req.min_tokens, "prompt")
        prompts.append(ids)
        whole_text = isinstance(p, str) and req.truncate_prompt_tokens is None
        texts.append("" if not req.echo else p if whole_text else ctx.decode(ids))
    return _Prepared(model, prompts, texts, req.to_sampling_params(req.max_tokens))


@dataclass(frozen=True)
class _Part:
    """What one answer or chunk of a choice covers: generated tokens start..end-1 of `c` (whose text starts at
    `text_from`), and the echoed prompt text it carries ("" if none)."""

    s: EngineRequest
    out: RequestOutput
    c: CompletionOutput
    start: int
    end: int
    text_from: int
    echo: str


def _logprobs(ctx: ServingContext, k: int | None, part: _Part) -> CompletionLogprobs | None:
    """Logprobs (top `k`) of the part's generated tokens, after the prompt's own tokens when it carries the echo."""
    if k is None:
        return None
    c, s = part.c, part.s
    lps: list[dict[int, float] | None] = list((c.logprobs or [])[part.start : part.end])
    generated = ctx.completion_logprobs(c.token_ids[part.start : part.end], lps, k, len(part.echo) + part.text_from)
    if not part.echo:
        return generated
    prompt_lps = list(part.out.prompt_logprobs or [None] * len(s.prompt_ids))
    prompt = ctx.completion_logprobs(s.prompt_ids, prompt_lps, k, 0)
    return CompletionLogprobs(
        text_offset=prompt.text_offset + generated.text_offset,
        token_logprobs=prompt.token_logprobs + generated.token_logprobs,
        tokens=prompt.tokens + generated.tokens,
        top_logprobs=prompt.top_logprobs + generated.top_logprobs,
    )


def _choice(
    ctx: ServingContext,
    req: CompletionRequest,
    prep: _Prepared,
    s: EngineRequest,
    out: RequestOutput,
    c: CompletionOutput,
) -> CompletionChoice:
    ctx.check_error(c, req.constraint_field)
    echo = prep.echo_texts[s.prompt_index]
    return CompletionChoice(
        index=s.base + c.index,
        text=echo + c.text,
        logprobs=_logprobs(ctx, req.logprobs, _Part(s, out, c, 0, len(c.token_ids), 0, echo)),
        finish_reason=c.finish_reason,
        stop_reason=c.stop_reason,
        prompt_logprobs=ctx.prompt_logprobs(out) if req.prompt_logprobs is not None else None,
    )


async def _full(
    ctx: ServingContext, req: CompletionRequest, prep: _Prepared, subs: list[EngineRequest], rid: str
) -> CompletionResponse:
    await ctx.run_to_end(subs)
    choices = sorted(
        (_choice(ctx, req, prep, s, s.final, c) for s in subs if s.final is not None for c in s.final.outputs),
        key=lambda ch: ch.index,
    )
    return CompletionResponse(
        id=rid,
        object="text_completion",
        created=int(time.time()),
        model=prep.model,
        choices=choices,
        usage=ctx.usage(subs),
        system_fingerprint=None,
    )


async def _chunks(
    ctx: ServingContext, req: CompletionRequest, prep: _Prepared, subs: list[EngineRequest], chunk: Chunks
) -> AsyncGenerator[str]:
    async for s, out, c, p in pieces(ctx, subs, req.constraint_field):
        echo = prep.echo_texts[s.prompt_index] if p.first else ""
        part = _Part(s, out, c, p.tokens_from, p.tokens_to, p.text_from, echo)
        choice = CompletionStreamChoice(
            index=p.index,
            text=echo + p.text,
            logprobs=_logprobs(ctx, req.logprobs, part),
            finish_reason=c.finish_reason if p.done else None,
            stop_reason=c.stop_reason if p.done else None,
        )
        if p.first and req.prompt_logprobs is not None:
            choice.prompt_logprobs = ctx.prompt_logprobs(out)
        yield chunk([choice], ctx.partial_usage(s, out) if chunk.continuous else None)
    if chunk.include_usage:
        yield chunk([], ctx.usage(subs))


@router.post(
    "/v1/completions",
    response_model=None,
    responses={
        200: {
            "model": CompletionResponse,
            "content": {"text/event-stream": stream_schema(CompletionStreamResponse)},
            "description": "the completion, or with stream: true server-sent events of chunks",
        },
        **ERROR_RESPONSES,
    },
)
async def create_completion(
    req: CompletionRequest, request: Request, ctx: ServingContext = Depends(serving)
) -> Response:
    """OpenAI's legacy completions, with vLLM's extra sampling parameters."""
    rid = request_id(request, req.request_id, "cmpl")
    prep = await _prepare(ctx, req)
    subs = await ctx.submit(
        prep.prompts,
        prep.params,
        rid,
        cache_salt=req.cache_salt,
        priority=req.priority,
        kv_blend=req.kv_blend,
        lora_request=ctx.lora_request(prep.model),
    )
    if req.stream:
        chunk = Chunks.for_request(req.stream_options, rid, "text_completion", prep.model)
        return SSEResponse(ctx, _chunks(ctx, req, prep, subs, chunk), subs)
    return json_response(await cancel_on_disconnect(request, _full(ctx, req, prep, subs, rid)))
