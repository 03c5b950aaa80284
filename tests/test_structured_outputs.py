"""Structured outputs and tool calls (issue 21): every constraint the API takes holds the answer to it, on a real
server over the default model with prompt-lookup speculation on and a tiny KV budget (so requests preempt), and
every bad schema, regex or grammar is a 400 naming its field, with no block left behind.

One server for the module (float32, 24 KV blocks); few tokens per request.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import Future

import jsonschema
import openai
import pydantic
import pytest
from engine_helpers import kv_budget
from server_helpers import KEY, assert_error, assert_pool_whole, running_server, sse_events

from pagedllm.server.tool_parsers import HermesToolParser, RequiredToolParser, ToolParser, tool_parser
from pagedllm.server.tools import ToolMode, tool_schema

AUTO = ToolMode("auto")


class ToolCallStream:
    """A streamed choice's parser, its deltas as the JSON the chunks carry."""

    def __init__(self, mode: ToolMode) -> None:
        self.parser: ToolParser = tool_parser(mode)

    def delta(self, text: str, done: bool) -> dict:
        return self.parser.extract_streaming(text, done).body()


def parse_calls(text: str, mode: ToolMode) -> tuple[str | None, list[dict]]:
    got = tool_parser(mode).extract(text)
    return got.content, [c.body() for c in got.tool_calls]


def scan_hermes(text: str, done: bool):
    return HermesToolParser(AUTO).scan(text, done)


pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
ENGINE_ARGS = dict(dtype="float32", max_model_len=512, max_num_seqs=8, max_num_batched_tokens=256, log_stats_interval=0)
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "city": {"type": "string", "enum": ["Paris", "Seoul", "Lima"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "city", "age"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 10},
                    "unit": {"type": "string", "enum": ["c", "f"]},
                },
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two numbers",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "minimum": 0, "maximum": 999},
                    "b": {"type": "integer", "minimum": 0, "maximum": 999},
                },
                "required": ["a", "b"],
                "additionalProperties": False,
            },
        },
    },
]
TOOL_PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def server(model_fp32):
    from pagedllm.engine import EngineConfig, LLMEngine
    from pagedllm.engine.async_engine import AsyncLLMEngine

    engine = AsyncLLMEngine(
        LLMEngine(
            EngineConfig(kv_cache_memory=kv_budget(24), speculative_config=SPEC, **ENGINE_ARGS), loaded=model_fp32
        )
    )
    with running_server(engine, served_model_name=["m"]) as s:
        yield s


def chat(s, content: str, **body):
    r = s.http.post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": content}], "max_tokens": 48, **body}
    )
    assert r.status_code == 200, r.text
    return r.json()


def test_json_schema_holds_every_sample_and_logprobs_come_from_the_constrained_distribution(server):
    body = chat(
        server,
        "Describe a person who lives in Seoul as JSON.",
        n=3,
        temperature=1.0,
        seed=7,
        logprobs=True,
        top_logprobs=5,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
    )
    assert len(body["choices"]) == 3
    for choice in body["choices"]:
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["message"]["content"]), PERSON)
        first = choice["logprobs"]["content"][0]
        # the grammar allows only '{' first: every alternative the model could have taken starts the object
        assert first["token"].startswith("{")
        assert all(t["token"].startswith("{") for t in first["top_logprobs"] if t["logprob"] > -9999)
    assert_pool_whole(server)


