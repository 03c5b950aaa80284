"""POST /v1/rag/chat/completions (with `pagedllm serve --rag-index`): chat completions over retrieved context.
The last user message is the question; the prompt is laid out by the pipeline's layout so that shared chunks hit
the prefix cache. The chunks used are in the body's `rag` field, or in a stream's `X-RAG-Chunks` header (JSON)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi import APIRouter, Depends, Request, Response

from pagedllm.server import serving_chat
from pagedllm.server.errors import ERROR_RESPONSES, APIError
from pagedllm.server.protocol import ChatCompletionRequest, ChatMessage
from pagedllm.server.serving_engine import ServingContext, cancel_on_disconnect, request_id, serving

router = APIRouter()


def _question(req: ChatCompletionRequest) -> str:
    try:
        question = next((m.text() for m in reversed(req.messages) if m.role == "user"), "")
    except ValueError as e:
        raise APIError(str(e), 400, param="messages") from None
    if not question.strip():
        raise APIError("messages: needs a user message with the question", 400, param="messages")
    return question


@router.post("/v1/rag/chat/completions", response_model=None, responses={**ERROR_RESPONSES})
async def rag_chat(
    req: ChatCompletionRequest, request: Request, ctx: ServingContext = Depends(serving)
) -> Response | dict[str, Any]:
    rag = request.app.state.rag
    messages, hits = await asyncio.to_thread(rag.build_messages, _question(req))
    req.messages = [ChatMessage(role=m["role"], content=m["content"]) for m in messages]
    chunks = [h.to_dict(with_text=False) for h in hits]
    rid = request_id(request, req.request_id, "ragcmpl")
    prep = await serving_chat.prepare(ctx, req)
    subs = await ctx.submit([prep.prompt_ids], prep.params, rid)
    if req.stream:
        return serving_chat.stream(ctx, req, prep, subs, rid, headers={"X-RAG-Chunks": json.dumps(chunks)})
    body = await cancel_on_disconnect(request, serving_chat.full(ctx, req, prep, subs, rid))
    if isinstance(body, dict):
        body["rag"] = {"layout": rag.layout, "chunks": chunks}
    return body
