"""Request and response bodies of /v1/chat/completions: messages, tools (their checks in tools.py), chat template
variables, the answer and its stream's deltas. The Responses and Messages APIs are chat requests made from theirs.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, StrictBool, StrictInt, model_validator

from pagedllm.sampling_params import MAX_LOGPROBS, SamplingParams, StructuredOutputsParams
from pagedllm.server.protocol import OpenAIModel, PromptLogprobs, ResponseModel, Usage
from pagedllm.server.protocol_sampling import SamplingRequest
from pagedllm.server.tools import ToolMode, tool_mode, tool_schema

Role = Literal["system", "user", "assistant", "tool", "developer"]


class ChatMessage(OpenAIModel):
    role: Role
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

    def text(self) -> str:
        """The content as one string; only text parts (images, audio, files need a model that reads them)."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type", "text") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"messages: only text content parts are supported, got {part.get('type')!r}")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: StrictInt | None = Field(None, ge=0)
    max_completion_tokens: StrictInt | None = Field(None, ge=0)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool = True
    functions: list[dict[str, Any]] | None = None
    echo: StrictBool = False
    chat_template: str | None = Field(
        None, description="a Jinja chat template for this request (needs --trust-request-chat-template)"
    )
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description='more variables for the chat template, e.g. {"enable_thinking": false}'
    )

    @model_validator(mode="after")
    def _check(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: logprobs must be true when top_logprobs is set")
        limit = self.effective_max_tokens
        if limit is not None and self.min_tokens > limit:
            raise ValueError(f"min_tokens: ({self.min_tokens}) must be <= max_tokens ({limit})")
        if self.functions:
            raise ValueError("functions: the deprecated functions field is not supported; send tools")
        mode, constraint = self.tool_mode, self.constraint()
        if mode is not None and mode.kind != "auto" and constraint is not None:
            raise ValueError(f"tool_choice: a tool choice and {constraint[0]} cannot be combined")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError(
                "continue_final_message: cannot be combined with add_generation_prompt true (set it to false)"
            )
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise ValueError("continue_final_message: the last message must be the assistant's, to continue")
        check_template_kwargs(self.chat_template_kwargs)
        if self.echo:
            raise ValueError("echo: not supported for chat completions")
        return self

    @property
    def effective_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def tool_mode(self) -> ToolMode | None:
        return tool_mode(self.tools, self.tool_choice)

    @property
    def constraint_field(self) -> str | None:
        """ "tools" when the tools' schema is the constraint (tool_choice "required" or a named function)."""
        mode = self.tool_mode
        if mode is not None and mode.kind != "auto":
            return "tools"
        return super().constraint_field

    @property
    def top_k_logprobs(self) -> int | None:
        """Logprobs per generated token: None when not asked for, else how many alternatives."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def to_sampling_params(self, max_tokens: int | None) -> SamplingParams:
        mode, constraint = self.tool_mode, self.constraint()
        if mode is not None and mode.kind != "auto":
            schema = tool_schema(self.tools or [], mode, self.parallel_tool_calls)
            constraint = ("tools", StructuredOutputsParams(json=schema))
        return self.make_params(
            constraint, max_tokens=max_tokens, logprobs=self.top_k_logprobs, **self.sampling_kwargs()
        )


# What the server sets itself when it renders a chat (and transformers' own keywords): not a request's to set.
RESERVED_TEMPLATE_NAMES = frozenset(
    {
        "messages",
        "conversation",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
        "processor_kwargs",
    }
)


def check_template_kwargs(kwargs: dict[str, Any] | None) -> None:
    """chat_template_kwargs: template variables, never what the server sets itself (ValueError naming it)."""
    for key in kwargs or {}:
        if not key.isidentifier() or key in RESERVED_TEMPLATE_NAMES:
            raise ValueError(f"chat_template_kwargs: {key!r} cannot be set (not a template variable name)")


class TopLogprob(ResponseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatLogprob(ResponseModel):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatChoiceLogprobs(ResponseModel):
    content: list[ChatLogprob]


class FunctionCall(ResponseModel):
    name: str
    arguments: str = Field(description="the arguments as the model wrote them (JSON text; check it)")


class ToolCall(ResponseModel):
    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatCompletionMessage(ResponseModel):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCall]
    reasoning_content: str | None = Field(None, description="with --reasoning-parser: the thinking (vLLM's)")


class ChatChoice(ResponseModel):
    index: int
    message: ChatCompletionMessage
    logprobs: ChatChoiceLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None


class ChatCompletionResponse(ResponseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None
    prompt_logprobs: PromptLogprobs | None


class DeltaFunctionCall(ResponseModel):
    name: str | None = Field(None, description="on a call's first delta")
    arguments: str


class DeltaToolCall(ResponseModel):
    """A call's first delta has its id, type and name (arguments ""); later ones pieces of its arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(ResponseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(ResponseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None = Field(None, description="not on the role's chunk")


class ChatCompletionStreamResponse(ResponseModel):
    """One server-sent event of a streamed chat completion."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = Field(None, description="with stream_options.include_usage: null but on the last chunk")
