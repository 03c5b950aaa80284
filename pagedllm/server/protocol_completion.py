"""Request and response bodies of /v1/completions (OpenAI's legacy completions, vLLM's extras)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, StrictBool, StrictInt, model_validator

from pagedllm.sampling_params import MAX_LOGPROBS, SamplingParams
from pagedllm.server.protocol import PromptLogprobs, ResponseModel, TokenId, Usage
from pagedllm.server.protocol_sampling import SamplingRequest


class CompletionRequest(SamplingRequest):
    prompt: list[TokenId] | list[list[TokenId]] | str | list[str]
    max_tokens: StrictInt | None = Field(16, ge=0, description="0: score the prompt only (with echo/logprobs)")
    echo: StrictBool = False
    logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: Literal[""] | None = Field(None, description="not supported (no fill-in-the-middle)")

    @model_validator(mode="after")
    def _check(self) -> CompletionRequest:
        if isinstance(self.prompt, list) and (not self.prompt or any(p == [] for p in self.prompt)):
            raise ValueError("prompt: must not be empty")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens: ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        return self

    def to_sampling_params(self, max_tokens: int | None) -> SamplingParams:
        """`max_tokens`: the request's, or (when it gave none) what is left of the context."""
        kw = self.sampling_kwargs()
        if self.echo and self.logprobs is not None:  # echo + logprobs: the prompt's tokens get logprobs too
            kw["prompt_logprobs"] = max(self.logprobs, kw.get("prompt_logprobs", 0))
        return self.make_params(self.constraint(), max_tokens=max_tokens, logprobs=self.logprobs, **kw)


class CompletionLogprobs(ResponseModel):
    text_offset: list[int]
    token_logprobs: list[float | None]
    tokens: list[str]
    top_logprobs: list[dict[str, float] | None]


class CompletionChoice(ResponseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None
    prompt_logprobs: PromptLogprobs | None


class CompletionResponse(ResponseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    system_fingerprint: str | None


class CompletionStreamChoice(ResponseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None
    prompt_logprobs: PromptLogprobs | None = Field(None, description="on a choice's first chunk, when asked for")


class CompletionStreamResponse(ResponseModel):
    """One server-sent event of a streamed completion."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionStreamChoice]
    usage: Usage | None = Field(None, description="with stream_options.include_usage: null but on the last chunk")
