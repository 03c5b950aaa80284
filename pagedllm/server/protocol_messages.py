"""Request and response bodies of Anthropic's Messages API (`/v1/messages`), with the `anthropic` SDK's names and
shapes (anthropic/types/). The request becomes a chat request (`to_chat`): `system` a system message, text
blocks the messages' text, a `tool_use` block the assistant's call as JSON, a `tool_result` a tool message,
`stop_sequences` stop, tools (`input_schema`) the chat tools, tool_choice auto / any / tool / none the chat's
auto / required / named / none. What pagedllm cannot honour (images, documents, extended thinking, server
tools) is a 400 naming the field."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field, StrictBool, StrictInt, model_validator

from pagedllm.server.protocol import OpenAIModel, RequestModel, ResponseModel


class ContentBlock(OpenAIModel):
    """A block of a message's content: text, a tool call the assistant made, or a tool's result."""

    type: Literal["text", "tool_use", "tool_result"]
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None
    content: str | list[dict[str, Any]] | None = None
    is_error: StrictBool | None = None

    @model_validator(mode="after")
    def _fields_of_its_type(self) -> ContentBlock:
        need = {"text": ("text",), "tool_use": ("id", "name", "input"), "tool_result": ("tool_use_id",)}
        for name in need[self.type]:
            if getattr(self, name) is None:
                raise ValueError(f"a {self.type} block needs '{name}'")
        return self

    def result_text(self) -> str:
        """A tool_result's content as text (its text blocks)."""
        if not isinstance(self.content, list):
            return self.content or ""
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"messages: only text tool results are supported, got {part.get('type')!r}")
        return "".join(p["text"] for p in self.content)


class AnthropicMessage(OpenAIModel):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]

    def chat_messages(self) -> list[dict[str, Any]]:
        """The chat messages this one is: its text (and calls, as JSON) in one, each tool result a tool one."""
        if isinstance(self.content, str):
            return [{"role": self.role, "content": self.content}]
        out: list[dict[str, Any]] = []
        text: list[str] = []
        for block in self.content:
            if block.type == "text":
                text.append(block.text or "")
            elif block.type == "tool_use":
                text.append(json.dumps({"name": block.name, "arguments": block.input}))
            else:
                if text:
                    out.append({"role": self.role, "content": "".join(text)})
                    text = []
                out.append({"role": "tool", "content": block.result_text()})
        if text or not out:
            out.append({"role": self.role, "content": "".join(text)})
        return out


def _check_tool_turns(messages: list[AnthropicMessage]) -> None:
    """Anthropic's rule for tool blocks: a tool_use is the assistant's (its ids unique), and a tool_result answers
    a tool_use of the assistant turn just before its own; anything else is a ValueError naming the block."""
    calls: set[str] = set()  # the tool_use ids of the assistant turn before this one
    for i, m in enumerate(messages):
        blocks = m.content if isinstance(m.content, list) else []
        where = [f"messages.{i}.content.{j}" for j in range(len(blocks))]
        uses = [(w, b) for w, b in zip(where, blocks, strict=True) if b.type == "tool_use"]
        results = [(w, b) for w, b in zip(where, blocks, strict=True) if b.type == "tool_result"]
        if m.role == "user" and uses:
            raise ValueError(f"messages: {uses[0][0]}: a tool_use block must be in an assistant message")
        if m.role == "assistant" and results:
            raise ValueError(f"messages: {results[0][0]}: a tool_result block must be in a user message")
        for w, b in results:
            if b.tool_use_id not in calls:
                raise ValueError(
                    f"messages: {w}: tool_use_id {b.tool_use_id!r} answers no tool_use block of the assistant "
                    "message just before"
                )
        ids = [b.id or "" for _, b in uses]
        if len(set(ids)) < len(ids):
            raise ValueError(f"messages: messages.{i}: tool_use ids must be unique")
        calls = set(ids) if m.role == "assistant" else set()


class AnthropicTool(OpenAIModel):
    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = Field(None, description="custom tools only (no server tools)")


class AnthropicToolChoice(OpenAIModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: StrictBool | None = None

    @model_validator(mode="after")
    def _named(self) -> AnthropicToolChoice:
        if self.type == "tool" and self.name is None:
            raise ValueError('tool_choice: type "tool" needs the tool\'s name')
        return self

    def chat(self) -> str | dict[str, Any]:
        if self.type == "tool":
            return {"type": "function", "function": {"name": self.name}}
        return {"auto": "auto", "any": "required", "none": "none"}[self.type]


class MessagesRequest(RequestModel):
    model: str
    max_tokens: StrictInt = Field(ge=1)
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[ContentBlock] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: StrictInt | None = Field(None, ge=1)
    stream: StrictBool = False
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    metadata: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = Field(None, description="only {'type': 'disabled'}")

    @model_validator(mode="after")
    def _honoured(self) -> MessagesRequest:
        if self.thinking is not None and self.thinking.get("type") != "disabled":
            raise ValueError("thinking: extended thinking is not supported")
        if isinstance(self.system, list) and any(b.type != "text" for b in self.system):
            raise ValueError("system: only text blocks")
        _check_tool_turns(self.messages)
        return self

    def to_chat(self) -> dict[str, Any]:
        """The chat completions body this request is (checked again as one: its errors are renamed back)."""
        system = self.system if not isinstance(self.system, list) else "".join(b.text or "" for b in self.system)
        messages = [{"role": "system", "content": system}] if system else []
        for m in self.messages:
            messages += m.chat_messages()
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "max_tokens": self.max_tokens,
            "stop": self.stop_sequences,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
        }
        if self.tools:
            body["tools"] = [
                {
                    "type": "function",
                    "function": {"name": t.name, "description": t.description or "", "parameters": t.input_schema},
                }
                for t in self.tools
            ]
        if self.messages[-1].role == "assistant":  # Anthropic's prefill: the answer goes on from that text
            body["add_generation_prompt"], body["continue_final_message"] = False, True
        if self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice.chat()
            body["parallel_tool_calls"] = not self.tool_choice.disable_parallel_tool_use
        return {k: v for k, v in body.items() if v is not None}


CHAT_FIELDS = {"stop": "stop_sequences"}  # where a chat request's field came from, for its errors
StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


# ------------------------------------------------------------------------------------------------ responses
class TextBlock(ResponseModel):
    type: Literal["text"]
    text: str


class ToolUseBlock(ResponseModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class AnthropicUsage(ResponseModel):
    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int | None = Field(None, description="prompt tokens served from the prefix cache")


class MessageObject(ResponseModel):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[TextBlock | ToolUseBlock]
    stop_reason: StopReason | None
    stop_sequence: str | None
    usage: AnthropicUsage


class MessageStreamEvent(ResponseModel):
    """One event of a streamed message (Anthropic's): message_start (`message`), content_block_start (`index`,
    `content_block`), content_block_delta (`index`, `delta`: text_delta or input_json_delta), content_block_stop
    (`index`), message_delta (`delta`: stop_reason, stop_sequence; `usage`), message_stop."""

    type: Literal[
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    message: MessageObject | None = None
    index: int | None = None
    content_block: TextBlock | ToolUseBlock | None = None
    delta: dict[str, Any] | None = None
    usage: dict[str, int] | None = None


class AnthropicError(ResponseModel):
    type: str = Field(description="invalid_request_error, authentication_error, not_found_error, api_error, ...")
    message: str


class AnthropicErrorResponse(ResponseModel):
    """Anthropic's error body, on /v1/messages."""

    type: Literal["error"]
    error: AnthropicError
