"""POST /v1/rag/chat/completions (with `pagedllm serve --rag-index`): chat completions over retrieved context.
The last user message is the question; the prompt is laid out by the pipeline's layout so that shared chunks hit
the prefix cache. The chunks used are in the body's `rag` field, or in a stream's `X-RAG-Chunks` header (JSON)."""

from __future__ import annotations

import asyncio
import json

from fastapi import APIRouter, Depends, Request, Response

from pagedllm.rag.layout import segmented_prompt
from pagedllm.server import serving_chat
from pagedllm.server.errors import ERROR_RESPONSES, APIError
from pagedllm.server.protocol_chat import ChatCompletionRequest, ChatCompletionStreamResponse, ChatMessage
from pagedllm.server.protocol_rag import RagChatCompletionResponse, RagChunk, RagInfo
from pagedllm.server.protocol_sampling import KVBlend
from pagedllm.server.serving_engine import ServingContext, cancel_on_disconnect, json_response, request_id, serving
from pagedllm.server.streaming import stream_schema

router = APIRouter()


def _question(req: ChatCompletionRequest) -> str:
    try:
        question = next((m.text() for m in reversed(req.messages) if m.role == "user"), "")
    except ValueError as e:
        raise APIError(str(e), 400, param="messages") from None
    if not question.strip():
        raise APIError("messages: needs a user message with the question", 400, param="messages")
    return question


@router.post(
    "/v1/rag/chat/completions",
    response_model=None,
    responses={
        200: {
            "model": RagChatCompletionResponse,
            "content": {"text/event-stream": stream_schema(ChatCompletionStreamResponse)},
            "description": "the answer and its chunks, or with stream: true server-sent events of chunks",
        },
        **ERROR_RESPONSES,
    },
)
async def rag_chat(req: ChatCompletionRequest, request: Request, ctx: ServingContext = Depends(serving)) -> Response:
    rag = request.app.state.rag
    if req.kv_blend is not None:  # its spans would index a prompt the client never saw
        raise APIError(
            "kv_blend: the RAG route builds its own prompt, so a client cannot name its token spans (start the "
            "server with --rag-kv-blend to blend the retrieved passages)",
            400,
            param="kv_blend",
        )
    messages, hits = await asyncio.to_thread(rag.build_messages, _question(req))
    req.messages = [ChatMessage(role=m["role"], content=m["content"]) for m in messages]
    chunks = [RagChunk(**h.to_dict(with_text=False)) for h in hits]
    rid = request_id(request, req.request_id, "ragcmpl")
    prep = await serving_chat.prepare(ctx, req)
    blend = None
    if rag.kv_blend:  # the passages marked by the pipeline itself (engine/blend.py)
        ids, spans = await asyncio.to_thread(segmented_prompt, ctx.engine.tokenizer, messages, hits)
        if len(ids) == len(prep.prompt_ids):  # the same length budget prepare checked
            prep.prompt_ids, blend = ids, KVBlend(segments=spans)
    subs = await ctx.submit(
        [prep.prompt_ids],
        prep.params,
        rid,
        cache_salt=req.cache_salt,
        priority=req.priority,
        kv_blend=blend,
    )
    if req.stream:
        header = json.dumps([c.body() for c in chunks])
        return serving_chat.stream(ctx, req, prep, subs, rid, headers={"X-RAG-Chunks": header})
    body = await cancel_on_disconnect(request, serving_chat.full(ctx, req, prep, subs, rid))
    if isinstance(body, Response):
        return body
    return json_response(RagChatCompletionResponse(**dict(body), rag=RagInfo(layout=rag.layout, chunks=chunks)))
