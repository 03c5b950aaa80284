"""The Llama 3.x JSON tool-call format (vLLM's `llama3_json`, llama_tool_parser.py): the answer is the calls,
`{"name": ..., "parameters": {...}}` objects (`"arguments"` is read too), `;` between two, maybe after a
`<|python_tag|>`; an answer that starts otherwise is content."""

from __future__ import annotations

import re

from pagedllm.server.tool_parsers.abstract_tool_parser import Scan, ScannedCall, ToolParser
from pagedllm.server.tool_parsers.json_scan import read_calls

TAG = "<|python_tag|>"
# Llama 3.1/3.2's templates: 'Respond in the format {"name": function name, "parameters": dictionary of ...}'
_ASKS = re.compile(r'\{\s*"name"\s*:\s*[^,{}]*,\s*"parameters"\s*:')


class Llama3JsonToolParser(ToolParser):
    """While the answer is only whitespace or a start of `<|python_tag|>` nothing is sent: it may still become a
    call. Past that, an answer whose first character is not `{` is content; one that is, is calls once the first
    object's string name is read (each streamed as it grows, as the Hermes ones), or content when that object
    breaks or ends before one. Text after the last call that is not another call is dropped (vLLM's rule)."""

    name = "llama3_json"

    @staticmethod
    def supports(chat_template: str) -> bool:
        return TAG in chat_template or _ASKS.search(chat_template) is not None

    def scan(self, text: str, done: bool) -> Scan:
        body = text.lstrip()
        if not done and TAG.startswith(body):
            return Scan("", [])
        p = len(text) - len(body) + (len(TAG) if body.startswith(TAG) else 0)
        rest = text[p:].lstrip()
        if not rest and not done:
            return Scan("", [])
        if not rest.startswith("{"):
            return Scan(text, [])
        found, broken = read_calls(text, p, ("parameters", "arguments"), ";", done)
        if broken:
            return Scan(text, [])
        return Scan("", [ScannedCall(c.name, c.args or "") for c in found])
