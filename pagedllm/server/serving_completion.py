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
from fastapi.responses import JSONResponse

from pagedllm.engine.outputs import CompletionOutput, RequestOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.server.errors import ERROR_RESPONSES
from pagedllm.server.protocol import CompletionRequest, CompletionResponse
from pagedllm.server.serving_engine import (
    EngineRequest,
    ServingContext,
    cancel_on_disconnect,
    request_id,
    serving,
)
from pagedllm.server.streaming import Chunks, SSEResponse, pieces

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
        ids = await ctx.encode(p) if isinstance(p, str) else list(p)
        ctx.check_token_ids(ids, "prompt")
        ctx.check_length(len(ids), req.max_tokens, req.min_tokens, "prompt")
        prompts.append(ids)
        texts.append("" if not req.echo else p if isinstance(p, str) else ctx.decode(ids))
    return _Prepared(model, prompts, texts, req.to_sampling_params(req.max_tokens))


def _logprobs(
    ctx: ServingContext,
    req: CompletionRequest,
    s: EngineRequest,
    out: RequestOutput,
    c: CompletionOutput,
    start: int,
    end: int,
    text_from: int,
    echo: str,
) -> dict[str, list] | None:
    """Logprobs of generated tokens start..end-1 (whose text starts at text_from), after the prompt's own
    tokens when this part carries the echo."""
    if req.logprobs is None:
        return None
    lps: list[dict[int, float] | None] = list((c.logprobs or [])[start:end])
    generated = ctx.completion_logprobs(c.token_ids[start:end], lps, req.logprobs, len(echo) + text_from)
    if not echo:
        return generated
    prompt = ctx.completion_logprobs(
        s.prompt_ids, list(out.prompt_logprobs or [None] * len(s.prompt_ids)), req.logprobs, 0
    )
    return {k: prompt[k] + generated[k] for k in generated}


def _choice(
    ctx: ServingContext,
    req: CompletionRequest,
    prep: _Prepared,
    s: EngineRequest,
    out: RequestOutput,
    c: CompletionOutput,
) -> dict[str, Any]:
    ctx.check_error(c, req.constraint_field)
    echo = prep.echo_texts[s.prompt_index]
    return {
        "index": s.base + c.index,
        "text": echo + c.text,
        "logprobs": _logprobs(ctx, req, s, out, c, 0, len(c.token_ids), 0, echo),
        "finish_reason": c.finish_reason,
        "stop_reason": c.stop_reason,
        "prompt_logprobs": ctx.prompt_logprobs(out) if req.prompt_logprobs is not None else None,
    }


async def _full(
    ctx: ServingContext, req: CompletionRequest, prep: _Prepared, subs: list[EngineRequest], rid: str
) -> JSONResponse:
    await ctx.run_to_end(subs)
    choices = sorted(
        (_choice(ctx, req, prep, s, s.final, c) for s in subs if s.final is not None for c in s.final.outputs),
        key=lambda ch: ch["index"],
    )
    return JSONResponse(
        {
            "id": rid,
            "object": "text_completion",
            "created": int(time.time()),
            "model": prep.model,
            "choices": choices,
            "usage": ctx.usage(subs),
            "system_fingerprint": None,
        }
    )


async def _chunks(
    ctx: ServingContext, req: CompletionRequest, prep: _Prepared, subs: list[EngineRequest], chunk: Chunks
) -> AsyncGenerator[str]:
    async for s, out, c, p in pieces(ctx, subs, req.constraint_field):
        echo = prep.echo_texts[s.prompt_index] if p.first else ""
        choice: dict[str, Any] = {
            "index": p.index,
            "text": echo + p.text,
            "logprobs": _logprobs(ctx, req, s, out, c, p.tokens_from, p.tokens_to, p.text_from, echo),
            "finish_reason": c.finish_reason if p.done else None,
            "stop_reason": c.stop_reason if p.done else None,
        }
        if p.first and req.prompt_logprobs is not None:
            choice["prompt_logprobs"] = ctx.prompt_logprobs(out)
        yield chunk([choice], ctx.partial_usage(s, out) if chunk.continuous else None)
    if chunk.include_usage:
        yield chunk([], ctx.usage(subs))


@router.post(
    "/v1/completions",
    response_model=None,
    responses={
        200: {
            "model": CompletionResponse,
            "content": {"text/event-stream": {}},
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
    subs = await ctx.submit(prep.prompts, prep.params, rid)
    if req.stream:
        chunk = Chunks.for_request(req.stream_options, rid, "text_completion", prep.model)
        return SSEResponse(ctx, _chunks(ctx, req, prep, subs, chunk), subs)
    return await cancel_on_disconnect(request, _full(ctx, req, prep, subs, rid))
