"""Fuzzing a real server: schemathesis against its own /openapi.json (no 5xx, every answer as the schema says),
and a hypothesis-driven client mixing valid and invalid bodies, n, stop strings, logprobs, long prompts and
streams cut at random points, in concurrent bursts over a KV cache small enough to preempt. After all of it:
the server answers, every block is free, nothing runs or waits. Bounded: well under a minute each."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from server_helpers import AUTH, FAULT_ENGINE_ARGS, assert_pool_whole, running_server, tiny_kv_budget

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def fuzz_server(model_fp32):
    from pagedllm.engine import EngineConfig, LLMEngine
    from pagedllm.engine.async_engine import AsyncLLMEngine
    from pagedllm.engine.pooling import PoolerConfig

    engine = AsyncLLMEngine(
        LLMEngine(EngineConfig(kv_cache_memory=tiny_kv_budget(), **FAULT_ENGINE_ARGS), loaded=model_fp32),
        max_waiting_requests=16,
    )
    # the model also pools (POST /v1/embeddings), its requests batched with the generations
    app_args = dict(served_model_name=["m"], max_request_bytes=256 * 1024, pooler=PoolerConfig())
    with running_server(engine, **app_args) as s:
        yield s


def _bounded(body: object) -> None:
    """Small generations only: the fuzzer is after crashes and schema breaks, not long outputs."""
    if not isinstance(body, dict):
        return
    for key, cap in (("max_tokens", 4), ("max_completion_tokens", 4), ("n", 2), ("min_tokens", 4)):
        if isinstance(body.get(key), int) and not isinstance(body.get(key), bool) and body[key] > cap:
            body[key] = cap
    if "messages" in body and "max_tokens" not in body and "max_completion_tokens" not in body:
        body["max_tokens"] = 4


CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


def test_openapi_schema_fuzz(fuzz_server):
    """Every operation of /openapi.json, with generated valid and invalid inputs: no 5xx, and every answer's
    status, content type and body as the schema says."""
    schema = schemathesis.openapi.from_url(fuzz_server.base + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 8
    assert {"/v1/responses", "/v1/messages", "/v1/embeddings"} <= {op.path for op in operations}  # issue 28's

    for operation in operations:

        @settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(case=operation.as_strategy())
        def call(case) -> None:
            _bounded(case.body)
            case.call_and_validate(base_url=fuzz_server.base, headers=AUTH, timeout=60, checks=CHECKS)

        call()
    _assert_drained(fuzz_server)


# ---------------------------------------------------------------------------------- the hypothesis client
WORDS = ["the", "cat", "sat", "on", "a", "mat", "Paris", "is", "of", "and", "\u00e9t\u00e9", "\u4f60\u597d", "!"]

valid_prompt = st.one_of(
    st.lists(st.sampled_from(WORDS), min_size=1, max_size=180).map(" ".join),  # long enough to preempt others
    st.lists(st.integers(1, 4000), min_size=1, max_size=60),
)
body_field = st.fixed_dictionaries(
    {"prompt": valid_prompt},
    optional={
        # never null: that is up to max_model_len per request, not what the fuzzer is after
        "max_tokens": st.one_of(st.integers(0, 12), st.sampled_from([-1, "x", 10**30])),
        "n": st.one_of(st.integers(1, 3), st.sampled_from([0, 99, True])),
        "stop": st.one_of(st.sampled_from(WORDS), st.lists(st.sampled_from(WORDS), max_size=3)),
        "logprobs": st.one_of(st.integers(0, 3), st.just(50)),
        "echo": st.booleans(),
        "temperature": st.one_of(st.floats(0, 2), st.sampled_from([-1.0, 1e-300, "hot"])),
        "seed": st.integers(-(2**63), 2**64 + 5),
        "ignore_eos": st.booleans(),
        "stream": st.booleans(),
        "top_k": st.integers(-2, 50),
        "logit_bias": st.dictionaries(st.sampled_from(["1", "42", "x", "-3"]), st.floats(-200, 200), max_size=2),
        # issue 28's fields, valid and not (a field nobody defines is ignored; one vLLM defines and pagedllm does
        # not serve is a 400)
        "priority": st.sampled_from([0, 0, 1, -1, "x", 2**40]),
        "cache_salt": st.one_of(st.text(max_size=6), st.sampled_from(["tenant-a", "tenant-b"])),
        "bad_words": st.lists(st.sampled_from(WORDS + ["", " "]), max_size=2),
        "allowed_token_ids": st.lists(st.integers(-1, 60000), max_size=3),
        "truncate_prompt_tokens": st.sampled_from([-2, -1, 0, 3, 40, 10**6]),
        "use_beam_search": st.booleans(),
        "frobnicate": st.integers(),
        "chat_template_kwargs": st.dictionaries(
            st.sampled_from(["enable_thinking", "tokenize", "messages", "not a name"]), st.booleans(), max_size=2
        ),
        "continue_final_message": st.booleans(),
        "add_generation_prompt": st.booleans(),
        "chat_template": st.sampled_from(["{{ messages[0].content }}", "{% for %}"]),
    },
)
request_spec = st.tuples(
    st.sampled_from(["/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/responses", "/v1/messages"]),
    body_field,
    st.one_of(st.none(), st.integers(0, 4)),
)  # cut a stream after this many events


def _as_chat(body: dict) -> dict:
    body = dict(body)
    prompt = body.pop("prompt")
    body.pop("echo", None)
    logprobs = body.pop("logprobs", None)
    if isinstance(logprobs, int):
        body.update(logprobs=True, top_logprobs=logprobs)
    body["messages"] = [{"role": "user", "content": prompt if isinstance(prompt, str) else str(prompt)}]
    body.setdefault("max_tokens", 8)  # chat's default is the rest of the context
    return body


def _as_embedding(body: dict) -> dict:
    """The prompt as the input of a pooling request (scheduled with the generations, preempted as they are)."""
    return {"input": body["prompt"], "encoding_format": "base64" if body.get("echo") else "float"}


def _as_responses(body: dict) -> dict:
    """The chat request as a Responses one: the text as `input`, max_tokens as max_output_tokens; the other
    fields as they are (a chat-only one is a 400, never a 5xx)."""
    body = _as_chat(body)
    body["input"] = body.pop("messages")[0]["content"]
    body["max_output_tokens"] = body.pop("max_tokens")
    return body


def _as_messages(body: dict) -> dict:
    """The chat request as an Anthropic Messages one: stop as stop_sequences, the rest as they are."""
    body = _as_chat(body)
    if "stop" in body:
        stop = body.pop("stop")
        body["stop_sequences"] = [stop] if isinstance(stop, str) else stop
    return body


CONVERT = {
    "/v1/chat/completions": _as_chat,
    "/v1/embeddings": _as_embedding,
    "/v1/responses": _as_responses,
    "/v1/messages": _as_messages,
}


async def _send(client: httpx.AsyncClient, path: str, body: dict, cut: int | None) -> list[str]:
    """One request; returns the problems seen (a 5xx, an error event of a 5xx)."""
    body = CONVERT[path](body) if path in CONVERT else body
    async with client.stream("POST", path, json=body) as r:
        if r.status_code >= 500:
            return [f"{path} {json.dumps(body)[:300]} -> {r.status_code} {(await r.aread())[:300]!r}"]
        if r.status_code != 200 or not r.headers["content-type"].startswith("text/event-stream"):
            await r.aread()
            return []
        seen, problems = 0, []
        async for line in r.aiter_lines():
            flat = line.replace(" ", "")
            five = (
                '"code":5' in flat or '"type":"api_error"' in flat or '"type":"overloaded_error"' in flat
            )  # Anthropic's
            if line.startswith("data: {") and '"error"' in line and five:
                problems.append(f"{path} {json.dumps(body)[:300]} -> stream error {line[:300]}")
            seen += line.startswith("data: ")
            if cut is not None and seen >= cut:
                break  # leaving the block closes the connection mid-stream
        return problems


def test_random_client_bursts(fuzz_server):
    """Bursts of valid and invalid requests, some cut mid-stream: no 5xx, and afterwards nothing left behind."""

    @settings(
        max_examples=12, deadline=None, suppress_health_check=list(HealthCheck), phases=[Phase.generate], database=None
    )  # no shrinking: the failing burst is printed as it was, in bounded time
    @given(burst=st.lists(request_spec, min_size=1, max_size=5))
    def send_burst(burst) -> None:
        async def main() -> list[str]:
            async with httpx.AsyncClient(base_url=fuzz_server.base, headers=AUTH, timeout=120) as client:
                results = await asyncio.gather(*(_send(client, *spec) for spec in burst))
            return [p for ps in results for p in ps]

        assert asyncio.run(main()) == []

    send_burst()
    _assert_drained(fuzz_server)


def _assert_drained(server) -> None:
    """The server answers and holds no block, nothing runs or waits."""
    assert server.http.get("/health").json() == {"status": "ok"}
    r = server.http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert_pool_whole(server)


STREAMS = {
    "/v1/completions": {"prompt": "hi"},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}]},
    "/v1/responses": {"input": "hi"},
    "/v1/messages": {"messages": [{"role": "user", "content": "hi"}]},
}


@pytest.mark.parametrize("path", STREAMS)
def test_every_stream_is_what_its_schema_says(fuzz_server, path):
    """A streamed answer of each stream route, checked event by event against /openapi.json as schemathesis reads
    a text/event-stream schema (one server-sent event: its data the chunk model's JSON, or [DONE]); the fuzz test
    above meets these only when a generated body happens to stream."""
    schema = schemathesis.openapi.from_url(fuzz_server.base + "/openapi.json")
    operation = schema[path]["POST"]
    limit = {"max_output_tokens": 2} if path == "/v1/responses" else {"max_tokens": 2}
    case = operation.Case(body={"model": "m", "stream": True, **limit, **STREAMS[path]}, media_type="application/json")
    response = case.call(base_url=fuzz_server.base, headers=AUTH, timeout=60)
    assert response.status_code == 200 and response.headers["content-type"][0].startswith("text/event-stream")
    case.validate_response(response, checks=CHECKS)
