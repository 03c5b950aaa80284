"""Request and response bodies of /tokenize and /detokenize (vLLM's)."""

from __future__ import annotations

from typing import Any

from pydantic import Field, StrictBool, model_validator

from pagedllm.server.protocol import RequestModel, ResponseModel, TokenId
from pagedllm.server.protocol_chat import ChatMessage, check_template_kwargs


class TokenizeRequest(RequestModel):
    """vLLM's two forms in one body: a `prompt`, or chat `messages` rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_generation_prompt: StrictBool = True
    add_special_tokens: StrictBool | None = Field(None, description="default: true for a prompt, false for chat")
    return_token_strs: StrictBool = False
    continue_final_message: StrictBool = False
    chat_template: str | None = Field(None, description="as in chat completions (--trust-request-chat-template)")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="as in chat completions")

    @model_validator(mode="after")
    def _one_form(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("prompt: send either 'prompt' or 'messages'")
        check_template_kwargs(self.chat_template_kwargs)
        return self


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[TokenId]


class TokenizeResponse(ResponseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None


class DetokenizeResponse(ResponseModel):
    prompt: str
