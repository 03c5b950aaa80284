"""gpt-oss's tool calls (vLLM's `openai` tool parser): harmony messages to a function, `<|channel|>commentary
to=functions.NAME <|constrain|>json<|message|>{...}<|call|>` (the recipient may come before the channel too), read
by the harmony reader the `openai_gptoss` reasoning parser uses (harmony.py)."""

from __future__ import annotations

from pagedllm.server import harmony
from pagedllm.server.tool_parsers.abstract_tool_parser import Scan, ScannedCall, ToolParser


class OpenAIToolParser(ToolParser):
    """A call is a message whose recipient is `functions.NAME`: one once its header is whole, its arguments the
    body as written, streamed as it grows (a call cut off stands with what was generated, as the other formats').
    The content is the final answer and the preambles (commentary to nobody); the chain of thought (analysis) is
    neither (with --reasoning-parser openai_gptoss it is the reasoning), and a built-in tool's message
    (`browser.search`, `python`) is no call of the request's. The markers are special tokens, kept in the text
    (`adjust_request`), and it reads the answer as generated, beside the reasoning parser (`reads_answer`)."""

    name = "openai"
    keeps_special_tokens = True
    reads_answer = True

    @staticmethod
    def supports(chat_template: str) -> bool:
        """gpt-oss's template renders calls as harmony messages to `functions.` recipients."""
        return harmony.CHANNEL + "commentary" in chat_template and "functions." in chat_template

    def scan(self, text: str, done: bool) -> Scan:
        msgs = harmony.messages(text, done)
        calls = [ScannedCall(m.function, m.text) for m in msgs if m.function is not None]
        return Scan(harmony.content(msgs), calls)
