"""Request and response bodies of OpenAI's Responses API (`/v1/responses`, stateless), with the `openai` SDK's
names and shapes (openai/types/responses/). The request becomes a chat request (`to_chat`): `instructions` a
system message, `input` the messages, function tools the chat tools, `text.format` the response format,
`max_output_tokens` max_tokens; what pagedllm cannot honour (stored responses, other tool types, reasoning) is a
400 naming the field."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field, StrictBool, StrictInt, model_validator

from pagedllm.server.protocol import OpenAIModel, RequestModel, ResponseModel

ItemType = Literal["message", "function_call", "function_call_output"]
TEXT_PARTS = ("input_text", "output_text", "text")


class InputItem(OpenAIModel):
    """One item of `input`: a message (`type` "message" or left out), a function call the model made or its
    output."""

    type: ItemType = "message"
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: str | list[dict[str, Any]] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | None = None

    @model_validator(mode="after")
    def _fields_of_its_type(self) -> InputItem:
        need = {"message": ("role", "content"), "function_call": ("call_id", "name", "arguments")}
        for name in need.get(self.type, ("call_id", "output")):
            if getattr(self, name) is None:
                raise ValueError(f"a {self.type} item needs '{name}'")
        return self

    def chat_message(self) -> dict[str, Any]:
        """As a chat message: a call as the assistant's JSON, its output as a tool message."""
        if self.type == "function_call":
            return {"role": "assistant", "content": json.dumps({"name": self.name, "arguments": self.arguments})}
        if self.type == "function_call_output":
            return {"role": "tool", "content": self.output}
        if isinstance(self.content, list):
            for part in self.content:
                if part.get("type") not in TEXT_PARTS or not isinstance(part.get("text"), str):
                    raise ValueError(f"input: only text content parts are supported, got {part.get('type')!r}")
            return {"role": self.role, "content": "".join(p["text"] for p in self.content)}
        return {"role": self.role, "content": self.content}


def _check_outputs(items: list[InputItem]) -> None:
    """OpenAI's rule: a function_call_output answers a function_call item before it (by `call_id`)."""
    calls: set[str] = set()
    for i, item in enumerate(items):
        if item.type == "function_call":
            calls.add(item.call_id or "")
        elif item.type == "function_call_output" and item.call_id not in calls:
            raise ValueError(f"input: input.{i}: no function_call item before it has call_id {item.call_id!r}")


class FunctionTool(OpenAIModel):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class TextFormat(OpenAIModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str = "response"
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: StrictBool | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> TextFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("text.format: type json_schema needs a schema")
        return self


class TextConfig(OpenAIModel):
    format: TextFormat | None = None


class ResponsesRequest(RequestModel):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool = True
    text: TextConfig | None = None
    max_output_tokens: StrictInt | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: StrictBool = False
    store: StrictBool | None = Field(None, description="accepted; nothing is stored (this server is stateless)")
    metadata: dict[str, str] | None = None
    user: str | None = None
    previous_response_id: str | None = Field(None, description="not supported: the server keeps no responses")
    background: StrictBool | None = Field(None, description="only false")
    reasoning: dict[str, Any] | None = Field(None, description="not supported")

    @model_validator(mode="after")
    def _honoured(self) -> ResponsesRequest:
        if self.previous_response_id is not None:
            raise ValueError("previous_response_id: not supported: this server is stateless; send the whole input")
        if self.background:
            raise ValueError("background: not supported")
        if self.reasoning is not None:
            raise ValueError("reasoning: not supported")
        if isinstance(self.input, list) and not self.input:
            raise ValueError("input: must not be empty")
        if isinstance(self.input, list):
            _check_outputs(self.input)
        if isinstance(self.tool_choice, dict) and (
            self.tool_choice.get("type") != "function" or not isinstance(self.tool_choice.get("name"), str)
        ):
            raise ValueError('tool_choice: a named choice is {"type": "function", "name": ...}')
        return self

    def to_chat(self) -> dict[str, Any]:
        """The chat completions body this request is (checked again as one: its errors are renamed back)."""
        items = [InputItem(role="user", content=self.input)] if isinstance(self.input, str) else self.input
        messages = [{"role": "system", "content": self.instructions}] if self.instructions else []
        messages += [item.chat_message() for item in items]
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "max_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "parallel_tool_calls": self.parallel_tool_calls,
            "user": self.user,
        }
        if self.tools:
            fields = ("name", "description", "parameters")
            functions = [
                {k: v for k, v in t.model_dump(include=set(fields)).items() if v is not None} for t in self.tools
            ]
            body["tools"] = [{"type": "function", "function": f} for f in functions]
        if isinstance(self.tool_choice, dict):
            body["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice["name"]}}
        elif self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type != "text":
            schema = {"name": fmt.name, "schema": fmt.json_schema, "strict": fmt.strict}
            body["response_format"] = {
                "type": fmt.type,
                **({"json_schema": schema} if fmt.type == "json_schema" else {}),
            }
        return {k: v for k, v in body.items() if v is not None}


# Where a chat request's field came from, for its errors.
CHAT_FIELDS = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
}


# ------------------------------------------------------------------------------------------------ responses
class OutputText(ResponseModel):
    type: Literal["output_text"]
    text: str
    annotations: list[dict[str, Any]]
    logprobs: list[dict[str, Any]]


class OutputMessage(ResponseModel):
    type: Literal["message"]
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"]
    content: list[OutputText]


class FunctionCallItem(ResponseModel):
    type: Literal["function_call"]
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


OutputItem = OutputMessage | FunctionCallItem


class InputTokensDetails(ResponseModel):
    cached_tokens: int


class OutputTokensDetails(ResponseModel):
    reasoning_tokens: int


class ResponseUsage(ResponseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(ResponseModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(ResponseModel):
    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    model: str
    output: list[OutputItem]
    instructions: str | None
    max_output_tokens: int | None
    parallel_tool_calls: bool
    temperature: float | None
    top_p: float | None
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    text: dict[str, Any]
    metadata: dict[str, str]
    incomplete_details: IncompleteDetails | None
    error: dict[str, Any] | None
    usage: ResponseUsage | None
    store: bool = Field(description="false: nothing is stored")


class ResponseStreamEvent(ResponseModel):
    """One event of a streamed response (OpenAI's typed events): `type` says which, and which of the other
    fields it has: response.created / in_progress / completed / incomplete (`response`),
    response.output_item.added / done (`output_index`, `item`), response.content_part.added / done (`item_id`,
    `output_index`, `content_index`, `part`), response.output_text.delta (`delta`, `logprobs`) / done (`text`,
    `logprobs`), response.function_call_arguments.delta (`delta`) / done (`arguments`, `name`)."""

    type: str
    sequence_number: int
    response: ResponseObject | None = None
    output_index: int | None = None
    item: OutputItem | None = None
    item_id: str | None = None
    content_index: int | None = None
    part: OutputText | None = None
    delta: str | None = None
    text: str | None = None
    arguments: str | None = None
    name: str | None = None
    logprobs: list[dict[str, Any]] | None = None