def test_regex_choice_and_grammar_on_both_endpoints_and_all_names(server):
    cases = [
        ({"structured_outputs": {"regex": r"[0-9]{3}-[0-9]{4}"}}, lambda t: re.fullmatch(r"[0-9]{3}-[0-9]{4}", t)),
        ({"guided_regex": r"(yes|no), [a-z]{2,8}\."}, lambda t: re.fullmatch(r"(yes|no), [a-z]{2,8}\.", t)),
        ({"structured_outputs": {"choice": ["positive", "negative"]}}, lambda t: t in ("positive", "negative")),
        ({"guided_choice": ["red", "green", "blue"]}, lambda t: t in ("red", "green", "blue")),
        (
            {"structured_outputs": {"grammar": 'start: "The answer is " NUM "."\nNUM: /[0-9]{1,3}/'}},
            lambda t: re.fullmatch(r"The answer is [0-9]{1,3}\.", t),
        ),
        ({"guided_grammar": 'root ::= "A" | "B" | "C"'}, lambda t: t in ("A", "B", "C")),  # GBNF, as llama.cpp
    ]
    for extra, holds in cases:
        for path, body in (
            ("/v1/completions", {"prompt": "The phone number of the office is", "max_tokens": 24}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Answer briefly."}], "max_tokens": 24}),
        ):
            r = server.http.post(path, json={**body, **extra, "temperature": 0.8, "seed": 3})
            assert r.status_code == 200, (extra, r.text)
            choice = r.json()["choices"][0]
            text = choice["text"] if "text" in choice else choice["message"]["content"]
            assert choice["finish_reason"] == "stop" and holds(text), (extra, path, text)
    assert_pool_whole(server)


def test_json_object_and_stop_strings(server):
    body = chat(server, "Give me a tiny JSON object.", response_format={"type": "json_object"}, n=4, seed=2)
    done = [c["message"]["content"] for c in body["choices"] if c["finish_reason"] == "stop"]
    assert done and all(isinstance(json.loads(text), dict) for text in done), body
    assert all(c["message"]["content"].startswith("{") for c in body["choices"])
    cut = chat(
        server,
        "Describe a person in Lima as JSON.",
        stop=['"city"'],
        temperature=0,
        structured_outputs={"json": PERSON},
    )["choices"][0]
    assert cut["finish_reason"] == "stop" and cut["stop_reason"] == '"city"'
    assert cut["message"]["content"].startswith("{") and '"city"' not in cut["message"]["content"]


def test_eos_is_allowed_only_where_the_grammar_may_end(server):
    """EOS pushed to +100 would end any answer at once; under the schema it can only close a complete object."""
    eos = server.engine.tokenizer.eos_token_id
    body = chat(server, "A person as JSON.", temperature=0, logit_bias={str(eos): 100}, guided_json=PERSON)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    jsonschema.validate(json.loads(choice["message"]["content"]), PERSON)
    free = chat(server, "A person as JSON.", temperature=0, logit_bias={str(eos): 100})["choices"][0]
    assert free["message"]["content"] == "" and free["finish_reason"] == "stop"  # the bias works without it


def test_a_grammar_that_cannot_end_within_max_tokens_finishes_with_length(server):
    r = server.http.post(
        "/v1/completions", json={"prompt": "a", "max_tokens": 5, "structured_outputs": {"regex": "x{40}"}}
    )
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length" and re.fullmatch("x+", choice["text"]), choice
    assert_pool_whole(server)


def test_tool_choice_required_with_two_functions(server):
    body = chat(
        server,
        "What is the weather in Paris in celsius?",
        tools=TOOLS,
        tool_choice="required",
        n=2,
        temperature=0.7,
        seed=1,
    )
    for choice in body["choices"]:
        msg = choice["message"]
        assert choice["finish_reason"] == "tool_calls" and msg["content"] is None and msg["tool_calls"], choice
        for call in msg["tool_calls"]:
            assert call["type"] == "function" and call["id"].startswith("call_")
            jsonschema.validate(json.loads(call["function"]["arguments"]), TOOL_PARAMS[call["function"]["name"]])
    one = chat(
        server,
        "Add 1 and 2, then add 3 and 4.",
        tools=TOOLS,
        tool_choice="required",
        temperature=0,
        parallel_tool_calls=False,
    )["choices"][0]
    assert one["finish_reason"] == "tool_calls" and len(one["message"]["tool_calls"]) == 1, one


def test_named_tool_choice_returns_that_function(server):
    body = chat(
        server,
        "Add 2 and 3.",
        tools=TOOLS,
        temperature=0,
        tool_choice={"type": "function", "function": {"name": "add"}},
    )
    choice = body["choices"][0]
    (call,) = choice["message"]["tool_calls"]
    assert choice["finish_reason"] == "stop" and call["function"]["name"] == "add"
    jsonschema.validate(json.loads(call["function"]["arguments"]), TOOL_PARAMS["add"])


def test_tool_choice_auto_is_refused_for_a_template_without_tools(server):
    for body in ({"tools": TOOLS, "tool_choice": "auto"}, {"tools": TOOLS}):
        r = server.http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], **body})
        assert_error(r, 400, "tool_choice", ["chat template"])
    assert_pool_whole(server)


HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nYou may call these tools: {{ tools | tojson }}. Answer with "
    '<tool_call>{"name": ..., "arguments": ...}</tool_call>.<|im_end|>\n{% endif %}'
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_tool_choice_auto_is_served_for_a_template_that_shows_hermes_tools(server, monkeypatch):
    """With a template that renders the tools and asks for <tool_call> blocks, "auto" is taken: the model sees
    the tools (the prompt grows by their text) and its answer is parsed, unconstrained, for calls."""
    monkeypatch.setattr(server.engine.tokenizer.hf, "chat_template", HERMES_TEMPLATE)
    msgs = [{"role": "user", "content": "Weather in Oslo?"}]
    plain = chat(server, "Weather in Oslo?", max_tokens=4, temperature=0)
    auto = server.http.post(
        "/v1/chat/completions", json={"messages": msgs, "tools": TOOLS, "max_tokens": 4, "temperature": 0}
    )
    assert auto.status_code == 200, auto.text
    assert auto.json()["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"] + 50  # the tools are in it
    assert auto.json()["choices"][0]["message"]["tool_calls"] == []  # 4 tokens: no call, content as is


HERMES_ANSWER = (  # forces a Hermes answer from the 135M model, which never writes one unasked
    r'I will add them\.\n<tool_call>\n\{"name": "add", "arguments": '
    r'\{"a": [0-9]{1,2}, "b": [0-9]{1,2}\}\}\n</tool_call>'
)


def test_tool_choice_auto_streams_content_then_calls_in_pieces_and_adds_up_to_the_whole_answer(server, monkeypatch):
    """Streamed "auto": the text before <tool_call> as content first, then the call's header and its
    arguments in pieces as they are generated; joined, exactly the non-streamed answer."""
    monkeypatch.setattr(server.engine.tokenizer.hf, "chat_template", HERMES_TEMPLATE)
    body = {
        "messages": [{"role": "user", "content": "Add 12 and 34."}],
        "tools": TOOLS,
        "max_tokens": 64,
        "temperature": 0,
        "structured_outputs": {"regex": HERMES_ANSWER},
    }
    whole = server.http.post("/v1/chat/completions", json=body).json()["choices"][0]
    with server.http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        events = [e for e in sse_events(r.iter_lines()) if e != "[DONE]"]
    deltas = [c["delta"] for e in events for c in e["choices"]]
    kinds = [k for d in deltas for k in ("content", "tool_calls") if d.get(k)]
    assert kinds.index("tool_calls") > 0 and "content" not in kinds[kinds.index("tool_calls") :], kinds
    calls, finish = _accumulate(events)
    pieces = [t for d in deltas for t in d.get("tool_calls", []) if t["function"]["arguments"]]
    assert len(pieces) > 1, deltas  # the arguments came as they grew, not at the end
    assert whole["finish_reason"] == finish == "tool_calls", (whole, events)
    assert "".join(d.get("content") or "" for d in deltas) == whole["message"]["content"] == "I will add them."
    (call,) = whole["message"]["tool_calls"]
    assert calls == {0: {"name": "add", "arguments": call["function"]["arguments"]}}
    jsonschema.validate(json.loads(call["function"]["arguments"]), TOOL_PARAMS["add"])
    assert_pool_whole(server)


def _accumulate(events) -> tuple[dict[int, dict], str | None]:
    calls: dict[int, dict] = {}
    finish = None
    for ev in events:
        if ev == "[DONE]":
            continue
        for choice in ev["choices"]:
            finish = choice.get("finish_reason") or finish
            for d in choice["delta"].get("tool_calls", []):
                if "id" in d:  # a call's first delta: OpenAI's shape
                    assert d["index"] not in calls and d["type"] == "function" and d["function"]["arguments"] == ""
                    calls[d["index"]] = {"name": d["function"]["name"], "arguments": ""}
                calls[d["index"]]["arguments"] += d["function"]["arguments"]
    return calls, finish


