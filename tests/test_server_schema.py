"""Every route answers what /openapi.json says it answers (issue 26): each answer, and each event of a stream,
validates against the route's declared schema with undeclared fields refused, on a real server over the default
model; the cluster's own /health and /v1/kv too, over a stand-in for its replicas (no Ray)."""

from __future__ import annotations

import httpx
import pytest
from server_helpers import FAULT_ENGINE_ARGS, assert_as_declared, running_server, sse_events, tiny_kv_budget

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
                "additionalProperties": False,
            },
        },
    }
]
USAGE = {"include_usage": True, "continuous_usage_stats": True}
COMPLETIONS = [
    {"prompt": "The cat", "max_tokens": 3},
    {"prompt": [[1, 2, 3], [4, 5]], "n": 2, "max_tokens": 2, "logprobs": 2, "echo": True, "prompt_logprobs": 1},
    {"prompt": "The cat", "max_tokens": 0, "logprobs": 1, "echo": True},
]
CHATS = [
    {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3},
    {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "logprobs": True, "top_logprobs": 2},
    {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "n": 2, "prompt_logprobs": 0},
    {
        "messages": [{"role": "user", "content": "Add 1 and 2"}],
        "max_tokens": 16,
        "tools": TOOLS,
        "tool_choice": "required",
    },
    {
        "messages": [{"role": "user", "content": "Add 1 and 2"}],
        "max_tokens": 6,
        "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "add"}},
    },
]


@pytest.fixture(scope="module")
def server(model_fp32):
    from pagedllm.engine import EngineConfig, LLMEngine
    from pagedllm.engine.async_engine import AsyncLLMEngine

    core = LLMEngine(EngineConfig(kv_cache_memory=tiny_kv_budget(), **FAULT_ENGINE_ARGS), loaded=model_fp32)
    with running_server(AsyncLLMEngine(core), served_model_name=["m"]) as s:
        s.spec = s.http.get("/openapi.json").json()
        yield s


def _post(s, path: str, body: dict) -> int:
    r = s.http.post(path, json={"model": "m", "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return assert_as_declared(s.spec, path, "post", r)


def _stream(s, path: str, body: dict) -> int:
    with s.http.stream("POST", path, json={"model": "m", "temperature": 0, "stream": True, **body}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]" and all("error" not in e for e in events[:-1]), events
    assert any(c.get("finish_reason") for e in events[:-1] for c in e.get("choices", [])), events  # it ended
    return assert_as_declared(s.spec, path, "post", r, events)


def test_whole_answers_are_their_declared_models(server):
    for body in COMPLETIONS:
        assert _post(server, "/v1/completions", body) == 1
    for body in CHATS:
        assert _post(server, "/v1/chat/completions", body) == 1
    assert _post(server, "/tokenize", {"prompt": "Hello there"}) == 1
    assert _post(server, "/tokenize", {"messages": [{"role": "user", "content": "Hi"}], "return_token_strs": True})
    assert _post(server, "/detokenize", {"tokens": [1, 2, 3]}) == 1


def test_every_streamed_chunk_is_its_declared_model(server):
    """Each chunk checked against its declared model. How many chunks a stream takes depends on pacing (the
    server sends the latest output, so a fast engine's last tokens and its finish may share one chunk): a chat
    stream has at least its role chunk and one that carries the answer, and one more with usage; a completion
    stream one that carries the answer and its usage."""
    for body in COMPLETIONS[:2]:
        assert _stream(server, "/v1/completions", {**body, "stream_options": USAGE}) >= 2
    for body in CHATS:
        assert _stream(server, "/v1/chat/completions", body) >= 2
        assert _stream(server, "/v1/chat/completions", {**body, "stream_options": USAGE}) >= 3


def test_state_routes_and_errors_are_their_declared_models(server):
    s = server
    for path in ("/health", "/v1/models", "/v1/kv", "/v1/kv/blocks", "/v1/kv/blocks?detail=blocks", "/v1/kv/blocks/0"):
        r = s.http.get(path)
        assert r.status_code == 200, r.text
        assert_as_declared(s.spec, path.split("?")[0].replace("/0", "/{block_id}"), "get", r)
    errors = [
        ("/v1/completions", {"prompt": "x", "temperature": -1}, 400),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "model": "nope"}, 404),
        ("/v1/completions", {"prompt": [10**9]}, 400),
    ]
    for path, body, status in errors:
        r = s.http.post(path, json=body)
        assert r.status_code == status, r.text
        assert_as_declared(s.spec, path, "post", r)
    r = httpx.post(s.base + "/v1/completions", json={"prompt": "x"})  # no key
    assert r.status_code == 401 and assert_as_declared(s.spec, "/v1/completions", "post", r) == 1


def test_the_check_catches_an_undeclared_field(server):
    r = server.http.get("/v1/models")
    extra = httpx.Response(200, json={**r.json(), "surprise": 1}, headers={"content-type": "application/json"})
    with pytest.raises(AssertionError, match="surprise"):
        assert_as_declared(server.spec, "/v1/models", "get", extra)


def test_cluster_health_and_kv_are_their_declared_models():
    """The cluster's per-replica routes over a stand-in engine whose replicas report as EngineReplica does."""
    pytest.importorskip("ray")
    from dataclasses import replace
    from types import SimpleNamespace

    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from pagedllm.cluster.app import cluster_routes
    from pagedllm.cluster.replica import ReplicaReport
    from pagedllm.cluster.replica_metrics import sum_stats
    from pagedllm.server.errors import install_error_handlers

    stats = replace(sum_stats([]), num_blocks=8, num_free_blocks=6, block_size=16, num_running=1)

    class Engine:
        handle = SimpleNamespace(app_name="no-such-app", deployment_name="none")  # no router in this process
        healthy = True

        async def reports(self) -> dict:
            return {"r1": ReplicaReport("r1", self.healthy, stats, ""), "r2": TimeoutError("no answer")}

    app = FastAPI()
    app.include_router(cluster_routes)
    install_error_handlers(app)
    app.state.engine = engine = Engine()
    spec = app.openapi()
    with TestClient(app) as c:
        for path in ("/health", "/v1/kv"):
            r = c.get(path)
            assert r.status_code == 200, r.text
            assert_as_declared(spec, path, "get", r)
        assert c.get("/v1/kv").json()["replicas"]["r1"]["used_blocks"] == 2
        engine.healthy = False
        r = c.get("/health")
        assert r.status_code == 503 and assert_as_declared(spec, "/health", "get", r) == 1
