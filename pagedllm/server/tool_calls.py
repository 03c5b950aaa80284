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
keys in schema order), and so are "auto"'s Hermes blocks (`scan_hermes`), so arguments stream as they are
generated; one streamer (`ToolCallStream`) serves every mode, and a whole answer (`parse_calls`) is made by the
same scan, so it is what its stream adds up to: a call cut by max_tokens is a call in both, its arguments as far
as they went (OpenAI's way; the finish reason, "length", tells the client).
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
            raise ValueError(f'tools: tools[{i}] must be {{"type": "function", "function": {{...}}}}')
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
            raise ValueError('tool_choice: a named choice is {"type": "function", "function": {"name": ...}}')
        if name not in check_tools(tools or []):
            raise ValueError(f"tool_choice: function {name!r} is not one of the request's tools")
        return ToolMode("named", name)
    if tool_choice not in (None, "none", "auto", "required"):
        raise ValueError(f'tool_choice: must be "none", "auto", "required" or a named function, got {tool_choice!r}')
    if not tools or tool_choice == "none":
        if tool_choice == "required":
            raise ValueError('tool_choice: "required" needs tools')
        return None
    check_tools(tools)
    return ToolMode("required" if tool_choice == "required" else "auto")


HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"


def auto_tools_supported(chat_template: str | None) -> bool:
    """Whether "auto" can be served: the template shows the model its tools (HF templates read a `tools`
    variable) and asks for calls in the Hermes format, the one format parsed here."""
    if not chat_template:
        return False
    return re.search(r"\btools\b", chat_template) is not None and HERMES_OPEN in chat_template


def scan_hermes(text: str, done: bool) -> tuple[str, list[tuple[str | None, str]]]:
    """The content and the calls (name, None until read; arguments so far) of a growing "auto" answer. Each
    only grows as the text does, so a stream never takes back what it sent, and the whole answer parses to
    what its stream added up to.

    The content is the text before the first `<tool_call>` (the whitespace before the tag dropped); while the
    answer grows, a trailing part of the tag is held back. Each block's body is read as a JSON object: once its
    string "name" is read it is a call, its arguments the raw text of its "arguments" value as written (`{}`
    when it has none), streamed as it grows; if the JSON breaks after that, the call stands with what was read
    (a stream cannot take it back: clients check arguments, as OpenAI tells them to). A block that breaks
    before its name (not JSON, no name, cut off by the end of the answer) is no call: it and everything after
    it are content (the whole answer when it is the first, as vLLM). Text between and after calls is dropped
    (vLLM's rule)."""
    at = text.find(HERMES_OPEN)
    if at < 0:
        return (text if done else _sendable(text)), []
    content = text[:at].rstrip()
    calls: list[tuple[str | None, str]] = []
    while at >= 0:
        block = _hermes_block(text, at + len(HERMES_OPEN), done)
        if block is None:
            return (content + text[at:] if calls else text), calls
        calls.append((block.name, block.args or ""))
        if block.end is None:
            break
        at = text.find(HERMES_OPEN, block.end)
    return content, calls


def _sendable(text: str) -> str:
    """The content that can go out before any `<tool_call>`: all but a trailing start of the tag and the
    whitespace before it (dropped if the tag comes)."""
    tail = range(max(0, len(text) - len(HERMES_OPEN) + 1), len(text))
    cut = next((i for i in tail if HERMES_OPEN.startswith(text[i:])), len(text))
    return text[:cut].rstrip()


@dataclass
class _Block:
    name: str | None = None
    args: str | None = None  # None until the "arguments" member starts
    end: int | None = None  # just after its `</tool_call>`; None while open


class _Incomplete(Exception):
    """The text ends inside what is being read."""


class _NotJSON(Exception):
    """The block's JSON breaks at `at`."""

    def __init__(self, at: int) -> None:
        super().__init__(at)
        self.at = at


def _hermes_block(text: str, at: int, done: bool) -> _Block | None:
    """The call in the block whose body starts at `at`, as far as the text goes; None when it is no call."""
    block = _Block()
    after: int | None = None
    try:
        after = _read_call(text, _skip(text, at), block)
        if block.args is None:
            block.args = "{}"
    except _Incomplete:
        pass
    except _NotJSON as e:
        after = e.at
    if block.name is None and (after is not None or done):
        return None
    if after is not None:
        close = text.find(HERMES_CLOSE, after)
        block.end = None if close < 0 else close + len(HERMES_CLOSE)
    return block


def _read_call(text: str, p: int, block: _Block) -> int:
    """Reads the object at p into `block`; the position after it. The first "name" and "arguments" count."""
    _expect(text, p, "{")
    p = _skip(text, p + 1)
    if _expect(text, p, '"}') == "}":
        return p + 1
    while True:
        _expect(text, p, '"')
        key_end = _value_end(text, p)
        key = json.loads(text[p:key_end])
        p = _skip(text, key_end)
        _expect(text, p, ":")
        v = _skip(text, p + 1)
        if key == "arguments" and block.args is None:
            end = _read_arguments(text, v, block)
        else:
            end = _value_end(text, v)
            value = json.loads(text[v:end])
            if key == "name" and block.name is None:
                if not isinstance(value, str):
                    raise _NotJSON(v)
                block.name = value
        p = _skip(text, end)
        if _expect(text, p, ",}") == "}":
            return p + 1
        p = _skip(text, p + 1)


def _read_arguments(text: str, v: int, block: _Block) -> int:
    """The arguments value at v: its raw text so far (a string value, decoded, once whole); where it ends."""
    if v >= len(text):
        raise _Incomplete
    try:
        end = _value_end(text, v)
    except _Incomplete:
        block.args = "" if text[v] == '"' else text[v:]
        raise
    except _NotJSON as e:
        block.args = text[v : e.at]
        raise
    block.args = json.loads(text[v:end]) if text[v] == '"' else text[v:end]
    return end


_BARE = re.compile(r"[-+.\w]+")  # a number, true, false or null (json.loads judges it whole)


def _value_end(text: str, p: int) -> int:
    """Where the JSON value at p ends: _Incomplete while the text ends inside it, _NotJSON where it breaks (a
    character JSON never has outside a string at once, the rest when the value is whole)."""
    if p >= len(text):
        raise _Incomplete
    if text[p] in '{["':
        end = _bracketed_end(text, p)
    else:
        bare = _BARE.match(text, p)
        if bare is None:
            raise _NotJSON(p)
        if bare.end() == len(text):
            raise _Incomplete
        end = bare.end()
    try:
        json.loads(text[p:end])
    except ValueError:
        raise _NotJSON(end) from None
    return end


def _bracketed_end(text: str, p: int) -> int:
    depth, in_str, esc = 0, False, False
    for i in range(p, len(text)):
        ch = text[i]
        if in_str:
            esc, in_str = (False, True) if esc else (ch == "\\", ch != '"')
        elif ch == '"':
            in_str = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        elif not (ch.isalnum() or ch in " \t\n\r,:-+."):
            raise _NotJSON(i)
        if depth == 0 and not in_str:
            return i + 1
    raise _Incomplete


def _expect(text: str, p: int, chars: str) -> str:
    if p >= len(text):
        raise _Incomplete
    if text[p] not in chars:
        raise _NotJSON(p)
    return text[p]


def _skip(text: str, p: int) -> int:
    while p < len(text) and text[p] in " \t\n\r":
        p += 1
    return p


def tool_schema(tools: list[dict[str, Any]], mode: ToolMode, parallel: bool = True) -> dict[str, Any]:
    """The JSON schema the output is held to; `parallel` False (OpenAI's parallel_tool_calls) allows one call.
    For "required" each tool's parameters sit inside the array's schema, so their `$defs` (where pydantic puts
    nested models) move to its root, where their `#/$defs/...` references point (vLLM's way)."""
    params = check_tools(tools)
    if mode.name:
        return params[mode.name]
    defs: dict[str, Any] = {}
    items = []
    for n, p in params.items():
        own = p.get("$defs")
        if isinstance(own, dict):
            for key, value in own.items():
                if defs.setdefault(key, value) != value:
                    raise ValueError(f"tools: $defs {key!r} differs between two tools' parameters")
            p = {k: v for k, v in p.items() if k != "$defs"}
        items.append(
            {
                "type": "object",
                "properties": {"name": {"type": "string", "enum": [n]}, "parameters": p},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": items}, **({} if parallel else {"maxItems": 1})}
    return {**schema, "$defs": defs} if defs else schema


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def scan_answer(mode: ToolMode, text: str, done: bool) -> tuple[str, list[tuple[str | None, str]]]:
    """The content and the calls (name, arguments text so far) of a growing answer in any mode: what a stream
    sends and what the whole answer is made of, so both are the same. A named function's answer is its
    arguments; "required"'s is the array of calls (`scan_calls`); "auto"'s is Hermes blocks (`scan_hermes`)."""
    if mode.kind == "auto":
        return scan_hermes(text, done)
    if mode.name:
        return "", [(mode.name, text)]
    return "", [call[:2] for call in scan_calls(text)]


def parse_calls(text: str, mode: ToolMode) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, OpenAI's `tool_calls`) of a finished answer: exactly what its stream adds up to. A call cut
    off (by max_tokens) stands with its arguments as far as they were generated, as OpenAI returns it; a call
    whose name was not yet whole is none. Without calls, an "auto" answer's content is its whole text."""
    content, calls = scan_answer(mode, text, done=True)
    named = []
    for name, args in calls:
        if name is None:
            break
        named.append({"id": call_id(), "type": "function", "function": {"name": name, "arguments": args}})
    return content or None, named


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
                calls.append((_item_name(text[item_at:args_at]), text[args_at : i + 1], True))
                args_at = -1
        elif ch == ":" and depth == 2:
            key = json.loads(text[text.rfind('"', 0, i - 1) : i])
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
    """Per streamed choice: turns the cumulative answer text into OpenAI's deltas (content, tool_calls)."""

    mode: ToolMode
    ids: list[str] = field(default_factory=list)  # per call whose header was sent
    sent: list[int] = field(default_factory=list)  # per call, arguments characters sent
    content_sent: int = 0

    def delta(self, text: str, done: bool) -> dict[str, Any]:
        """What the answer grown to `text` adds: new content, new calls' headers, pieces of arguments."""
        content, calls = scan_answer(self.mode, text, done)
        out: dict[str, Any] = {}
        if len(content) > self.content_sent:
            out["content"], self.content_sent = content[self.content_sent :], len(content)
        tool_calls = []
        for i, (name, args) in enumerate(calls):
            if name is None:
                break
            if i == len(self.ids):
                self.ids.append(call_id())
                self.sent.append(0)
                tool_calls.append(
                    {"index": i, "id": self.ids[i], "type": "function", "function": {"name": name, "arguments": ""}}
                )
            if len(args) > self.sent[i]:
                tool_calls.append({"index": i, "function": {"arguments": args[self.sent[i] :]}})
                self.sent[i] = len(args)
        if tool_calls:
            out["tool_calls"] = tool_calls
        return out
