"""/v1/messages (issue 28.4): Anthropic's Messages API, driven by the `anthropic` SDK unchanged (its x-api-key
header, `messages.create` and `messages.stream`) against a real server over the default model: system, messages,
max_tokens, stop_sequences, tools -> tool_use blocks, the stream's events adding up to the whole message; bad
input a 400 in Anthropic's error shape naming the field, and no block left behind."""

from __future__ import annotations

import uuid

import anthropic
import jsonschema
import pytest
from engine_helpers import kv_budget
from server_helpers import KEY, StepHold, assert_as_declared, assert_pool_whole, running_server, sse_events

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ADD = {
    "name": "add",
    "description": "Add two numbers",
    "input_schema": {
        "type": "object",
        "properties": {"a": {"type": "integer", "maximum": 99}, "b": {"type": "integer", "maximum": 99}},
        "required": ["a", "b"],
        "additionalProperties": False,
    },
}
GREEDY = {"temperature": 0}  # not among the SDK's arguments (2.14): sent as an extra body field
HI = [{"role": "user", "content": "Write a short sentence about cats."}]


@pytest.fixture(scope="module")
def server(model_fp32):
    from pagedllm.engine import EngineConfig, LLMEngine
    from pagedllm.engine.async_engine import AsyncLLMEngine

    config = EngineConfig(
        dtype="float32", max_model_len=512, kv_cache_memory=kv_budget(48), max_num_seqs=4, log_stats_interval=0
    )
    with running_server(AsyncLLMEngine(LLMEngine(config, loaded=model_fp32)), served_model_name=["m"]) as s:
        s.client = anthropic.Anthropic(base_url=s.base, api_key=KEY, max_retries=0)
        s.spec = s.http.get("/openapi.json").json()
        yield s


def test_a_message_is_the_chat_answer_to_the_same_conversation(server):
    msg = server.client.messages.create(
        model="m", max_tokens=8, system="Answer briefly.", messages=HI, extra_body=GREEDY
    )
    chat = server.http.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "system", "content": "Answer briefly."}, *HI], "max_tokens": 8, "temperature": 0},
    ).json()
    choice = chat["choices"][0]
    assert msg.id.startswith("msg_") and msg.type == "message" and msg.role == "assistant" and msg.model == "m"
    (block,) = msg.content
    assert block.type == "text" and block.text == choice["message"]["content"]
    assert msg.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[choice["finish_reason"]]
    assert msg.usage.input_tokens == chat["usage"]["prompt_tokens"] and msg.usage.output_tokens <= 8
    assert_pool_whole(server)


def test_a_stop_sequence_ends_the_message_and_is_named(server):
    whole = server.client.messages.create(model="m", max_tokens=24, messages=HI, extra_body=GREEDY)
    words = whole.content[0].text.split()
    assert len(words) > 3, whole
    stop = words[2]
    msg = server.client.messages.create(model="m", max_tokens=24, messages=HI, extra_body=GREEDY, stop_sequences=[stop])
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == stop, msg
    assert stop not in msg.content[0].text and whole.content[0].text.startswith(msg.content[0].text)
    assert_pool_whole(server)


def test_the_stream_adds_up_to_the_whole_message(server):
    body = {"model": "m", "max_tokens": 16, "messages": HI, "extra_body": GREEDY}
    whole = server.client.messages.create(**body)
    with server.client.messages.stream(**body) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"], kinds
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 1
    assert final.content[0].text == whole.content[0].text and final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert_pool_whole(server)


