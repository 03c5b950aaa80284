"""Reasoning models (issue 28.1): `--reasoning-parser qwen3 | deepseek_r1` returns the `<think>` section as
`reasoning_content` (whole and in stream deltas that add up to it), counts its tokens in
`completion_tokens_details.reasoning_tokens`, passes `chat_template_kwargs` to the template (`enable_thinking`),
and holds a structured output or a tool choice to the answer after the thinking, the thinking itself free.

The default model never thinks unasked, so a test hook writes the thinking for it: `forced` raises, for every
request, the logit of the script's token at each output position before the constraint's mask is applied. A
mask that forbids a scripted token wins (-inf), so a constraint applied from the first token (the old engine)
yields no thinking at all, and the model's own greedy choice follows the script.
"""

from __future__ import annotations

import contextlib
import json

import jsonschema
import pytest
from engine_helpers import kv_budget
from server_helpers import assert_as_declared, assert_error, assert_pool_whole, running_server, sse_events

from pagedllm.server.reasoning import REASONING_PARSERS, ReasoningParser

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

THINKING = "\nThey want a person.\n"
SCRIPT = f"<think>{THINKING}</think>"  # 13 tokens of the default model's vocabulary
# SmolLM2's template, with Qwen3's switch: enable_thinking false writes an empty, closed thinking section.
THINK_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and not enable_thinking %}{{ '<think>\n\n</think>\n\n' }}{% endif %}"
    "{% endif %}"
)
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
SCHEMA = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}


@pytest.fixture(scope="module")
def server(model_fp32):
    from pagedllm.engine import EngineConfig, LLMEngine
    from pagedllm.engine.async_engine import AsyncLLMEngine

    config = EngineConfig(  # prompt-lookup drafts on: none while the grammar waits, checked by it after
        dtype="float32",
        max_model_len=512,
        kv_cache_memory=kv_budget(64),
        max_num_seqs=8,
        log_stats_interval=0,
        speculative_config=SPEC,
    )
    engine = AsyncLLMEngine(LLMEngine(config, loaded=model_fp32))
    with running_server(engine, served_model_name=["m"], reasoning_parser="qwen3") as s:
        yield s


@contextlib.contextmanager
def forced(s, script: str = SCRIPT):
    """Every request's first tokens are the script's, unless its constraint's mask forbids them."""
    ids = s.engine.tokenizer.encode(script)
    grammars = s.engine.engine.grammars
    real = grammars.constrain

    def constrain(to_sample, logits):
        row = 0
        for req, lg in to_sample:
            for j in range(len(lg)):  # a row per position (the drafts' too)
                pos = req.num_output_tokens + j
                if pos < len(ids):
                    logits[row + j, ids[pos]] += 1e4
            row += len(lg)
        return real(to_sample, logits)

    grammars.constrain = constrain
    try:
        yield len(ids)
    finally:
        del grammars.constrain


@pytest.fixture
def template(server, monkeypatch):
    monkeypatch.setattr(server.engine.tokenizer.hf, "chat_template", THINK_TEMPLATE)


