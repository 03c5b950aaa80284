"""What the server test files share: an in-process server on a loopback port, the block-pool check through
GET /v1/kv, the OpenAI error-body check and an SSE reader."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace

import httpx
import pytest
from engine_helpers import kv_budget

HANG_S = 120.0  # what a wait allows before the test fails as hung: never reached unless something is broken
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
    `pagedllm serve` without --api-key); `app_args`: ServerConfig's fields and build_app's keywords; stopped on
    exit."""
    from pagedllm.server.api_server import Server, build_app
    from pagedllm.server.config import ServerConfig

    fields = ServerConfig.__pydantic_fields__  # type: ignore[attr-defined]
    config = ServerConfig(api_key=api_key, **{k: v for k, v in app_args.items() if k in fields})
    app = build_app(engine, config, **{k: v for k, v in app_args.items() if k not in fields})
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


def assert_pool_whole(s) -> dict:
    """Nothing running or waiting and every KV block free (cached-but-unused blocks count as free), waited for
    (aborts are applied between steps) up to a hang guard."""
    deadline = time.monotonic() + HANG_S
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


class StepHold:
    """Holds the steps of a server's engine until the test lets them run: `allow(n)` lets n more steps run,
    `release()` all of them. A held step waits on the engine thread before it runs, and meanwhile applies the
    engine's queue as the loop does between two steps (adds, aborts, the reads of GET /v1/kv), so the server
    answers as usual while no token is made.

    Why: a test that needs a request still running when its client leaves (or still holding its slot while
    others are refused) must not bet on a token count outlasting a timeout; that bet fails on a fast CPU.
    Used as a context manager: on exit every step runs again and the engine's own `step` is back."""

    def __init__(self, engine) -> None:
        self.engine = engine  # an AsyncLLMEngine
        self.core = engine.engine
        self.held = threading.Event()  # set once a step waits
        self.inner = lambda: type(self.core).step(self.core)  # what a step runs once let through
        self.run_while: Callable[[], bool] = lambda: False  # steps also run while this holds (engine thread)
        self.started: set[str] = set()  # the requests that have made a token
        self._permits = 0
        self._released = False
        self._cond = threading.Condition()
        self._aborts: list[str] = []
        self._abort_seen = threading.Condition()

    def _step(self):
        with self._cond:
            while not self._released and self._permits == 0 and not self.run_while():
                self.held.set()
                self._cond.release()
                try:
                    self.engine._apply_ops(block=False)  # on the engine thread, as between two steps
                finally:
                    self._cond.acquire()
                self._cond.wait(0.005)  # woken at once by allow / release; the period only paces the queue reads
            self._permits = max(0, self._permits - 1)
        if not self.core.has_unfinished_requests():  # what it held was aborted meanwhile
            return []
        outputs = self.inner()
        self.started.update(out.request_id for out in outputs)
        return outputs

    def _abort(self, request_id: str) -> None:
        type(self.engine).abort(self.engine, request_id)
        with self._abort_seen:
            self._aborts.append(request_id)
            self._abort_seen.notify_all()

    def wait_abort(self, prefix: str) -> None:
        """Until the server has asked the engine to abort a request whose id starts with `prefix`."""
        with self._abort_seen:
            ok = self._abort_seen.wait_for(lambda: any(a.startswith(prefix) for a in self._aborts), HANG_S)
        assert ok, f"no abort of {prefix}* was asked for: {self._aborts}"

    def wait_held(self) -> None:
        """Until a step waits: the engine has something to run and runs nothing."""
        assert self.held.wait(HANG_S), "no step of the engine was held"

    def allow(self, n: int) -> None:
        with self._cond:
            self.held.clear()
            self._permits += n
            self._cond.notify_all()

    def release(self) -> None:
        with self._cond:
            self._released = True
            self._cond.notify_all()

    def __enter__(self) -> StepHold:
        self.core.step = self._step
        self.engine.abort = self._abort
        return self

    def __exit__(self, *exc) -> None:
        self.release()
        del self.core.step, self.engine.abort


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
    if media == "text/event-stream":  # one server-sent event (streaming.stream_schema): its data, the chunk's JSON
        declared = next(s["contentSchema"] for s in declared["properties"]["data"]["anyOf"] if "contentSchema" in s)
    validator = jsonschema.Draft202012Validator({**declared, "components": _closed(spec["components"])})
    bodies = [e for e in events if e != "[DONE]"] if events is not None else [r.json()]
    for body in bodies:
        errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(body)]
        assert not errors, f"{method.upper()} {path} {r.status_code} {media}: {errors} in {body}"
    return len(bodies)
