"""The Mistral tool-call formats (vLLM's `mistral`, mistral_tool_parser.py): content, then `[TOOL_CALLS]` and
the calls, as a JSON array `[{"name": ..., "arguments": {...}}, ...]` (Mistral 7B v0.3's tokenizer) or, since the
v11 tokenizers, one `[TOOL_CALLS]name{...}` per call (`[TOOL_CALLS]name[ARGS]{...}` in the newer templates)."""

from __future__ import annotations

import re

from pagedllm.server.tool_parsers.abstract_tool_parser import Scan, ScannedCall, ToolParser, sendable
from pagedllm.server.tool_parsers.json_scan import CallRead, Incomplete, NotJSON, read_arguments, read_calls, skip

TAG, ARGS = "[TOOL_CALLS]", "[ARGS]"
_NAME = re.compile(r"[A-Za-z0-9_-]+")


class MistralToolParser(ToolParser):
    """The content is the text before the first `[TOOL_CALLS]` (a trailing start of the tag held back while the
    answer grows, as Hermes' `<tool_call>`). A call is one once its name is whole (in the array: its string; in
    the v11 form: the name followed by `{` or `[ARGS]`), its arguments the raw JSON written, streamed as they
    grow. When the first call breaks before its name the whole answer is content; a later one ends the calls,
    and text between calls is dropped (vLLM's rule). The tag is a special token in Mistral's tokenizers, so a
    request it parses is detokenized with special tokens kept (`adjust_request`, as vLLM's parser)."""

    name = "mistral"
    keeps_special_tokens = True  # `[TOOL_CALLS]` is a special token in Mistral's tokenizers

    @staticmethod
    def supports(chat_template: str) -> bool:
        return TAG in chat_template

    def scan(self, text: str, done: bool) -> Scan:
        at = text.find(TAG)
        if at < 0:
            return Scan(text if done else sendable(text, TAG), [])
        p = skip(text, at + len(TAG))
        if p < len(text) and text[p] == "[":
            found, broken = read_calls(text, p + 1, ("arguments",), ",", done)
            calls = [ScannedCall(c.name, c.args or "") for c in found]
        else:
            calls, broken = _v11_calls(text, at, done)
        return Scan(text, []) if broken else Scan(text[:at].rstrip(), calls)


def _v11_calls(text: str, at: int, done: bool) -> tuple[list[ScannedCall], bool]:
    """The `[TOOL_CALLS]name[ARGS]{...}` calls from the tag at `at`, and whether the first is no call."""
    calls: list[ScannedCall] = []
    while at >= 0:
        head = _head(text, skip(text, at + len(TAG)))
        if not isinstance(head, tuple):
            if head is None and not done:
                calls.append(ScannedCall(None, ""))  # it may still be a call: nothing of it goes out yet
            return calls, not calls and (head is False or done)
        name, p = head
        call = CallRead(name)
        try:
            end = read_arguments(text, skip(text, p), call)
        except (Incomplete, NotJSON):
            return [*calls, ScannedCall(name, call.args or "")], False
        calls.append(ScannedCall(name, call.args or ""))
        at = text.find(TAG, end)
    return calls, False


def _head(text: str, p: int) -> tuple[str, int] | bool | None:
    """A v11 call's name at p and where its arguments start, once the name is whole (followed by `[ARGS]` or
    `{`); None while the text may still make it one; False when it is none."""
    m = _NAME.match(text, p)
    q = m.end() if m else p
    rest = text[q:]
    if m is not None and rest.startswith(ARGS):
        return m.group(), q + len(ARGS)
    if m is not None and rest.lstrip().startswith("{"):
        return m.group(), q
    if not rest.strip() or (m is not None and ARGS.startswith(rest)):
        return None
    return False
