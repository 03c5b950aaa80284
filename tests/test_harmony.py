"""gpt-oss's harmony chat format in the server (issue 34): `--reasoning-parser openai_gptoss` returns the analysis
channel as reasoning_content, the `openai` tool parser the messages to `functions.*` as tool calls, whole and
streamed alike (a stream cut anywhere adds up to the whole answer); and a real server over a tiny model with a
tokenizer whose special tokens are harmony's, its answer forced to harmony messages, serves both (special tokens
kept in the text, the stop tokens <|return|> / <|call|> never in it, the thinking's tokens counted)."""

from __future__ import annotations

import contextlib
import json
from types import SimpleNamespace

import pytest
from engine_helpers import kv_budget
from server_helpers import assert_pool_whole, running_server, sse_events

from pagedllm.engine.outputs import CompletionOutput
from pagedllm.server.reasoning import REASONING_PARSERS, ReasoningParser, reasoning_tokens
from pagedllm.server.serving_chat import _message, _StreamedChoice
from pagedllm.server.tool_parsers import TOOL_PARSERS, OpenAIToolParser, auto_parser
from pagedllm.server.tools import ToolMode

HARMONY = REASONING_PARSERS["openai_gptoss"]
AUTO = ToolMode("auto")
THINK = "<|channel|>analysis<|message|>The user wants a sum.<|end|>"
FINAL = "<|start|>assistant<|channel|>final<|message|>It is 3."
CALL = '<|start|>assistant<|channel|>commentary to=functions.add <|constrain|>json<|message|>{"a": 1, "b": 2}'
# (answer, reasoning, content, calls)
CASES = [
    (THINK + FINAL, "The user wants a sum.", "It is 3.", []),
    (THINK + CALL, "The user wants a sum.", "", [("add", '{"a": 1, "b": 2}')]),
    (  # the recipient in the role's header, as the chat template renders past calls
        THINK + '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Oslo"}',
        "The user wants a sum.",
        "",
        [("get_weather", '{"city": "Oslo"}')],
    ),
    (  # a preamble to the user, then the call
        THINK + "<|start|>assistant<|channel|>commentary<|message|>Adding.<|end|>" + CALL,
        "The user wants a sum.",
        "Adding.",
        [("add", '{"a": 1, "b": 2}')],
    ),
    (  # two thoughts, a built-in tool's message (no call of the request's), then the answer
        THINK + "<|start|>assistant<|channel|>analysis to=browser.search<|message|>{}<|end|>"
        "<|start|>assistant<|channel|>analysis<|message|>Done.<|end|>" + FINAL,
        "The user wants a sum.\nDone.",
        "It is 3.",
        [],
    ),
    ("<|channel|>analysis<|message|>Cut o", "Cut o", "", []),  # max_tokens inside the thinking: all reasoning
    (
        THINK + '<|start|>assistant<|channel|>commentary to=functions.add json<|message|>{"a": 1',
        "The user wants a sum.",
        "",
        [("add", '{"a": 1')],
    ),  # a call cut off stands as generated  # fmt: skip
    (THINK + "<|start|>assistant<|channel|>comm", "The user wants a sum.", "", []),  # a header cut off: nothing
    ("<|channel|>final<|message|>No thinking. a <| b", None, "No thinking. a <| b", []),  # a model's own "<|"
]


def _stream_reasoning(text: str, ends: list[int]) -> tuple[str, str]:
    parser, reasoning, content = ReasoningParser(HARMONY, "inside"), "", ""
    for end in ends:
        new, now = parser.extract_streaming(text[:end], end == len(text))
        assert now.startswith(content), (now, content)  # content only grows
        reasoning, content = reasoning + new, now
    return reasoning, content