def chat(s, **body):
    body = {"messages": [{"role": "user", "content": "Invent a person."}], "temperature": 0, **body}
    r = s.http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def stream_chat(s, **body) -> tuple[str, str, str | None, dict]:
    """(reasoning, content, finish_reason, usage) joined from a stream's deltas."""
    body = {"messages": [{"role": "user", "content": "Invent a person."}], "temperature": 0, **body}
    body.update(stream=True, stream_options={"include_usage": True})
    with s.http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        events = [e for e in sse_events(r.iter_lines()) if e != "[DONE]"]
    deltas = [c["delta"] for e in events for c in e["choices"]]
    finish = next(c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"])
    reasoning = "".join(d.get("reasoning_content") or "" for d in deltas)
    content = "".join(d.get("content") or "" for d in deltas)
    assert all(d for d in deltas[1:-1]), deltas  # no empty delta but the last
    return reasoning, content, finish, events[-1]["usage"]


def test_thinking_is_reasoning_content_and_the_rest_is_content_whole_and_streamed(server, template):
    with forced(server) as n_script:
        whole = chat(server, max_tokens=24)
        reasoning, content, finish, usage = stream_chat(server, max_tokens=24)
    message = whole["choices"][0]["message"]
    assert message["reasoning_content"] == THINKING, message
    assert message["content"] and "<think>" not in message["content"] and "</think>" not in message["content"]
    assert (reasoning, content, finish) == (THINKING, message["content"], whole["choices"][0]["finish_reason"])
    assert whole["usage"]["completion_tokens_details"] == {"reasoning_tokens": n_script}
    assert usage["completion_tokens_details"] == {"reasoning_tokens": n_script}
    assert whole["usage"]["completion_tokens"] > n_script
    assert_pool_whole(server)


@pytest.mark.parametrize(
    "constraint",
    [
        {"response_format": SCHEMA},
        {"structured_outputs": {"json": PERSON}},
        {
            "tools": [{"type": "function", "function": {"name": "make_person", "parameters": PERSON}}],
            "tool_choice": "required",
            "parallel_tool_calls": False,
        },
    ],
    ids=["response_format", "structured_outputs", "tool_choice required"],
)
def test_a_constraint_holds_the_answer_after_the_thinking_and_not_the_thinking(server, template, constraint):
    """The thinking is free text (no JSON), and the answer after </think> follows the schema: on the old
    engine the mask held the first token already, so no thinking could be written."""
    with forced(server):
        whole = chat(server, max_tokens=96, **constraint)
        reasoning, content, finish, _ = stream_chat(server, max_tokens=96, **constraint)
    choice = whole["choices"][0]
    assert choice["message"]["reasoning_content"] == reasoning == THINKING, choice
    if "tools" in constraint:
        (call,) = choice["message"]["tool_calls"]
        assert choice["finish_reason"] == finish == "tool_calls"
        jsonschema.validate(json.loads(call["function"]["arguments"]), PERSON)
    else:
        assert choice["finish_reason"] == finish == "stop", choice
        assert content == choice["message"]["content"]
        jsonschema.validate(json.loads(choice["message"]["content"]), PERSON)
    assert_pool_whole(server)


def test_enable_thinking_false_reaches_the_template_and_constrains_from_the_first_token(server, template):
    """chat_template_kwargs go to the template: its closed empty thinking is in the prompt, so the answer is all
    content, no token is reasoning, and a schema holds from the first token (the script is masked away)."""
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    with forced(server):
        thinking = chat(server, max_tokens=4)
        plain = chat(server, max_tokens=48, response_format=SCHEMA, **off)
    assert plain["usage"]["prompt_tokens"] > thinking["usage"]["prompt_tokens"]  # the template wrote the section
    message = plain["choices"][0]["message"]
    assert message["reasoning_content"] is None and plain["usage"]["completion_tokens_details"]["reasoning_tokens"] == 0
    jsonschema.validate(json.loads(message["content"]), PERSON)


def test_a_thinking_cut_by_max_tokens_is_all_reasoning_whole_and_streamed(server, template):
    with forced(server):
        whole = chat(server, max_tokens=6)
        reasoning, content, finish, usage = stream_chat(server, max_tokens=6)
    message = whole["choices"][0]["message"]
    assert whole["choices"][0]["finish_reason"] == finish == "length"
    assert message["content"] is None and content == ""
    assert message["reasoning_content"] == reasoning and THINKING.startswith(reasoning) and reasoning
    assert whole["usage"]["completion_tokens_details"]["reasoning_tokens"] == 6 == usage["completion_tokens"]


@pytest.mark.parametrize("kwargs", [{"messages": 1}, {"tokenize": True}, {"not a name": 1}])
def test_chat_template_kwargs_that_the_server_sets_itself_are_refused_by_name(server, kwargs):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "chat_template_kwargs": kwargs}
    assert_error(server.http.post("/v1/chat/completions", json=body), 400, "chat_template_kwargs")
    assert_pool_whole(server)


# ------------------------------------------------------------------------------------- the parsers alone
CASES = [
    ("qwen3", "before", "<think>abc</think>xyz", ("abc", "xyz")),
    ("qwen3", "before", "no thinking here", (None, "no thinking here")),
    ("qwen3", "before", "<think>cut off", ("cut off", "")),
    ("qwen3", "before", "pre <think>a</think>b", ("a", "pre b")),
    ("qwen3", "inside", "abc</think>xyz", ("abc", "xyz")),  # the template opened it (Qwen3-Thinking)
    ("qwen3", "after", "<think>x</think>y", (None, "<think>x</think>y")),  # enable_thinking false: all content
    ("deepseek_r1", "inside", "abc</think>xyz", ("abc", "xyz")),
    ("deepseek_r1", "inside", "still thinking", ("still thinking", "")),
]


