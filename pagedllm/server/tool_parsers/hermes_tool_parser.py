"""The Hermes tool-call format (Qwen's, Hermes', SmolLM3's): `<tool_call>{"name": ..., "arguments": ...}</tool_call>`
blocks after the content, parsed unconstrained for tool_choice "auto" (vLLM's hermes_tool_parser.py)."""

from __future__ import annotations

from pagedllm.server.tool_parsers.abstract_tool_parser import Scan, ScannedCall, ToolParser
from pagedllm.server.tool_parsers.json_scan import CallRead, Incomplete, NotJSON, read_call, skip

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    """The content is the text before the first `<tool_call>` (the whitespace before the tag dropped); while the
    answer grows, a trailing part of the tag is held back. Each block's body is read as a JSON object: once its
    string "name" is read it is a call, its arguments the raw text of its "arguments" value as written (`{}`
    when it has none), streamed as it grows; if the JSON breaks after that, the call stands with what was read
    (a stream cannot take it back: clients check arguments, as OpenAI tells them to). A block that breaks
    before its name (not JSON, no name, cut off by the end of the answer) is no call: it and everything after
    it are content (the whole answer when it is the first, as vLLM). Text between and after calls is dropped
    (vLLM's rule)."""

    @staticmethod
    def supports(chat_template: str) -> bool:
        """Whether a chat template asks for calls in this format."""
        return OPEN in chat_template

    def scan(self, text: str, done: bool) -> Scan:
        at = text.find(OPEN)
        if at < 0:
            return Scan(text if done else _sendable(text), [])
        content = text[:at].rstrip()
        calls: list[ScannedCall] = []
        while at >= 0:
            block = _block(text, at + len(OPEN), done)
            if block is None:
                return Scan(content + text[at:] if calls else text, calls)
            call, end = block
            calls.append(ScannedCall(call.name, call.args or ""))
            if end is None:
                break
            at = text.find(OPEN, end)
        return Scan(content, calls)


def _sendable(text: str) -> str:
    """The content that can go out before any `<tool_call>`: all but a trailing start of the tag and the
    whitespace before it (dropped if the tag comes)."""
    tail = range(max(0, len(text) - len(OPEN) + 1), len(text))
    cut = next((i for i in tail if OPEN.startswith(text[i:])), len(text))
    return text[:cut].rstrip()


def _block(text: str, at: int, done: bool) -> tuple[CallRead, int | None] | None:
    """The call in the block whose body starts at `at`, as far as the text goes, and where the block ends (just
    after its `</tool_call>`; None while open); None when it is no call."""
    call = CallRead()
    after: int | None = None
    try:
        after = read_call(text, skip(text, at), call, "arguments")
        if call.args is None:
            call.args = "{}"
    except Incomplete:
        pass
    except NotJSON as e:
        after = e.at
    if call.name is None and (after is not None or done):
        return None
    if after is None:
        return call, None
    close = text.find(CLOSE, after)
    return call, None if close < 0 else close + len(CLOSE)
