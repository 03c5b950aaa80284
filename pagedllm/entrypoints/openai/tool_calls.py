"""Tool calls as OpenAI returns them, produced by constrained decoding (vLLM's way for tool_choice "required" and a
named function): the output is held to a JSON schema made from the tools, then parsed into `tool_calls`.

- a named function: the output is that function's arguments (its `parameters` schema);
- "required": the output is a non-empty array of `{"name": ..., "parameters": ...}`, one item per call, each item
  one of the tools (vLLM's schema);
- "auto" needs the model's chat template to render the tools and a parser for the model's own tool-call format:
  the Hermes format (`<tool_call>{"name": ..., "arguments": ...}</tool_call>`, Qwen's, Hermes', SmolLM3's) is
  parsed, unconstrained; a template that never mentions tools (the default SmolLM2 model's) gets a 400.

Streaming follows OpenAI: a call's first delta carries its index, id, type and name with empty arguments, later
deltas carry pieces of the arguments text. The array form is scanned as it grows (the constrained JSON is compact,
keys in schema order), so arguments stream as they are generated.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolMode:
    """How the answer is made into tool calls: "named" (`name`), "required" or "auto"."""

    kind: str
    name: str | None = None


def check_tools(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Function name -> its parameters schema; ValueError ("tools: ...") for a tool OpenAI would refuse."""
    found: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise ValueError(f"tools: tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}")
        name = fn.get("name")
        if not isinstance(name, str) or not NAME.match(name):
            raise ValueError(f"tools: tools[{i}].function.name must be 1-64 letters, digits, _ or -, got {name!r}")
        if name in found:
            raise ValueError(f"tools: function {name!r} is defined twice")
        params = fn.get("parameters", EMPTY_PARAMETERS)
        if not isinstance(params, dict):
            raise ValueError(f"tools: tools[{i}].function.parameters must be a JSON schema object")
        found[name] = params
    return found


def tool_mode(tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None) -> ToolMode | None:
    """The constrained mode a request asks for, or None (no tools, or tool_choice "none"); ValueError naming the
    field for what cannot be served. "auto" (also tool_choice left out with tools) needs a template that renders
    tools: the caller checks that (`template_renders_tools`)."""
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if tool_choice.get("type") != "function" or not isinstance(name, str):
            raise ValueError("tool_choice: a named choice is {\"type\": \"function\", \"function\": {\"name\": ...}}")
        if name not in check_tools(tools or []):
            raise ValueError(f"tool_choice: function {name!r} is not one of the request's tools")
        return ToolMode("named", name)
    if tool_choice not in (None, "none", "auto", "required"):
        raise ValueError(f"tool_choice: must be \"none\", \"auto\", \"required\" or a named function, "
                         f"got {tool_choice!r}")
    if not tools or tool_choice == "none":
        if tool_choice == "required":
            raise ValueError("tool_choice: \"required\" needs tools")
        return None
    check_tools(tools)
    return ToolMode("required" if tool_choice == "required" else "auto")


HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def auto_tools_supported(chat_template: str | None) -> bool:
    """Whether "auto" can be served: the template shows the model its tools (HF templates read a `tools`
    variable) and asks for calls in the Hermes format, the one format parsed here."""
    if not chat_template:
        return False
    return re.search(r"\btools\b", chat_template) is not None and HERMES_OPEN in chat_template


def parse_hermes(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(the content before the calls, or None if empty; the calls) of an "auto" answer; a block that is not
    a JSON call stays in the content."""
    calls = []
    for block in HERMES_CALL.finditer(text):
        try:
            call = json.loads(block.group(1))
            name, args = call["name"], call.get("arguments", {})
        except (ValueError, KeyError, TypeError):
            return text, []
        calls.append({"id": call_id(), "type": "function", "function": {
            "name": name, "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)}})
    if not calls:
        return text, []
    content = text[:text.index(HERMES_OPEN)].strip()
    return content or None, calls


def tool_schema(tools: list[dict[str, Any]], mode: ToolMode, parallel: bool = True) -> dict[str, Any]:
    """The JSON schema the output is held to; `parallel` False (OpenAI's parallel_tool_calls) allows one call."""
    params = check_tools(tools)
    if mode.name:
        return params[mode.name]
    items = [{"type": "object", "properties": {"name": {"type": "string", "enum": [n]}, "parameters": p},
              "required": ["name", "parameters"], "additionalProperties": False} for n, p in params.items()]
    return {"type": "array", "minItems": 1, "items": {"anyOf": items}, **({} if parallel else {"maxItems": 1})}


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_tool_calls(text: str, mode: ToolMode) -> list[dict[str, Any]] | None:
    """OpenAI's `tool_calls` from a finished answer; None when it does not parse (cut off by max_tokens)."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    calls = [(mode.name, value)] if mode.name else [(c["name"], c["parameters"]) for c in value]
    compact = (",", ":")
    return [{"id": call_id(), "type": "function", "function": {
        "name": name, "arguments": json.dumps(args, ensure_ascii=False, separators=compact)}} for name, args in calls]


def scan_calls(text: str) -> list[tuple[str | None, str, bool]]:
    """The calls in a growing compact array `[{"name":"f","parameters":{...}},...]`: per call, its name (None
    until its string is complete), the arguments text so far, and whether the arguments are complete."""
    calls: list[tuple[str | None, str, bool]] = []
    depth, in_str, esc, key, args_at, item_at = 0, False, False, "", -1, -1
    for i, ch in enumerate(text):
        if in_str:
            esc, in_str = (False, True) if esc else (ch == "\\", ch != '"')
            continue
        if ch == '"':
            in_str = True
        elif ch in "{[":
            depth += 1
            if depth == 2:
                item_at = i
            elif depth == 3 and key == "parameters":
                args_at = i
        elif ch in "}]":
            depth -= 1
            if depth == 2 and args_at >= 0:
                calls.append((_item_name(text[item_at:args_at]), text[args_at:i + 1], True))
                args_at = -1
        elif ch == ":" and depth == 2:
            key = json.loads(text[text.rfind('"', 0, i - 1):i])
    if args_at >= 0 and depth >= 3:
        calls.append((_item_name(text[item_at:args_at]), text[args_at:], False))
    elif depth == 2 and item_at >= 0 and key != "parameters":
        calls.append((_item_name(text[item_at:]), "", False))
    return calls


def _item_name(head: str) -> str | None:
    match = re.match(r'\{"name":("(?:[^"\\]|\\.)*")', head)
    return json.loads(match.group(1)) if match else None


@dataclass
class ToolCallStream:
    """Per streamed choice: turns the cumulative answer text into OpenAI's tool_calls deltas."""

    mode: ToolMode
    ids: list[str] = field(default_factory=list)  # per call whose header was sent
    sent: list[int] = field(default_factory=list)  # per call, arguments characters sent

    def deltas(self, text: str) -> list[dict[str, Any]]:
        calls = [(self.mode.name, text, False)] if self.mode.name else scan_calls(text)
        out = []
        for i, (name, args, _) in enumerate(calls):
            if name is None:
                break
            if i == len(self.ids):
                self.ids.append(call_id())
                self.sent.append(0)
                out.append({"index": i, "id": self.ids[i], "type": "function",
                            "function": {"name": name, "arguments": ""}})
            if len(args) > self.sent[i]:
                out.append({"index": i, "function": {"arguments": args[self.sent[i]:]}})
                self.sent[i] = len(args)
        return out
