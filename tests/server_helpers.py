"""What the server test files share: an in-process server on a loopback port, the block-pool check through
GET /v1/kv, the OpenAI error-body check and an SSE reader."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from types import SimpleNamespace

import httpx
import pytest
from engine_helpers import kv_budget

KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
# The fault and fuzz servers: float32 (exact answers to compare), a short context, a tiny KV budget.
MAX_MODEL_LEN = 256
FAULT_ENGINE_ARGS = dict(
    dtype="float32", max_model_len=MAX_MODEL_LEN, max_num_seqs=8, max_num_batched_tokens=256, log_stats_interval=0
)


def tiny_kv_budget(blocks: int = 24) -> int:
    """24 blocks: long prompts preempt each other."""
    return kv_budget(blocks)


@contextlib.contextmanager
def running_server(engine, api_key: str | None = KEY, **app_args) -> Iterator[SimpleNamespace]:
    """uvicorn in a thread on a free port over `engine` (an AsyncLLMEngine), API key KEY (None: no key, as
    `pagedllm serve` without --api-key); stopped on exit."""
    from pagedllm.server.api_server import Server, build_app

    app = build_app(engine, api_key=api_key, **app_args)
    srv = Server(app, host="127.0.0.1", port=0, log_level="warning")
    srv.start_in_thread()
    port = srv.uvicorn.servers[0].sockets[0].getsockname()[1]
    base = f"http://127.0.0.1:{port}"
    http = httpx.Client(base_url=base, headers=AUTH, timeout=60)
    try:
        yield SimpleNamespace(base=base, http=http, engine=engine, port=port, server=srv)
    finally:
        http.close()
        srv.stop()


def kv(s) -> dict:
    r = s.http.get("/v1/kv")
    assert r.status_code == 200, r.text
    return r.json()


def assert_pool_whole(s, timeout: float = 30.0) -> dict:
    """Nothing running or waiting and every KV block free (cached-but-unused blocks count as free)."""
    deadline = time.monotonic() + timeout
    while True:
        state = kv(s)
        if state["used_blocks"] == 0 and state["num_running"] == 0 and state["num_waiting"] == 0:
            assert state["free_blocks"] == state["total_blocks"] > 0
            return state
        if time.monotonic() > deadline:
            pytest.fail(f"the block pool is not whole: {state}")
        time.sleep(0.05)


def assert_error(r: httpx.Response, status: int, param: str | None = None, contains: list[str] = ()) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["code"] == status and isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    if param is not None:
        assert err["param"] == param, err
    for text in contains:
        assert text in err["message"], err
    return err


def sse_events(lines) -> list:
    events = []
    for line in lines:
        if not line.startswith("data: "):
            continue
        data = line[len("data: ") :]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


def _closed(node):
    """A copy of an OpenAPI schema where every object schema refuses properties it does not declare: a field
    the server sends and does not document fails the check instead of passing unseen."""
    if isinstance(node, list):
        return [_closed(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: _closed(v) for k, v in node.items()}
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def assert_as_declared(spec: dict, path: str, method: str, r: httpx.Response, events: list | None = None) -> int:
    """The response's JSON (or every event of a stream: `events`, as sse_events reads them) validates against the
    schema /openapi.json (`spec`) declares for this route, status and content type; how many bodies it checked."""
    import jsonschema

    media = r.headers["content-type"].split(";")[0]
    declared = spec["paths"][path][method]["responses"][str(r.status_code)]["content"][media]["schema"]
    validator = jsonschema.Draft202012Validator({**declared, "components": _closed(spec["components"])})
    bodies = [e for e in events if e != "[DONE]"] if events is not None else [r.json()]
    for body in bodies:
        errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(body)]
        assert not errors, f"{method.upper()} {path} {r.status_code} {media}: {errors} in {body}"
    return len(bodies)
