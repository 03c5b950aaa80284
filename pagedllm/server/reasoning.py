"""Reasoning models' thinking, apart from their answer (vLLM's `--reasoning-parser`, its `reasoning_content`).

Qwen3 and the DeepSeek-R1 distills write `<think> ... </think>` before the answer. A parser splits an answer, whole
or as it grows, into its reasoning and its content; the constraint of a request (a JSON schema, a tool call)
starts after the reasoning ends (the engine's grammar waits for the end text: `reasoning_end`).

Where an answer starts is read from the prompt the chat template rendered: inside the thinking when the prompt
ends in an open `<think>` (templates that open it for the model, R1's, Qwen3-Thinking's), past it when the prompt
ends with a closed one (`enable_thinking: false` makes Qwen3's template write an empty `<think></think>`), and
otherwise as each model does: `qwen3` thinks only inside a `<think>` it writes itself (no tag: all content),
`deepseek_r1` starts inside the thinking without the opening tag.

One rule for whole and streamed answers, so the deltas add up to the message: a cut-off answer (max_tokens) that
is still inside its thinking is all reasoning (vLLM's stream says so; its whole answer makes Qwen3's content).

gpt-oss (`openai_gptoss`, vLLM's name) writes no tags but harmony messages (harmony.py): the `analysis` channel is
the reasoning, the `final` channel and the preambles (`commentary` to nobody) the content; a tool call's message
is neither (the `openai` tool parser reads it from the answer). Its markers are special tokens, so its answers
are detokenized with special tokens kept, and a constraint holds the answer from `<|channel|>final<|message|>`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from pagedllm.sampling_params import SamplingParams
from pagedllm.server import harmony

State = Literal["before", "inside", "after"]  # where the answer starts: before a <think>, inside one, past it


@dataclass(frozen=True)
class ReasoningFormat:
    """A model family's thinking tags, and whether its answers start inside the thinking."""

    name: str
    starts_inside: bool
    start: str = "<think>"
    end: str = "</think>"  # what a constraint waits for (the engine's reasoning_end)
    harmony: bool = False  # gpt-oss: harmony's channels (harmony.py), not tags

    def initial_state(self, prompt: str) -> State:
        """Where an answer to this rendered prompt starts (see the module's docstring)."""
        if self.harmony:  # a prompt that opened the final channel leaves only the answer to write
            return "after" if prompt.endswith(self.end) else "inside"
        opened, closed = prompt.rfind(self.start), prompt.rfind(self.end)
        if opened > closed:
            return "inside"
        if closed != -1 and not prompt[closed + len(self.end) :].strip():
            return "after"
        return "inside" if self.starts_inside else "before"

    def adjust_request(self, params: SamplingParams) -> None:
        """Ready a request's sampling for this format: harmony's markers are special tokens, kept in the text."""
        if self.harmony:
            params.skip_special_tokens = False


REASONING_PARSERS = {
    "qwen3": ReasoningFormat("qwen3", starts_inside=False),
    "deepseek_r1": ReasoningFormat("deepseek_r1", starts_inside=True),
    "openai_gptoss": ReasoningFormat("openai_gptoss", True, harmony.START, harmony.FINAL_START, harmony=True),
}


def _partial_tag(text: str, tag: str) -> int:
    """How many characters at the end of `text` could be the start of `tag` (held back while streaming)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


@dataclass(frozen=True)
class Split:
    reasoning: str | None  # None: the answer has no reasoning section (so far)
    content: str
    ended: bool  # the reasoning is over (or there is none to wait for)


@dataclass
class ReasoningParser:
    """Splits one choice's answer; `extract_streaming` keeps what its stream sent."""

    fmt: ReasoningFormat
    state: State
    reasoning_sent: int = 0
    content_sent: int = 0

    def split(self, text: str, done: bool) -> Split:
        """The answer grown to `text` (`done`: it is whole) as reasoning and content; each part only grows as the
        text does, a tag's first characters held back until they are surely not the tag."""
        if self.state == "after":
            return Split(None, text, True)
        if self.fmt.harmony:
            msgs = harmony.messages(text, done)
            ended = done or any(not m.is_reasoning for m in msgs)
            return Split(harmony.reasoning(msgs), harmony.content(msgs), ended)
        before, rest = "", text
        if self.state == "before":
            at = text.find(self.fmt.start)
            if at == -1:
                hold = 0 if done else _partial_tag(text, self.fmt.start)
                return Split(None, text[: len(text) - hold], done)
            before, rest = text[:at], text[at + len(self.fmt.start) :]
        end = rest.find(self.fmt.end)
        if end == -1:
            hold = 0 if done else _partial_tag(rest, self.fmt.end)
            return Split(rest[: len(rest) - hold], before, False)
        return Split(rest[:end], before + rest[end + len(self.fmt.end) :], True)

    def extract(self, text: str) -> tuple[str | None, str]:
        """A whole answer's reasoning (None without a section) and content."""
        got = self.split(text, done=True)
        return got.reasoning, got.content

    def extract_streaming(self, text: str, done: bool) -> tuple[str, str]:
        """(the new reasoning, all the content so far): the content goes on to the tool parser or out as is."""
        got = self.split(text, done)
        reasoning = got.reasoning or ""
        new = reasoning[self.reasoning_sent :]
        self.reasoning_sent = max(self.reasoning_sent, len(reasoning))
        return new, got.content


def reasoning_tokens(
    fmt: ReasoningFormat, state: State, token_ids: list[int], decode: Callable[[list[int]], str]
) -> int:
    """How many of an answer's tokens are its reasoning, tags included: from the token where the opening tag
    begins (the first, when the answer starts inside) to the one that completes the closing tag (the last, when
    it never closes); harmony's: from the first to the one that ends its last analysis message. Found by
    bisection on the decoded prefixes."""
    if state == "after" or not token_ids:
        return 0
    text = decode(token_ids)

    def first_reaching(test: Callable[[str], bool]) -> int:
        """The fewest leading tokens whose text passes `test` (which the whole answer passes)."""
        lo, hi = 1, len(token_ids)
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if test(decode(token_ids[:mid])) else (mid + 1, hi)
        return lo

    if fmt.harmony:  # through the end of the last analysis message
        ends = [m.end for m in harmony.messages(text, True) if m.is_reasoning]
        return first_reaching(lambda t: len(t) >= ends[-1]) if ends else 0
    skipped, after = 0, 0
    if state == "before":
        at = text.find(fmt.start)
        if at == -1:
            return 0
        skipped, after = first_reaching(lambda t: len(t) > at) - 1, at + len(fmt.start)
    if text.find(fmt.end, after) == -1:
        return len(token_ids) - skipped
    return first_reaching(lambda t: t.find(fmt.end, after) != -1) - skipped