def test_streamed_tool_calls_have_openai_shape_and_match_the_schema(server):
    for choice, finish in (
        ("required", "tool_calls"),
        ({"type": "function", "function": {"name": "get_weather"}}, "stop"),
    ):
        with server.http.stream(
            "POST",
            "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": "Weather in Seoul?"}],
                "tools": TOOLS,
                "tool_choice": choice,
                "max_tokens": 48,
                "temperature": 0,
                "stream": True,
            },
        ) as r:
            assert r.status_code == 200
            events = sse_events(r.iter_lines())
        calls, got_finish = _accumulate(events)
        argument_deltas = sum(
            1
            for ev in events
            if ev != "[DONE]"
            for c in ev["choices"]
            for d in c["delta"].get("tool_calls", [])
            if d["function"]["arguments"]
        )
        assert got_finish == finish and calls and argument_deltas > 1, events  # the arguments came in pieces
        for call in calls.values():
            jsonschema.validate(json.loads(call["arguments"]), TOOL_PARAMS[call["name"]])
    assert_pool_whole(server)


def _streamed_message(events) -> tuple[dict, str | None, str | int | None]:
    """What a client adds the chunks of one choice up to (role, content, calls), its finish and stop reasons;
    asserting OpenAI's shape on the way: every chunk but the last says something, only the last finishes."""
    chunks = [c for ev in events if ev != "[DONE]" for c in ev["choices"]]
    assert events[-1] == "[DONE]" and chunks, events
    message: dict = {"role": None, "content": None, "tool_calls": [], "logprobs": []}
    for i, choice in enumerate(chunks):
        last, delta = i == len(chunks) - 1, choice["delta"]
        message["logprobs"] += [t["token"] for t in (choice["logprobs"] or {}).get("content", [])]
        assert (choice["finish_reason"] is not None) == last, chunks
        assert delta or last, f"an empty delta mid-stream: {chunks}"
        message["role"] = delta.get("role", message["role"])
        if delta.get("content") is not None:
            message["content"] = (message["content"] or "") + delta["content"]
        for d in delta.get("tool_calls", []):
            if "id" in d:
                assert d["index"] == len(message["tool_calls"]) and d["type"] == "function", chunks
                message["tool_calls"].append({"name": d["function"]["name"], "arguments": ""})
            message["tool_calls"][d["index"]]["arguments"] += d["function"]["arguments"]
    return message, chunks[-1]["finish_reason"], chunks[-1]["stop_reason"]


NAMED_WEATHER = {"type": "function", "function": {"name": "get_weather"}}
SAME_EITHER_WAY = [  # (tools and constraint, max_tokens): cut before a call's name, inside it, in its arguments, whole
    *[({"tools": TOOLS, "tool_choice": "required"}, n) for n in (3, 6, 12, 48)],
    *[({"tools": TOOLS, "tool_choice": NAMED_WEATHER}, n) for n in (2, 5, 48)],
    *[({"tools": TOOLS, "structured_outputs": {"regex": HERMES_ANSWER}}, n) for n in (3, 12, 18, 24, 64)],
    ({"guided_json": PERSON}, 4),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}}, 40),
]


@pytest.mark.parametrize("extra, max_tokens", SAME_EITHER_WAY)
def test_tool_calls_and_structured_outputs_end_the_same_way_streamed_or_not(server, monkeypatch, extra, max_tokens):
    """One greedy answer, streamed and not, cut by max_tokens anywhere: the same message (content, calls with
    their arguments as generated), the same finish reason and logprobs; a call cut by `length` is a call in
    both, finishing with "length" (OpenAI's way); no empty delta but the last chunk's."""
    monkeypatch.setattr(server.engine.tokenizer.hf, "chat_template", HERMES_TEMPLATE)  # "auto" is served
    body = {
        "messages": [{"role": "user", "content": "Add 12 and 34."}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "logprobs": True,
    }
    whole = server.http.post("/v1/chat/completions", json={**body, **extra})
    assert whole.status_code == 200, whole.text
    choice = whole.json()["choices"][0]
    with server.http.stream("POST", "/v1/chat/completions", json={**body, **extra, "stream": True}) as r:
        assert r.status_code == 200
        streamed, finish, stop_reason = _streamed_message(sse_events(r.iter_lines()))
    msg = choice["message"]
    calls = [c["function"] for c in msg["tool_calls"]]
    tokens = [t["token"] for t in choice["logprobs"]["content"]]
    assert streamed.pop("logprobs") == tokens  # a held-back piece's logprobs go with the next chunk
    assert streamed == {"role": "assistant", "content": msg["content"], "tool_calls": calls}, (streamed, msg)
    assert (finish, stop_reason) == (choice["finish_reason"], choice["stop_reason"])
    tool_mode = extra.get("tool_choice")
    if tool_mode is not None:  # the answer is calls only
        assert msg["content"] is None, msg
    if choice["finish_reason"] == "length" and tool_mode is not None and max_tokens > 5:
        assert calls, msg  # cut in its arguments: the call as far as it went
    if choice["finish_reason"] != "length" and tool_mode is not None:
        for call in calls:
            jsonschema.validate(json.loads(call["arguments"]), TOOL_PARAMS[call["name"]])
    assert_pool_whole(server)


def test_preemption_under_a_tiny_kv_budget_keeps_every_answer_valid(server):
    before = server.engine.engine.stats().num_preemptions
    prompts = [
        f"Person number {i} lives in {c}. Write their record as JSON with a short name. " * 3
        for i, c in enumerate(["Paris", "Seoul", "Lima", "Paris", "Seoul", "Lima"])
    ]
    r = server.http.post(
        "/v1/completions",
        json={"prompt": prompts, "max_tokens": 40, "temperature": 0.9, "seed": 5, "guided_json": PERSON},
    )
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["text"]), PERSON)
    assert server.engine.engine.stats().num_preemptions > before
    assert_pool_whole(server)