@pytest.mark.parametrize("text, reasoning, content, calls", CASES)
def test_the_reasoning_parser_splits_harmony_and_its_stream_adds_up(text, reasoning, content, calls):
    assert ReasoningParser(HARMONY, "inside").extract(text) == (reasoning, content)
    for ends in (range(1, len(text) + 1), [len(text) // 3, len(text)]):  # a character at a time, and in pieces
        assert _stream_reasoning(text, list(ends)) == (reasoning or "", content)


@pytest.mark.parametrize("text, reasoning, content, calls", CASES)
def test_the_openai_tool_parser_reads_harmony_calls_whole_and_streamed(text, reasoning, content, calls):
    got = OpenAIToolParser(AUTO).extract(text)
    assert (got.content or "", [(c.function.name, c.function.arguments) for c in got.tool_calls]) == (content, calls)
    parser, streamed_content, streamed = OpenAIToolParser(AUTO), "", {}
    for end in range(1, len(text) + 1):
        delta = parser.extract_streaming(text[:end], end == len(text))
        streamed_content += delta.content or ""
        for t in delta.tool_calls or []:
            if t.id is not None:
                assert t.index == len(streamed) and t.function.arguments == ""
                streamed[t.index] = [t.function.name, ""]
            streamed[t.index][1] += t.function.arguments
    assert (streamed_content, [tuple(c) for c in streamed.values()]) == (content, calls)


def test_an_answer_after_a_prompt_that_opened_the_final_channel_is_all_content():
    assert HARMONY.initial_state("<|start|>assistant<|channel|>final<|message|>") == "after"
    assert HARMONY.initial_state("<|start|>user<|message|>hi<|end|><|start|>assistant") == "inside"
    assert ReasoningParser(HARMONY, "after").extract("It is 3.") == (None, "It is 3.")


def test_with_both_parsers_the_calls_come_from_the_answer_beside_the_reasoning():
    """The chat route's message and its streamed deltas, --reasoning-parser openai_gptoss with tool_choice auto:
    the reasoning parser takes the analysis out, the tool parser reads the calls from the answer itself."""
    ctx = SimpleNamespace(
        engine=SimpleNamespace(tokenizer=SimpleNamespace(chat_template=None)), tool_call_parser="openai"
    )
    text = THINK + "<|start|>assistant<|channel|>commentary<|message|>Adding.<|end|>" + CALL
    message, finish = _message(ctx, AUTO, CompletionOutput(0, text, [1], "stop"), ReasoningParser(HARMONY, "inside"))
    assert (message.reasoning_content, message.content, finish) == ("The user wants a sum.", "Adding.", "tool_calls")
    ((got),) = message.tool_calls
    assert (got.function.name, got.function.arguments) == ("add", '{"a": 1, "b": 2}')
    streamed = _StreamedChoice(ctx, AUTO, ReasoningParser(HARMONY, "inside"))
    reasoning, content, args = "", "", ""
    for end in range(1, len(text) + 1):
        delta = streamed.delta(text[:end], end == len(text))
        reasoning += delta.reasoning_content or ""
        content += delta.content or ""
        args += "".join(t.function.arguments for t in delta.tool_calls or [])
    assert (reasoning, content, args) == (message.reasoning_content, message.content, got.function.arguments)


def test_gpt_oss_templates_ask_for_the_openai_format_and_the_flags_name_it():
    from pagedllm.server.config import REASONING_PARSER_NAMES, TOOL_PARSER_NAMES

    template = (
        '{{- "<|start|>assistant to=" }}{{- "functions." + tool_call.name + "<|channel|>commentary " }}{{ tools }}'
    )
    assert auto_parser(template) is OpenAIToolParser
    assert "openai" in TOOL_PARSER_NAMES and TOOL_PARSERS["openai"] is OpenAIToolParser
    assert set(REASONING_PARSER_NAMES) == set(REASONING_PARSERS)


# ------------------------------------------------------------------------------ a server over a tiny model
MARKERS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"]
WORDS = ["assistant", "user", "analysis", "final", "commentary", " to=functions.add", "json", "Add", "Think", " more.",
         "It", " is", " 3.", '{"a":', " 1,", ' "b":', " 2}"]  # fmt: skip
TEMPLATE = (
    "{# tool calls: <|start|>assistant<|channel|>commentary to=functions.NAME json<|message|>ARGS<|call|> #}"
    "{% for m in messages %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if tools %}<|start|>user<|message|>{% for t in tools %}{{ t['function']['name'] }}{% endfor %}<|end|>"
    "{% endif %}{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]


def _byte_level(word: str) -> str:
    return word.replace(" ", "Ġ")


def _harmony_tokenizer(folder: str, vocab_size: int) -> None:
    """Harmony's markers as special tokens, a few words, filler up to the model's vocabulary; text decodes as the
    tokens' own strings joined (byte-level, as gpt-oss's BPE vocabulary: a space is "Ġ"), and <|return|> and
    <|call|> end a generation."""
    from tokenizers import Tokenizer as HFTok
    from tokenizers import decoders
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    names = ["<unk>", *MARKERS, *(_byte_level(w) for w in WORDS)]
    names += [f"w{i}" for i in range(vocab_size - len(names))]
    tok = HFTok(WordLevel({n: i for i, n in enumerate(names)}, unk_token="<unk>"))
    tok.pre_tokenizer, tok.decoder = WhitespaceSplit(), decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", additional_special_tokens=MARKERS)
    fast.chat_template = TEMPLATE
    fast.save_pretrained(folder)
    with open(f"{folder}/generation_config.json", "w") as f:
        json.dump({"eos_token_id": [names.index("<|return|>"), names.index("<|call|>")]}, f)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from model_helpers import make_tiny_hf

    from pagedllm.engine import EngineConfig, LLMEngine
    from pagedllm.engine.async_engine import AsyncLLMEngine
    from pagedllm.model import load_model

    folder = str(tmp_path_factory.mktemp("harmony"))
    make_tiny_hf("llama_gqa_tied", folder)
    _harmony_tokenizer(folder, 256)
    loaded = load_model(folder, dtype="float32", verbose=False)
    config = EngineConfig(dtype="float32", max_model_len=256, kv_cache_memory=kv_budget(16), log_stats_interval=0)
    engine = AsyncLLMEngine(LLMEngine(config, loaded=loaded))
    with running_server(engine, served_model_name=["m"], reasoning_parser="openai_gptoss") as s:
        yield s


@contextlib.contextmanager
def forced(s, tokens: list[str]):
    """Every request's answer is these tokens (each the highest logit at its position by far)."""
    ids = s.engine.tokenizer.hf.convert_tokens_to_ids([_byte_level(t) for t in tokens])
    grammars = s.engine.engine.grammars
    real = grammars.constrain

    def constrain(to_sample, logits):
        row = 0
        for req, lg in to_sample:
            for j in range(len(lg)):
                if req.num_output_tokens + j < len(ids):
                    logits[row + j, ids[req.num_output_tokens + j]] += 1e4
            row += len(lg)
        return real(to_sample, logits)

    grammars.constrain = constrain
    try:
        yield
    finally:
        del grammars.constrain


def _ask(s, stream: bool, **body) -> dict:
    """The message (reasoning, content, calls), finish reason and usage, joined from the deltas when streamed."""
    body = {"messages": [{"role": "user", "content": "Add"}], "max_tokens": 40, "temperature": 0, **body}
    if not stream:
        r = s.http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        choice, usage = r.json()["choices"][0], r.json()["usage"]
        m = choice["message"]
        calls = [(c["function"]["name"], c["function"]["arguments"]) for c in m.get("tool_calls") or []]
        thinking = usage["completion_tokens_details"]["reasoning_tokens"]
        return {"reasoning": m["reasoning_content"], "content": m["content"], "calls": calls,
                "finish": choice["finish_reason"], "reasoning_tokens": thinking}  # fmt: skip
    body.update(stream=True, stream_options={"include_usage": True})
    with s.http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        events = [e for e in sse_events(r.iter_lines()) if e != "[DONE]"]
    deltas = [c["delta"] for e in events for c in e["choices"]]
    calls: dict[int, list[str]] = {}
    for t in (t for d in deltas for t in d.get("tool_calls") or []):
        calls.setdefault(t["index"], [t["function"].get("name"), ""])[1] += t["function"]["arguments"]
    return {
        "reasoning": "".join(d.get("reasoning_content") or "" for d in deltas) or None,
        "content": "".join(d.get("content") or "" for d in deltas) or None,
        "calls": [tuple(c) for c in calls.values()],
        "finish": next(c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]),
        "reasoning_tokens": events[-1]["usage"]["completion_tokens_details"]["reasoning_tokens"],
    }


THOUGHT = ["<|channel|>", "analysis", "<|message|>", "Think", " more.", "<|end|>"]
ANSWER = [*THOUGHT, "<|start|>", "assistant", "<|channel|>", "final", "<|message|>", "It", " is", " 3.", "<|return|>"]
CALLED = [*THOUGHT, "<|start|>", "assistant", "<|channel|>", "commentary", " to=functions.add", "<|constrain|>",
          "json", "<|message|>", '{"a":', " 1,", ' "b":', " 2}", "<|call|>"]  # fmt: skip


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_server_returns_harmony_reasoning_answers_and_calls(server, stream):
    with forced(server, ANSWER):
        got = _ask(server, stream)
    assert got == {"reasoning": "Think more.", "content": "It is 3.", "calls": [], "finish": "stop",
                   "reasoning_tokens": len(THOUGHT)}  # fmt: skip
    with forced(server, CALLED):
        got = _ask(server, stream, tools=TOOLS)
    assert got == {"reasoning": "Think more.", "content": None, "calls": [("add", '{"a": 1, "b": 2}')],
                   "finish": "tool_calls", "reasoning_tokens": len(THOUGHT)}  # fmt: skip
    assert_pool_whole(server)


def test_the_thinking_tokens_are_counted_through_the_last_analysis_message():
    tokens = [
        *THOUGHT,
        *THOUGHT[:3],
        "x",
        "<|end|>",
        "<|start|>",
        "assistant",
        "<|channel|>",
        "final",
        "<|message|>",
        "y",
    ]

    def decode(ids: list[int]) -> str:
        return "".join(tokens[i] for i in ids)

    ids = list(range(len(tokens)))
    assert reasoning_tokens(HARMONY, "inside", ids, decode) == len(THOUGHT) + 5
    assert reasoning_tokens(HARMONY, "inside", ids[:4], decode) == 4  # cut off inside: all of it
    assert reasoning_tokens(HARMONY, "after", ids, decode) == 0
