"""The bodies of POST /v1/embeddings, as OpenAI defines them (vLLM's `EmbeddingRequest` / `EmbeddingResponse`)."""

from __future__ import annotations

from typing import Literal, cast

from pydantic import Field, StrictInt, StrictStr, model_validator

from pagedllm.server.protocol import RequestModel, ResponseModel, TokenId

MAX_INPUTS = 2048  # OpenAI's limit on inputs per request


class EmbeddingRequest(RequestModel):
    model: str | None = None
    input: list[TokenId] | list[list[TokenId]] | StrictStr | list[StrictStr] = Field(
        description="a text, texts, token ids, or lists of token ids; each embedded alone"
    )
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = Field(None, ge=1, description="Matryoshka models only: keep the first N")
    user: str | None = None  # accepted and ignored, as OpenAI's
    truncate_prompt_tokens: StrictInt | None = Field(
        None, ge=-1, description="vLLM's: keep only the last N tokens of each input (-1: as many as the model takes)"
    )

    @model_validator(mode="after")
    def _check(self) -> EmbeddingRequest:
        items = self.input if isinstance(self.input, list) else [self.input]
        if not items or any(len(x) == 0 for x in items if not isinstance(x, int)):
            raise ValueError("input: must not be empty, nor hold an empty text or token list")
        if len(items) > MAX_INPUTS and not all(isinstance(x, int) for x in items):
            raise ValueError(f"input: at most {MAX_INPUTS} inputs per request, got {len(items)}")
        if self.truncate_prompt_tokens == 0:
            raise ValueError("truncate_prompt_tokens: must be -1 (the model's limit) or at least 1")
        return self

    def inputs(self) -> list[str] | list[list[int]]:
        """The inputs as a list: texts, or token id lists (one list of ids is one input)."""
        if isinstance(self.input, str):
            return [self.input]
        if all(isinstance(x, int) for x in self.input):
            return [cast(list[int], list(self.input))]
        return list(self.input)  # type: ignore[return-value]  # texts, or lists of ids


class EmbeddingData(ResponseModel):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str  # float: the numbers; base64: little-endian float32 bytes


class EmbeddingUsage(ResponseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(ResponseModel):
    object: Literal["list"]
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage
