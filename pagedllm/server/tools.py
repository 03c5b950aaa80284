"""A request's tools and tool_choice (OpenAI's): the functions checked, the mode asked for, and the JSON schema a
"required" or named choice holds the output to (vLLM's way); tool_parsers/ make the answer into calls.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolMode:
    """How the answer is made into tool calls: "named" (`name`), "required" or "auto" (tool_parsers/)."""

    kind: Literal["named", "required", "auto"]
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
    tools or a --tool-call-parser: the caller checks that (`tool_parsers.auto_parser`)."""
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