def test_a_last_assistant_message_is_continued_as_anthropics_prefill(server):
    """Issue 38.2: the answer goes on from the assistant's text (chat's continue_final_message), whole and
    streamed, not from a new assistant turn."""
    messages = [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "1, 2,"}]
    chat = server.http.post(
        "/v1/chat/completions",
        json={
            "messages": messages,
            "max_tokens": 8,
            "temperature": 0,
            "add_generation_prompt": False,
            "continue_final_message": True,
        },
    ).json()
    msg = server.client.messages.create(model="m", max_tokens=8, messages=messages, extra_body=GREEDY)
    assert msg.content[0].text == chat["choices"][0]["message"]["content"], (msg, chat)
    assert msg.usage.input_tokens == chat["usage"]["prompt_tokens"]
    with server.client.messages.stream(model="m", max_tokens=8, messages=messages, extra_body=GREEDY) as stream:
        assert "".join(stream.text_stream) == msg.content[0].text
    assert_pool_whole(server)


def test_a_streamed_message_says_its_cached_prompt_tokens_from_the_start(server):
    """Issue 38.4: message_start's usage (and so the SDK's final message) carries cache_read_input_tokens, as
    the whole answer's does: the second of two equal requests reads its prompt's full blocks from the cache."""
    body = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "Tell me a story " * 5}]}
    server.client.messages.create(**body, extra_body=GREEDY)
    whole = server.client.messages.create(**body, extra_body=GREEDY)
    assert whole.usage.cache_read_input_tokens and whole.usage.cache_read_input_tokens > 0, whole.usage
    with server.client.messages.stream(**body, extra_body=GREEDY) as stream:
        start = next(e for e in stream if e.type == "message_start")
        final = stream.get_final_message()
    assert start.message.usage.cache_read_input_tokens == whole.usage.cache_read_input_tokens, start
    assert final.usage.cache_read_input_tokens == whole.usage.cache_read_input_tokens
    assert final.usage.input_tokens == whole.usage.input_tokens
    assert_pool_whole(server)


def test_tools_give_tool_use_blocks_streamed_and_not(server):
    body = {
        "model": "m",
        "max_tokens": 40,
        "messages": [{"role": "user", "content": "Add 12 and 34."}],
        "tools": [ADD],
        "tool_choice": {"type": "any"},
        "extra_body": GREEDY,
    }
    whole = server.client.messages.create(**body)
    (use,) = whole.content
    assert use.type == "tool_use" and use.name == "add" and use.id.startswith("toolu_")
    jsonschema.validate(use.input, ADD["input_schema"])
    assert whole.stop_reason == "tool_use"
    with server.client.messages.stream(**body) as stream:
        events = list(stream)
        final = stream.get_final_message()
    pieces = [e.delta.partial_json for e in events if e.type == "content_block_delta"]
    assert len(pieces) > 1 and final.content[0].input == use.input and final.stop_reason == "tool_use"
    named = server.client.messages.create(**{**body, "tool_choice": {"type": "tool", "name": "add"}})
    assert [b.name for b in named.content] == ["add"] and named.stop_reason == "tool_use"
    # a conversation with the call and its result goes back in
    again = [
        *body["messages"],
        {"role": "assistant", "content": [{"type": "tool_use", "id": use.id, "name": "add", "input": use.input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "46"}]},
    ]
    reply = server.client.messages.create(model="m", max_tokens=4, messages=again, extra_body=GREEDY)
    assert reply.content and reply.content[0].type == "text"
    assert_pool_whole(server)


def test_answers_are_as_openapi_declares(server):
    headers = {"x-api-key": KEY}
    body = {"model": "m", "max_tokens": 3, "messages": HI}
    r = server.http.post("/v1/messages", json=body, headers=headers)
    assert assert_as_declared(server.spec, "/v1/messages", "post", r) == 1
    with server.http.stream("POST", "/v1/messages", json={**body, "stream": True}, headers=headers) as r:
        lines = list(r.iter_lines())
    events = sse_events(lines)
    assert assert_as_declared(server.spec, "/v1/messages", "post", r, events) >= 5 and "[DONE]" not in events
    bad = server.http.post("/v1/messages", json={**body, "max_tokens": 0}, headers=headers)
    assert_as_declared(server.spec, "/v1/messages", "post", bad)
    wrong_key = server.http.post("/v1/messages", json=body, headers={"x-api-key": "nope", "Authorization": ""})
    assert wrong_key.status_code == 401 and wrong_key.json()["error"]["type"] == "authentication_error"


