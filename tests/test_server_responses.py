"""/v1/responses (issue 28.4): OpenAI's Responses API, stateless, driven by the `openai` SDK unchanged against a
real server over the default model: text, instructions, items, structured outputs through text.format, function
tools, max_output_tokens, streamed as its typed events adding up to the whole response; bad input a 400 naming
the field, and no block left behind."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from engine_helpers import kv_budget
from server_helpers import KEY, assert_as_declared, assert_error, assert_pool_whole, running_server, sse_events

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
ADD = {
    "type": "function",
    "name": "add",
    "description": "Add two numbers",
    "parameters": {
        "type": "object",
        "properties": {"a": {"type": "integer", "maximum": 99}, "b": {"type": "integer", "maximum": 99}},
        "required": ["a", "b"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def server(model_fp32):
    from pagedllm.engine import EngineConfig, LLMEngine
    from pagedllm.engine.async_engine import AsyncLLMEngine

    config = EngineConfig(
        dtype="float32", max_model_len=512, kv_cache_memory=kv_budget(48), max_num_seqs=4, log_stats_interval=0
    )
    with running_server(AsyncLLMEngine(LLMEngine(config, loaded=model_fp32)), served_model_name=["m"]) as s:
        s.client = openai.OpenAI(base_url=s.base + "/v1", api_key=KEY, max_retries=0)
        s.spec = s.http.get("/openapi.json").json()
        yield s


def test_text_with_instructions_is_the_chat_answer_to_the_same_messages(server):
    resp = server.client.responses.create(
        model="m", input="Name a colour.", instructions="Answer in one word.", max_output_tokens=6, temperature=0
    )
    chat = server.client.chat.completions.create(
        model="m",
        messages=[{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Name a colour."}],
        max_tokens=6,
        temperature=0,
    )
    choice = chat.choices[0]
    assert resp.object == "response" and resp.id.startswith("resp_") and resp.model == "m"
    assert resp.output_text == choice.message.content and resp.output_text
    (item,) = resp.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
    assert resp.status == ("incomplete" if choice.finish_reason == "length" else "completed")
    if resp.status == "incomplete":
        assert resp.incomplete_details.reason == "max_output_tokens"
    assert resp.usage.input_tokens == chat.usage.prompt_tokens and resp.usage.output_tokens <= 6
    assert resp.usage.total_tokens == resp.usage.input_tokens + resp.usage.output_tokens
    items = [
        {"role": "developer", "content": "Answer in one word."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Name a colour."}]},
    ]
    same = server.client.responses.create(model="m", input=items, max_output_tokens=6, temperature=0)
    assert server.http.post("/v1/responses", json={"input": "x", "max_output_tokens": 1}).status_code == 200
    assert same.usage.input_tokens == resp.usage.input_tokens or same.output_text  # developer: its template's role
    assert_pool_whole(server)


def _streamed(server, **body) -> tuple[list, object]:
    events = list(server.client.responses.create(model="m", stream=True, **body))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[0].response.status == "in_progress"
    assert events[-1].type in ("response.completed", "response.incomplete")
    return events, events[-1].response


def test_a_stream_is_typed_events_that_add_up_to_the_whole_response(server):
    body = {"input": "Write a short sentence about cats.", "max_output_tokens": 12, "temperature": 0}
    whole = server.client.responses.create(model="m", **body)
    events, final = _streamed(server, **body)
    kinds = [e.type for e in events]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds.count("response.output_text.delta") > 1
    assert text == final.output_text == whole.output_text and final.status == whole.status
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert [e.text for e in events if e.type == "response.output_text.done"] == [text]
    assert_pool_whole(server)


def test_text_format_json_schema_holds_the_answer(server):
    fmt = {"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}}
    resp = server.client.responses.create(
        model="m", input="Invent a person.", text=fmt, max_output_tokens=40, temperature=0
    )
    assert resp.status == "completed", resp
    jsonschema.validate(json.loads(resp.output_text), PERSON)
    assert resp.text.format.type == "json_schema"
    assert_pool_whole(server)


def test_function_tools_make_function_call_items_streamed_and_not(server):
    body = {"input": "Add 12 and 34.", "tools": [ADD], "tool_choice": "required", "max_output_tokens": 40}
    whole = server.client.responses.create(model="m", temperature=0, **body)
    (call,) = [i for i in whole.output if i.type == "function_call"]
    assert call.name == "add" and call.call_id.startswith("call_") and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), ADD["parameters"])
    events, final = _streamed(server, temperature=0, **body)
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    added = [e.item for e in events if e.type == "response.output_item.added"]
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(pieces) > 1 and "".join(pieces) == done.arguments == call.arguments
    assert [a.name for a in added] == ["add"] and final.output[0].call_id == added[0].call_id
    assert final.output[0].arguments == call.arguments and final.status == whole.status == "completed"
    named = server.client.responses.create(
        model="m",
        input="Add 1 and 2.",
        tools=[ADD],
        tool_choice={"type": "function", "name": "add"},
        max_output_tokens=40,
        temperature=0,
    )
    assert [i.name for i in named.output if i.type == "function_call"] == ["add"]
    assert_pool_whole(server)


def test_answers_are_as_openapi_declares(server):
    assert "/v1/responses" in server.spec["paths"]
    body = {"input": "Hi", "max_output_tokens": 3}
    r = server.http.post("/v1/responses", json=body)
    assert assert_as_declared(server.spec, "/v1/responses", "post", r) == 1
    with server.http.stream("POST", "/v1/responses", json={**body, "stream": True}) as r:
        lines = list(r.iter_lines())
    assert assert_as_declared(server.spec, "/v1/responses", "post", r, sse_events(lines)) > 5
    assert sum(1 for line in lines if line.startswith("event: response.")) == len(sse_events(lines))
    bad = server.http.post("/v1/responses", json={"input": "Hi", "max_output_tokens": 0})
    assert_as_declared(server.spec, "/v1/responses", "post", bad)


CALL = {"type": "function_call", "call_id": "call_1", "name": "add", "arguments": '{"a": 1, "b": 2}'}
OUTPUT = {"type": "function_call_output", "call_id": "call_1", "output": "3"}
BAD = [
    ({"input": "Hi", "max_output_tokens": 0}, "max_output_tokens", "max_output_tokens"),
    ({"input": []}, "input", "empty"),
    ({}, "input", "required"),
    ({"input": [{"role": "user"}]}, "input", "content"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input", "text"),
    ({"input": "Hi", "tools": [{"type": "web_search"}]}, "tools", "function"),
    ({"input": "Hi", "previous_response_id": "resp_1"}, "previous_response_id", "stateless"),
    ({"input": "Hi", "reasoning": {"effort": "low"}}, "reasoning", "not supported"),
    ({"input": "Hi", "tool_choice": "required"}, "tool_choice", "tools"),
    ({"input": "Hi", "tools": [ADD], "tool_choice": "auto"}, "tool_choice", "chat template"),
    ({"input": "Hi", "tool_choice": {"type": "function"}}, "tool_choice", "name"),
    (
        {"input": "Hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "objekt"}}}},
        "text.format",
        "schema",
    ),
    ({"input": "Hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text", "needs a schema"),
    ({"input": "Hi " * 600}, "input", "maximum context length"),
    ({"input": "Hi", "max_output_tokens": 600}, "max_output_tokens", "maximum context length"),
    ({"input": "Hi", "model": "nope"}, "model", "does not exist"),
    # issue 38.6: an output must answer a call made before it; an item of an unknown type is named as one
    ({"input": [{"type": "function_call_output", "call_id": "call_1", "output": "3"}]}, "input", "call_1"),
    ({"input": [{**CALL, "call_id": "call_2"}, {**OUTPUT, "call_id": "call_1"}]}, "input", "call_1"),
    ({"input": [{"type": "web_search_call", "role": "user", "content": "Hi"}]}, "input", "web_search_call"),
]


@pytest.mark.parametrize("body, param, word", BAD)
def test_bad_input_is_a_400_naming_the_field_streamed_or_not(server, body, param, word):
    for stream in (False, True):
        r = server.http.post("/v1/responses", json={**body, "stream": stream})
        assert_error(r, 404 if param == "model" else 400, param, [word])
    with pytest.raises(openai.APIStatusError) as e:
        server.client.responses.create(**{"model": "m", **body})
    assert e.value.status_code in (400, 404) and e.value.body["param"] == param
    assert_pool_whole(server)
