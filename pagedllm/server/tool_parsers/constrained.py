"""The formats constrained decoding writes (vLLM's way for tool_choice "required" and a named function): the answer
is held to a JSON schema made from the tools (`tools.tool_schema`), so it is calls and nothing else.

- a named function: the answer is that function's arguments;
- "required": the answer is a non-empty array `[{"name": ..., "parameters": {...}}, ...]`, one item per call,
  read with the same scanner as the Hermes blocks (json_scan.py).
"""

from __future__ import annotations

from pagedllm.server.tool_parsers.abstract_tool_parser import Scan, ScannedCall, ToolParser
from pagedllm.server.tool_parsers.json_scan import CallRead, Incomplete, NotJSON, expect, read_call, skip


class NamedToolParser(ToolParser):
    """tool_choice naming a function: the answer is its arguments, one call."""

    def scan(self, text: str, done: bool) -> Scan:
        assert self.mode.name is not None
        return Scan("", [ScannedCall(self.mode.name, text)])


class RequiredToolParser(ToolParser):
    """tool_choice "required": the array of calls, each as far as it was generated."""

    def scan(self, text: str, done: bool) -> Scan:
        calls: list[ScannedCall] = []
        try:
            p = skip(text, 0)
            expect(text, p, "[")
            p = skip(text, p + 1)
            while True:
                call = CallRead()
                started = p < len(text)
                try:
                    p = skip(text, read_call(text, p, call, ("parameters",)))
                finally:  # a call read in part is still a call (its arguments as far as they went)
                    if started:
                        calls.append(ScannedCall(call.name, call.args or ""))
                if expect(text, p, ",]") == "]":
                    break
                p = skip(text, p + 1)
        except (Incomplete, NotJSON):
            pass
        return Scan("", calls)
