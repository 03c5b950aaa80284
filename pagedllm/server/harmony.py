"""OpenAI's harmony format (gpt-oss), read from an answer's text: the one reader of the reasoning parser
(`openai_gptoss`) and the tool parser (`openai`), so the two agree on every message.

A gpt-oss answer is a run of messages. Each is a header, `<|message|>`, then its body up to `<|end|>` (the next
message then opens with `<|start|>assistant`), `<|call|>` (a tool call: the answer stops) or `<|return|>` (the
final answer: it stops). The header names the message's channel (`<|channel|>analysis`: the chain of thought;
`final`: the answer; `commentary`: tool calls, or a preamble the user may see) and, for a tool call, its
recipient (`to=functions.get_weather`, before or after the channel; `<|constrain|>json` or a bare `json` says
the body is JSON). The chat template's generation prompt ends in `<|start|>assistant`, so an answer starts
with its first message's header.

The markers are special tokens, so an answer is detokenized with special tokens kept (both parsers ask for it);
`<|call|>` and `<|return|>` are stop tokens, whose text the engine never puts in an answer. While an answer
grows, a header is no message until its `<|message|>` came, and a body's trailing start of a marker is held
back, so a message's body only grows (a marker is one token, so this holds back only a model's own `<|`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
FINAL_START = CHANNEL + "final" + MESSAGE  # where the answer proper starts (a constraint holds it from there)
_MARKERS = (START, CHANNEL, MESSAGE, "<|constrain|>", *ENDS)
_CHANNEL = re.compile(r"<\|channel\|>\s*([^\s<]+)")
_RECIPIENT = re.compile(r"(?:^|\s|>)to=([^\s<]+)")


@dataclass(frozen=True)
class Message:
    """One message of an answer, as far as the answer goes."""

    channel: str | None  # None: the header named none
    recipient: str | None  # "functions.get_weather", "browser.search", ... (None: to the user)
    text: str  # the body so far
    end: int  # offset in the answer just past the message (its end marker, or what is held back of it)

    @property
    def is_reasoning(self) -> bool:
        return self.channel == "analysis" and self.recipient is None

    @property
    def is_content(self) -> bool:
        """The final answer, or a preamble (commentary to nobody) the user is meant to see."""
        return self.recipient is None and self.channel in ("final", "commentary")

    @property
    def function(self) -> str | None:
        """The name of the function this message calls (None: not a function call; built-in tools such as
        `browser.search` are no function of the request's)."""
        if self.recipient is None or not self.recipient.startswith("functions."):
            return None
        return self.recipient.removeprefix("functions.")


def _held(tail: str) -> int:
    """How many characters at the end of `tail` could be the start of a marker (held back while streaming)."""
    at = tail.rfind("<")
    if at < 0 or len(tail) - at >= max(map(len, _MARKERS)):
        return 0
    return len(tail) - at if any(m.startswith(tail[at:]) for m in _MARKERS) else 0


def _header(header: str) -> tuple[str | None, str | None]:
    channel, recipient = _CHANNEL.search(header), _RECIPIENT.search(header)
    return (channel.group(1) if channel else None), (recipient.group(1) if recipient else None)


def messages(text: str, done: bool) -> list[Message]:
    """The messages of an answer grown to `text` (`done`: it is whole). A header cut off before its `<|message|>`
    is no message (yet)."""
    out: list[Message] = []
    at = 0
    while at < len(text):
        opened = text.find(MESSAGE, at)
        if opened < 0:
            break
        channel, recipient = _header(text[at:opened])
        body = opened + len(MESSAGE)
        found = [(i, m) for m in (*ENDS, START) if (i := text.find(m, body)) >= 0]
        if not found:
            end = len(text) if done else len(text) - _held(text[body:])
            out.append(Message(channel, recipient, text[body:end], end))
            break
        stop, marker = min(found)
        after = stop + (0 if marker == START else len(marker))  # a <|start|> with no <|end|> opens the next
        out.append(Message(channel, recipient, text[body:stop], after))
        at = after
    return out


def reasoning(msgs: list[Message]) -> str | None:
    """The analysis messages' bodies, a line apart (None: none)."""
    texts = [m.text for m in msgs if m.is_reasoning]
    return "\n".join(texts) if texts else None


def content(msgs: list[Message]) -> str:
    """The final and preamble messages' bodies, a line apart: what the user is meant to read."""
    return "\n".join(m.text for m in msgs if m.is_content)
