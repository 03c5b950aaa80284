"""Tool calls as OpenAI returns them: one parser class per format, over one JSON scanner (json_scan.py; the
pythonic format's calls are Python, read with `ast`), with `extract` (a whole answer) and `extract_streaming`
(what a grown answer adds) as vLLM's tool_parsers.

A request's tool_choice picks the parser (`tool_parser`): a named function and "required" are decoded under the
tools' schema (constrained.py); "auto" is parsed from the model's own format: the one `pagedllm serve
--enable-auto-tool-choice --tool-call-parser NAME` names (vLLM's flags and names, `TOOL_PARSERS`), else the one
the chat template asks for when it names exactly one (`auto_parser`). A template that never shows the model its
tools (the default SmolLM2 model's) cannot serve "auto" without the flag: a 400.
"""

from __future__ import annotations

import re

from pagedllm.server.tool_parsers.abstract_tool_parser import ExtractedToolCalls, Scan, ScannedCall, ToolParser
from pagedllm.server.tool_parsers.constrained import NamedToolParser, RequiredToolParser
from pagedllm.server.tool_parsers.hermes_tool_parser import HermesToolParser
from pagedllm.server.tool_parsers.llama_tool_parser import Llama3JsonToolParser
from pagedllm.server.tool_parsers.mistral_tool_parser import MistralToolParser
from pagedllm.server.tool_parsers.openai_tool_parser import OpenAIToolParser
from pagedllm.server.tool_parsers.pythonic_tool_parser import PythonicToolParser
from pagedllm.server.tools import ToolMode

# The "auto" formats by vLLM's --tool-call-parser names.
TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesToolParser, Llama3JsonToolParser, MistralToolParser, PythonicToolParser, OpenAIToolParser)
}

__all__ = [
    "TOOL_PARSERS",
    "ExtractedToolCalls",
    "HermesToolParser",
    "Llama3JsonToolParser",
    "MistralToolParser",
    "NamedToolParser",
    "OpenAIToolParser",
    "PythonicToolParser",
    "RequiredToolParser",
    "Scan",
    "ScannedCall",
    "ToolParser",
    "auto_parser",
    "tool_parser",
]


def auto_parser(chat_template: str | None, configured: str | None = None) -> type[ToolParser]:
    """The parser of tool_choice "auto": the configured one (--tool-call-parser), else the format the template
    asks for, when it shows the model its tools (HF templates read a `tools` variable) and names exactly one
    format a parser here reads. ValueError saying why not (the server's 400)."""
    if configured is not None:
        return TOOL_PARSERS[configured]
    if not chat_template or re.search(r"\btools\b", chat_template) is None:
        raise ValueError(
            'tool_choice "auto" needs a chat template that shows the model its tools and a parser for its '
            'tool-call format; this model\'s template has no tools: send tool_choice "required", a named '
            'function or "none"'
        )
    found = [name for name, parser in TOOL_PARSERS.items() if parser.supports(chat_template)]
    if len(found) != 1:
        which = f"asks for {' and '.join(found)} calls" if found else "names no tool-call format known here"
        raise ValueError(
            f'tool_choice "auto": the chat template {which}; start the server with --enable-auto-tool-choice '
            f'--tool-call-parser NAME ({", ".join(TOOL_PARSERS)}), or send tool_choice "required" or a named '
            "function"
        )
    return TOOL_PARSERS[found[0]]


def tool_parser(mode: ToolMode, auto: type[ToolParser] = HermesToolParser) -> ToolParser:
    """A fresh parser (one per choice: it keeps the choice's streaming state) for a request's tool mode; `auto`:
    the "auto" format's class (`auto_parser`)."""
    if mode.kind == "named":
        return NamedToolParser(mode)
    if mode.kind == "required":
        return RequiredToolParser(mode)
    return auto(mode)