@pytest.mark.parametrize("name,state,text,expected", CASES)
def test_reasoning_parsers_split_an_answer_and_its_stream_adds_up_to_it(name, state, text, expected):
    fmt = REASONING_PARSERS[name]
    assert ReasoningParser(fmt, state).extract(text) == expected
    streamed = ReasoningParser(fmt, state)
    reasoning, content = "", ""
    for end in range(1, len(text) + 1):  # a character at a time: tags arrive in pieces
        new, content_now = streamed.extract_streaming(text[:end], end == len(text))
        assert content_now.startswith(content), (content_now, content)  # content only grows
        reasoning, content = reasoning + new, content_now
    assert (reasoning or None, content) == (expected[0] if expected[0] else None, expected[1])


@pytest.mark.parametrize(
    "prompt,state",
    [
        ("<|im_start|>assistant\n", "before"),
        ("<|im_start|>assistant\n<think>\n", "inside"),
        ("<|im_start|>assistant\n<think>\n\n</think>\n\n", "after"),
        ("<think>old</think>answer<|im_end|><|im_start|>assistant\n", "before"),
    ],
)
def test_where_an_answer_starts_is_read_from_the_prompt(prompt, state):
    assert REASONING_PARSERS["qwen3"].initial_state(prompt) == state
    assert REASONING_PARSERS["deepseek_r1"].initial_state(prompt) == ("inside" if state == "before" else state)


def test_reasoning_answers_are_what_openapi_declares(server, template):
    """reasoning_content and completion_tokens_details are declared fields, whole and in every stream chunk."""
    spec = server.http.get("/openapi.json").json()
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 16, "temperature": 0}
    with forced(server):
        r = server.http.post("/v1/chat/completions", json=body)
        assert "reasoning_tokens" in r.text
        assert_as_declared(spec, "/v1/chat/completions", "post", r)
        stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
        with server.http.stream("POST", "/v1/chat/completions", json=stream) as sr:
            events = sse_events(sr.iter_lines())
        assert any("reasoning_content" in c["delta"] for e in events[:-1] for c in e["choices"])
        assert_as_declared(spec, "/v1/chat/completions", "post", sr, events)


@pytest.mark.parametrize("parser,state", [("qwen3", "before"), ("deepseek_r1", "inside")])
def test_auto_tool_calls_are_parsed_from_the_content_after_the_thinking(parser, state):
    """With a reasoning parser and tool_choice "auto", the tool parser reads only the content: a <tool_call> in
    the thinking is thinking, the one after it a call; streamed a character at a time, the deltas add up to the
    whole message."""
    from types import SimpleNamespace

    from pagedllm.engine.outputs import CompletionOutput
    from pagedllm.server.serving_chat import _message, _StreamedChoice
    from pagedllm.server.tools import ToolMode

    ctx = SimpleNamespace(
        engine=SimpleNamespace(tokenizer=SimpleNamespace(chat_template=None)), tool_call_parser="hermes"
    )
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    text = ("<think>" if state == "before" else "") + f"maybe {call}?</think>Adding.{call}"
    fmt, mode = REASONING_PARSERS[parser], ToolMode("auto")
    message, finish = _message(ctx, mode, CompletionOutput(0, text, [1], "stop"), ReasoningParser(fmt, state))
    assert message.reasoning_content == f"maybe {call}?" and message.content == "Adding.", message
    ((got),) = message.tool_calls
    assert (got.function.name, got.function.arguments, finish) == ("add", '{"a": 1}', "tool_calls")
    streamed = _StreamedChoice(ctx, mode, ReasoningParser(fmt, state))
    reasoning, content, args = "", "", ""
    for end in range(1, len(text) + 1):
        delta = streamed.delta(text[:end], end == len(text))
        reasoning += delta.reasoning_content or ""
        content += delta.content or ""
        args += "".join(t.function.arguments for t in delta.tool_calls or [])
    assert (reasoning, content, args) == (message.reasoning_content, message.content, got.function.arguments)