USE = {"type": "tool_use", "id": "toolu_1", "name": "add", "input": {"a": 1, "b": 2}}


def _result(tool_use_id: str) -> dict:
    return {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool_use_id, "content": "3"}]}


SDK_ARGS = {"model", "max_tokens", "messages", "stop_sequences", "tools", "tool_choice", "thinking", "system"}
BAD = [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": None}, "max_tokens"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages"),
    ({"temperature": 1.5}, "temperature"),  # Anthropic's range: 0..1
    ({"stop_sequences": "x"}, "stop_sequences"),
    ({"stop_sequences": [str(i) for i in range(20)]}, "stop_sequences"),
    ({"tools": [ADD], "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice"),
    ({"tools": [ADD]}, "tool_choice"),  # "auto": the default model's template renders no tools
    ({"tools": [{"name": "x"}]}, "tools"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
    ({"max_tokens": 600}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "Hi " * 600}]}, "messages"),
    # issue 38.6: what Anthropic refuses (a tool_result must answer a tool_use of the assistant's turn before it)
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1"}]}]}, "tool_use_id"),
    ({"messages": [{"role": "user", "content": [USE]}]}, "tool_use"),
    ({"messages": [*HI, {"role": "assistant", "content": [USE]}, _result("toolu_2")]}, "tool_use_id"),
    ({"messages": [*HI, {"role": "assistant", "content": [USE]}, *HI, _result("toolu_1")]}, "tool_use_id"),
    ({"messages": [*HI, {"role": "assistant", "content": [USE, {**USE}]}, _result("toolu_1")]}, "tool_use"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "got 5"),
]


@pytest.mark.parametrize("extra, field", BAD)
def test_bad_input_is_a_400_in_anthropics_shape_naming_the_field(server, extra, field):
    body = {"model": "m", "max_tokens": 8, "messages": HI, **extra}
    body = {k: v for k, v in body.items() if v is not None}
    for stream in (False, True):
        r = server.http.post("/v1/messages", json={**body, "stream": stream}, headers={"x-api-key": KEY})
        assert r.status_code == 400, r.text
        err = r.json()
        assert set(err) == {"type", "error"} and err["type"] == "error", err
        assert err["error"]["type"] == "invalid_request_error" and field in err["error"]["message"], err
    sdk = {k: v for k, v in body.items() if k in SDK_ARGS}
    if "max_tokens" in sdk:  # the SDK itself asks for it
        with pytest.raises(anthropic.BadRequestError) as e:
            server.client.messages.create(**sdk, extra_body={k: v for k, v in body.items() if k not in SDK_ARGS})
        assert field in e.value.message
    missing = server.http.post("/v1/messages", json={**body, "model": "nope"}, headers={"x-api-key": KEY})
    assert missing.status_code in (400, 404) and missing.json()["type"] == "error"
    assert_pool_whole(server)


@pytest.mark.parametrize(
    "path, prefix, body",
    [
        ("/v1/messages", "msg_", {"model": "m", "max_tokens": 200, "messages": HI, "stream": True}),
        ("/v1/responses", "resp_", {"input": HI[0]["content"], "max_output_tokens": 200, "stream": True}),
    ],
)
def test_a_client_that_leaves_a_stream_gets_its_request_aborted(server, path, prefix, body):
    """The first event goes out before any token; the client leaves after it, with ~200 tokens to go (the
    engine's steps held, so it cannot finish first): the server aborts the request and its blocks come back."""
    rid = f"leave-{uuid.uuid4().hex[:8]}"
    with StepHold(server.engine) as hold:
        hold.allow(2)
        headers = {"x-api-key": KEY, "X-Request-Id": rid, "Authorization": f"Bearer {KEY}"}
        with server.http.stream("POST", path, json=body, headers=headers) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    break  # leaving closes the response: the client is gone
        hold.wait_abort(f"{prefix}{rid}")
    assert_pool_whole(server)
