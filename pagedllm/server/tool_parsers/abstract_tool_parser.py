"""What every tool-call format's parser is (vLLM's tool_parsers/abstract_tool_parser.py): a format says only how
to `scan` a growing answer into its content and calls; `extract` (a whole answer) and `extract_streaming` (the
delta a grown answer adds) are made from that one scan, so a whole answer is what its stream adds up to.

One parser serves one choice: the streaming state (which calls' headers went out, how much of each one's
arguments and of the content) lives on it.
"""

from __future__ import annotations

import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import NamedTuple

from pagedllm.sampling_params import SamplingParams
from pagedllm.server.protocol_chat import DeltaFunctionCall, DeltaMessage, DeltaToolCall, FunctionCall, ToolCall
from pagedllm.server.tools import ToolMode


class ScannedCall(NamedTuple):
    name: str | None  # None until its string is whole: no call yet (this and later ones are not sent)
    arguments: str  # the arguments text as far as it was generated


class Scan(NamedTuple):
    content: str
    calls: list[ScannedCall]


@dataclass
class ExtractedToolCalls:
    """A whole answer's content (None when empty) and calls (vLLM's ExtractedToolCallInformation)."""

    content: str | None
    tool_calls: list[ToolCall]


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _named(calls: list[ScannedCall]) -> list[ScannedCall]:
    """The calls up to the first whose name is not whole yet."""
    out = []
    for call in calls:
        if call.name is None:
            break
        out.append(call)
    return out


def sendable(text: str, tag: str) -> str:
    """The content that can go out before a format's opening `tag`: all but a trailing start of the tag and the
    whitespace before it (dropped if the tag comes)."""
    tail = range(max(0, len(text) - len(tag) + 1), len(text))
    cut = next((i for i in tail if tag.startswith(text[i:])), len(text))
    return text[:cut].rstrip()


class ToolParser(ABC):
    """One tool-call format: `scan` is the format's; the rest is shared. `name`: vLLM's --tool-call-parser name
    of an "auto" format."""

    name = ""
    # Whether the format's markers are special tokens the answer must keep (vLLM's adjust_request turns
    # skip_special_tokens off for them): the engine never puts a stop token's text in an answer, so only they show.
    keeps_special_tokens = False
    # Whether it reads the answer as generated rather than the content a reasoning parser leaves (harmony: its
    # calls are messages of the answer beside the reasoning, which the reasoning parser takes out).
    reads_answer = False

    def __init__(self, mode: ToolMode) -> None:
        self.mode = mode
        self.ids: list[str] = []  # per call whose header was streamed
        self.sent: list[int] = []  # per call, arguments characters streamed
        self.content_sent = 0

    @staticmethod
    def supports(chat_template: str) -> bool:
        """Whether a chat template asks the model for calls in this format (an "auto" format says yes)."""
        return False

    def adjust_request(self, params: SamplingParams) -> None:
        """Ready a request's sampling for this format (vLLM's ToolParser.adjust_request): a format whose markers
        are special tokens has them detokenized."""
        if self.keeps_special_tokens:
            params.skip_special_tokens = False

    @abstractmethod
    def scan(self, text: str, done: bool) -> Scan:
        """The content and the calls of an answer grown to `text` (`done`: it is whole). Each only grows as the
        text does, so a stream never takes back what it sent."""

    def extract(self, text: str) -> ExtractedToolCalls:
        """A finished answer: exactly what its stream adds up to. A call cut off (by max_tokens) stands with its
        arguments as far as they were generated, as OpenAI returns it; a call whose name was not yet whole is
        none."""
        content, calls = self.scan(text, done=True)
        tool_calls = [
            ToolCall(id=call_id(), type="function", function=FunctionCall(name=c.name, arguments=c.arguments))
            for c in _named(calls)
            if c.name is not None
        ]
        return ExtractedToolCalls(content or None, tool_calls)

    def extract_streaming(self, text: str, done: bool) -> DeltaMessage:
        """What the answer grown to `text` adds: new content, new calls' headers (index, id, type, name, empty
        arguments: OpenAI's first delta of a call), pieces of arguments."""
        content, calls = self.scan(text, done)
        delta = DeltaMessage()
        if len(content) > self.content_sent:
            delta.content, self.content_sent = content[self.content_sent :], len(content)
        tool_calls = []
        for i, (name, args) in enumerate(_named(calls)):
            if i == len(self.ids):
                self.ids.append(call_id())
                self.sent.append(0)
                header = DeltaFunctionCall(name=name, arguments="")
                tool_calls.append(DeltaToolCall(index=i, id=self.ids[i], type="function", function=header))
            if len(args) > self.sent[i]:
                piece = DeltaFunctionCall(arguments=args[self.sent[i] :])
                tool_calls.append(DeltaToolCall(index=i, function=piece))
                self.sent[i] = len(args)
        if tool_calls:
            delta.tool_calls = tool_calls
        return delta
