"""The answer of /v1/rag/chat/completions: a chat completion with the retrieved chunks it used."""

from __future__ import annotations

from pydantic import Field

from pagedllm.server.protocol import ResponseModel
from pagedllm.server.protocol_chat import ChatCompletionResponse


class RagChunk(ResponseModel):
    chunk_id: str
    source: str
    position: int
    score: float
    rank: int
    title: str


class RagInfo(ResponseModel):
    layout: str
    chunks: list[RagChunk]


class RagChatCompletionResponse(ChatCompletionResponse):
    rag: RagInfo = Field(description="the retrieved chunks the answer used, in the prompt's layout")