BAD = [
    (
        "json schema of a bad type",
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
        "response_format",
        "objekt",
    ),
    ("unclosed regex", {"guided_regex": "[a-"}, "guided_regex", "regex"),
    ("lark rule undefined", {"structured_outputs": {"grammar": "start: foo"}}, "structured_outputs", "foo"),
    (
        "look-behind in a schema pattern",
        {"guided_json": {"type": "string", "pattern": "(?<=a)b"}},
        "guided_json",
        "look-around",
    ),
    ("schema that is not JSON", {"guided_json": "{not json"}, "guided_json", "JSON"),
    ("empty choice", {"guided_choice": []}, "guided_choice", "non-empty"),
    ("two constraints", {"guided_regex": "a", "structured_outputs": {"regex": "b"}}, "guided_regex", "only one"),
    (
        "two kinds in structured_outputs",
        {"structured_outputs": {"regex": "a", "choice": ["b"]}},
        "structured_outputs",
        "exactly one",
    ),
    (
        "tool parameters that do not compile",
        {
            "tools": [
                {
                    "type": "function",
                    "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "nope"}}}},
                }
            ],
            "tool_choice": "required",
        },
        "tools",
        "nope",
    ),
    (
        "named function not in tools",
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice",
        "nope",
    ),
    ("required without tools", {"tool_choice": "required"}, "tool_choice", "needs tools"),
    ("structural tag", {"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs", "structural_tag"),
]


@pytest.mark.parametrize("extra,param,word", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_constraints_are_400s_naming_the_field_and_leak_nothing(server, extra, param, word):
    for stream in (False, True):
        r = server.http.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": stream, **extra},
        )
        assert_error(r, 400, param, [word])
    assert_pool_whole(server)


UNWRITABLE = "\u00fb\U0009cd72"  # SmolLM2's byte-level vocabulary has no token for byte 0xF2, this one's first


def test_a_grammar_the_vocabulary_cannot_write_is_a_400_not_a_500(server):
    """Found by schemathesis: llguidance's mask allows a token its matcher then refuses when the grammar forces
    a byte no token holds; the request asked for output the model cannot write, so it is the client's error."""
    body = {"prompt": "x", "max_tokens": 8, "guided_regex": UNWRITABLE}
    assert_error(server.http.post("/v1/completions", json=body), 400, "guided_regex", ["vocabulary"])
    with server.http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        events = sse_events(r.iter_lines())
    errors = [e["error"] for e in events if isinstance(e, dict) and "error" in e]
    assert len(errors) == 1 and errors[0]["code"] == 400 and "vocabulary" in errors[0]["message"], events
    assert_pool_whole(server)


NODE = {  # every node needs a child: llguidance takes it, then gives up mid-way (its parser's item limit)
    "$ref": "#/$defs/node",
    "$defs": {
        "node": {
            "type": "object",
            "properties": {"child": {"$ref": "#/$defs/node"}},
            "required": ["child"],
            "additionalProperties": False,
        }
    },
}
NODE_TOOL = [{"type": "function", "function": {"name": "walk", "parameters": NODE}}]
CHOICES = [f"option number {i}" for i in range(10_000)]
REFUSED_MID_WAY = [  # (fields sent, the field the error names, the endpoints that take them)
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": NODE}}}, "response_format"),
    ({"structured_outputs": {"json": NODE}}, "structured_outputs"),
    ({"guided_json": NODE}, "guided_json"),
    ({"guided_regex": "a{1000000}"}, "guided_regex"),
    ({"structured_outputs": {"regex": "a{1000000}"}}, "structured_outputs"),
    ({"structured_outputs": {"choice": CHOICES}}, "structured_outputs"),
    ({"guided_choice": CHOICES}, "guided_choice"),
    ({"tools": NODE_TOOL, "tool_choice": "required"}, "tools"),
    ({"tools": NODE_TOOL, "tool_choice": {"type": "function", "function": {"name": "walk"}}}, "tools"),
]


@pytest.mark.parametrize("extra, param", REFUSED_MID_WAY, ids=[p for _, p in REFUSED_MID_WAY])
def test_a_grammar_refused_while_decoding_is_a_400_naming_the_field_it_came_from(server, extra, param):
    """A constraint that compiles but that llguidance cannot follow past some token fails after the request was
    admitted: the 400 (and a stream's error event) names the field the client sent, as a compile error does."""
    paths = [("/v1/chat/completions", {"messages": [{"role": "user", "content": "Go."}]})]
    if "tools" not in extra:
        paths.append(("/v1/completions", {"prompt": "Go."}))
    for path, body in paths:
        body = {**body, "max_tokens": 200, "temperature": 0, **extra}
        assert_error(server.http.post(path, json=body), 400, param, ["cannot be written"])
        with server.http.stream("POST", path, json={**body, "stream": True}) as r:
            assert r.status_code == 200
            events = sse_events(r.iter_lines())
        errors = [e["error"] for e in events if isinstance(e, dict) and "error" in e]
        assert len(errors) == 1 and errors[0]["code"] == 400 and errors[0]["param"] == param, events
        assert "cannot be written" in errors[0]["message"], errors
        assert events[-1] == "[DONE]"
    assert_pool_whole(server)


def test_aborted_constrained_stream_gives_its_blocks_back(server):
    with server.http.stream(
        "POST",
        "/v1/completions",
        json={"prompt": "JSON:", "max_tokens": 200, "stream": True, "guided_json": {"type": "array"}},
    ) as r:
        assert r.status_code == 200
        next(r.iter_lines())
    assert_pool_whole(server)


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=12)
    age: int = pydantic.Field(ge=0, le=120)


