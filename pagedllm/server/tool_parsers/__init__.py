"""Tool calls as OpenAI returns them: one parser class per format, over one JSON scanner (json_scan.py), with
`extract` (a whole answer) and `extract_streaming` (what a grown answer adds) as vLLM's tool_parsers.

A request's tool_choice picks the parser (`tool_parser`): a named function and "required" are decoded under the
tools' schema (constrained.py); "auto" is parsed from the model's own format, which its chat template asks for:
Hermes today (Llama 3 JSON, Mistral, pythonic are one class each in `AUTO_PARSERS`). A template that never shows
the model its tools (the default SmolLM2 model's) cannot serve "auto": a 400.
"""

from __future__ import annotations

import re

from pagedllm.server.protocol import ToolMode
from pagedllm.server.tool_parsers.abstract_tool_parser import ExtractedToolCalls, Scan, ScannedCall, ToolParser
from pagedllm.server.tool_parsers.constrained import NamedToolParser, RequiredToolParser
from pagedllm.server.tool_parsers.hermes_tool_parser import HermesToolParser

AUTO_PARSERS: list[type[ToolParser]] = [HermesToolParser]  # the "auto" formats, asked of the template

__all__ = [
    "ExtractedToolCalls",
    "HermesToolParser",
    "NamedToolParser",
    "RequiredToolParser",
    "Scan",
    "ScannedCall",
    "ToolParser",
    "auto_tools_supported",
    "tool_parser",
]


def auto_tools_supported(chat_template: str | None) -> bool:
    """Whether "auto" can be served: the template shows the model its tools (HF templates read a `tools`
    variable) and asks for calls in a format a parser here reads."""
    if not chat_template or re.search(r"\btools\b", chat_template) is None:
        return False
    return _auto_parser(chat_template) is not None


def _auto_parser(chat_template: str | None) -> type[ToolParser] | None:
    """The "auto" format the template asks for, if a parser here reads it."""
    return next((p for p in AUTO_PARSERS if chat_template and p.supports(chat_template)), None)


def tool_parser(mode: ToolMode, chat_template: str | None = None) -> ToolParser:
    """A fresh parser (one per choice: it keeps the choice's streaming state) for a request's tool mode."""
    if mode.kind == "named":
        return NamedToolParser(mode)
    if mode.kind == "required":
        return RequiredToolParser(mode)
    return (_auto_parser(chat_template) or HermesToolParser)(mode)