def test_openai_client_parse_with_a_pydantic_model(server):
    client = openai.OpenAI(base_url=server.base + "/v1", api_key=KEY, max_retries=0, timeout=120)
    completion = client.chat.completions.parse(
        model="m",
        messages=[{"role": "user", "content": "Invent a person and give their name and age."}],
        response_format=Person,
        max_tokens=40,
        temperature=0,
    )
    person = completion.choices[0].message.parsed
    assert isinstance(person, Person) and 0 <= person.age <= 120


# ------------------------------------------------------------------------------------------ in the engine
@pytest.fixture(scope="module")
def engines(model_fp32):
    from pagedllm.engine import EngineConfig, LLMEngine

    return {
        spec: LLMEngine(EngineConfig(speculative_config=SPEC if spec else None, **ENGINE_ARGS), loaded=model_fp32)
        for spec in (False, True)
    }


def _run(engine, rid: str, prompt: str, params) -> list:
    engine.add_request(rid, prompt, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                return out.outputs
    raise AssertionError("no output")


def test_speculation_cuts_drafts_to_the_grammar_and_changes_no_token(engines):
    """A prompt that shows the answer's JSON makes prompt lookup draft it: drafts are verified, and the greedy
    constrained answer is token for token the one without speculation."""
    from pagedllm import SamplingParams, StructuredOutputsParams

    prompt = (
        'Copy this JSON exactly: {"name":"Ann","city":"Lima","age":31} and again: '
        '{"name":"Ann","city":"Lima","age":31}. Now the JSON:'
    )
    params = SamplingParams(temperature=0, max_tokens=32, structured_outputs=StructuredOutputsParams(json=PERSON))
    plain = _run(engines[False], "a", prompt, params)[0]
    spec_engine = engines[True]
    spec = _run(spec_engine, "b", prompt, params)[0]
    assert spec.token_ids == plain.token_ids
    jsonschema.validate(json.loads(spec.text), PERSON)
    assert spec_engine.spec_stats.num_accepted_tokens > 0


def test_a_request_waits_until_its_grammar_is_compiled(engines, monkeypatch):
    from pagedllm import SamplingParams, StructuredOutputsParams

    engine = engines[False]
    compiled = engine.grammars.compile(StructuredOutputsParams(choice=["yes", "no"]).grammar_text).result()
    pending: Future = Future()
    monkeypatch.setattr(engine.grammars, "compile", lambda _: pending)
    engine.add_request(
        "w", "Yes or no?", SamplingParams(temperature=0, max_tokens=4, structured_outputs={"choice": ["yes", "no"]})
    )
    engine.step()
    (req,) = [r for r in engine.requests.values() if r.parent_id == "w"]
    assert req.num_computed_tokens == 0 and req in engine.scheduler.waiting
    pending.set_result(compiled)
    while engine.has_unfinished_requests():
        outs = engine.step()
    assert outs[0].outputs[0].text in ("yes", "no")


def test_python_api_refuses_a_bad_schema_before_queueing(engines):
    from pagedllm import SamplingParams
    from pagedllm.sampling_params import SamplingParamsError

    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(structured_outputs={"json": {"type": "objekt"}})
    assert e.value.param == "structured_outputs.json"


# ------------------------------------------------------------------------------------------ parsers, no model
def test_streamed_array_of_calls_is_scanned_as_it_grows():
    full = '[{"name":"get_weather","parameters":{"city":"Pa}r\\"is","unit":"c"}},{"name":"add","parameters":{"a":1}}]'
    stream, got = ToolCallStream(ToolMode("required")), {}
    for end in range(1, len(full) + 1):
        for d in stream.delta(full[:end], end == len(full)).get("tool_calls", []):
            got.setdefault(d["index"], [d["function"].get("name"), ""])[1] += d["function"]["arguments"]
    assert got == {0: ["get_weather", '{"city":"Pa}r\\"is","unit":"c"}'], 1: ["add", '{"a":1}']}
    assert RequiredToolParser(ToolMode("required")).scan('[{"name":"ad', False).calls == [(None, "")]  # no header
    # until the name is whole
    assert ToolCallStream(ToolMode("required")).delta('[{"name":"ad', False) == {}


def test_hermes_tool_calls_parse_for_auto():
    text = 'Let me check.\n<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    content, calls = parse_calls(text, AUTO)
    assert content == "Let me check." and calls[0]["function"] == {"name": "add", "arguments": '{"a": 1}'}
    assert parse_calls("no calls here", AUTO) == ("no calls here", [])


def _stream_auto(text: str, ends: list[int]) -> tuple[list[dict], str, dict[int, list[str]]]:
    """Feeds `text` to an "auto" streamer cut at `ends`: the deltas, the content and the calls they add up to."""
    stream, deltas, content, calls = ToolCallStream(ToolMode("auto")), [], "", {}
    for end in [*ends, len(text)]:
        delta = stream.delta(text[:end], end == len(text))
        deltas.append(delta)
        content += delta.get("content", "")
        for d in delta.get("tool_calls", []):
            if "id" in d:
                assert d["type"] == "function" and d["index"] == len(calls) and d["function"]["arguments"] == ""
                calls[d["index"]] = [d["function"]["name"], ""]
            calls[d["index"]][1] += d["function"]["arguments"]
    return deltas, content, calls


def _parsed(text: str) -> tuple[str, dict[int, list[str]]]:
    content, calls = parse_calls(text, AUTO)
    return content or "", {i: [c["function"]["name"], c["function"]["arguments"]] for i, c in enumerate(calls)}


TWO_CALLS = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa\\"ris</tool_call>", "unit": "c"}}\n'
    '</tool_call><tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
)
NOT_A_CALL = 'Sure <tool_call>get_weather(city="Oslo")</tool_call>'
NO_NAME = '<tool_call>{"arguments": {"a": 1}}</tool_call>'


@pytest.mark.parametrize(
    "text, content, calls",
    [
        (
            TWO_CALLS,
            "Let me check.",
            {0: ["get_weather", '{"city": "Pa\\"ris</tool_call>", "unit": "c"}'], 1: ["add", '{"a": 1, "b": 2}']},
        ),
        ("Hi <to you, <tool> is not <tool_call", "Hi <to you, <tool> is not <tool_call", {}),
        # not JSON, or no string name: no call, the text is content (as vLLM)
        (NOT_A_CALL, NOT_A_CALL, {}),
        (NO_NAME, NO_NAME, {}),
        (
            '<tool_call>{"name": "a"} </tool_call><tool_call>{"name": 7}</tool_call>',
            '<tool_call>{"name": 7}</tool_call>',
            {0: ["a", "{}"]},
        ),
        # broken after its name was streamed: the call stands with the arguments as written
        (
            '<tool_call>{"name": "add", "arguments": {"a": 1,, "b": 2}}</tool_call>',
            "",
            {0: ["add", '{"a": 1,, "b": 2}']},
        ),
        ('<tool_call>{"name": "add", "arguments": {"a": 1</tool_call>', "", {0: ["add", '{"a": 1']}),
        ('<tool_call>{"name": "add", "arguments": {"a": 1, "b"', "", {0: ["add", '{"a": 1, "b"']}),  # cut off
        ('<tool_call>{"na', '<tool_call>{"na', {}),
    ],
)
def test_auto_stream_adds_up_to_the_whole_answer_wherever_the_text_is_cut(text, content, calls):
    assert _parsed(text) == (content, calls)
    cuts = [
        list(range(len(text))),  # a character at a time
        [text.index("<") + 3, text.index("<") + 8],  # inside the tag
        [i for i, ch in enumerate(text) if ch in '"\\'],  # at every quote and escape
        [len(text) // 3, len(text) // 2],
    ]
    for ends in cuts:
        _, got_content, got_calls = _stream_auto(text, ends)
        assert (got_content, got_calls) == (content, calls), ends


def test_auto_stream_sends_content_first_and_arguments_as_they_grow():
    deltas, _, _ = _stream_auto(TWO_CALLS, list(range(len(TWO_CALLS))))
    kinds = [k for d in deltas for k in d]
    assert kinds[0] == "content" and "content" not in kinds[kinds.index("tool_calls") :]
    pieces = [t["function"]["arguments"] for d in deltas for t in d.get("tool_calls", [])]
    assert sum(1 for p in pieces if p) > 20  # about one per character, not the whole arguments at the end
    # a call's header goes out as soon as its name is whole
    head = TWO_CALLS[: TWO_CALLS.index('", "arguments"') + 1]
    assert scan_hermes(head, False) == ("Let me check.", [("get_weather", "")])


def test_auto_stream_holds_back_only_what_could_still_be_the_tag():
    stream = ToolCallStream(ToolMode("auto"))
    assert stream.delta("Hi", False) == {"content": "Hi"}
    assert stream.delta("Hi <to", False) == {}  # could be <tool_call>
    assert stream.delta("Hi <too", False) == {}
    assert stream.delta("Hi <tooth", False) == {"content": " <tooth"}  # it was not
    assert stream.delta("Hi <tooth \n", False) == {}  # whitespace waits: dropped if a call follows
    assert stream.delta("Hi <tooth \n<tool_call>", False) == {}
    assert ToolCallStream(ToolMode("auto")).delta("Hi <tool_c", True) == {"content": "Hi <tool_c"}  # the end


def test_required_tool_schema_moves_the_tools_defs_to_its_root():
    """pydantic puts nested models in `$defs`, referenced from the root (`#/$defs/City`): inside the "required"
    array schema they must sit at its root to resolve; two tools that define one name differently are a 400."""

    class City(pydantic.BaseModel):
        name: str

    class Trip(pydantic.BaseModel):
        to: City

    params = Trip.model_json_schema()
    tool = {"type": "function", "function": {"name": "go", "parameters": params}}
    schema = tool_schema([tool], ToolMode("required"))
    assert schema["$defs"] == params["$defs"] and all("$defs" not in p for p in _item_parameters(schema))
    jsonschema.validate([{"name": "go", "parameters": {"to": {"name": "Oslo"}}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "go", "parameters": {"to": {"nom": 1}}}], schema)
    other = {"type": "function", "function": {"name": "back", "parameters": {**params, "$defs": {"City": {}}}}}
    with pytest.raises(ValueError, match="tools: \\$defs 'City' differs"):
        tool_schema([tool, other], ToolMode("required"))


def _item_parameters(schema: dict) -> list[dict]:
    return [item["properties"]["parameters"] for item in schema["items"]["anyOf"]]
