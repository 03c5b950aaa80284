"""Hostile and broken clients, each against a real server: what one bad request used to do (kill the engine, leak a
block, freeze the event loop, answer 500, get silently ignored) and must not do again.

One in-process server in float32 with a tiny KV budget (24 blocks: long prompts preempt each other) and a
2 MiB body limit serves every test; each ends with the block pool whole and the server still answering.
"""

from __future__ import annotations

import json
import math
import socket
import threading

import httpx
import pytest
from server_helpers import (
    AUTH,
    FAULT_ENGINE_ARGS,
    HANG_S,
    StepHold,
    assert_error,
    assert_pool_whole,
    running_server,
    sse_events,
    tiny_kv_budget,
)

from pagedllm.engine.blend import segment_store

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

MAX_REQUEST_BYTES = 2 * 2**20
JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def fault_server(model_fp32):
    from pagedllm.engine import EngineConfig, LLMEngine
    from pagedllm.engine.async_engine import AsyncLLMEngine

    engine = AsyncLLMEngine(
        LLMEngine(EngineConfig(kv_cache_memory=tiny_kv_budget(), **FAULT_ENGINE_ARGS), loaded=model_fp32),
        max_waiting_requests=16,
    )
    with running_server(engine, served_model_name=["m"], max_request_bytes=MAX_REQUEST_BYTES) as s:
        yield s


def complete(s, **body) -> httpx.Response:
    return s.http.post("/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 4, **body})


def assert_serving(s) -> None:
    """The server answers, generates, and every block came back."""
    assert s.http.get("/health").json() == {"status": "ok"}
    r = complete(s, temperature=0)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
    assert_pool_whole(s)


# ------------------------------------------------------------------------------- numerically extreme sampling
NUMERIC_EDGES = [
    dict(temperature=1e-300),
    dict(temperature=1e-45),
    dict(temperature=5e-324),
    dict(repetition_penalty=1e-300, temperature=1),
    dict(top_p=1e-300, temperature=1),
    dict(temperature=1e-300, stream=True),
]


@pytest.mark.parametrize(
    "params", NUMERIC_EDGES, ids=["-".join(f"{k}={v}" for k, v in p.items()) for p in NUMERIC_EDGES]
)
def test_numerically_extreme_sampling_is_served(fault_server, params):
    """Each once killed the engine loop for good (every later request a 503)."""
    params = dict(params)
    stream = params.pop("stream", False)
    r = complete(fault_server, stream=stream, **params)
    assert r.status_code == 200, r.text
    if stream:
        events = sse_events(r.text.splitlines())
        assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1]), events
        assert events[-2]["choices"][0]["finish_reason"] == "length"
    else:
        assert r.json()["choices"][0]["finish_reason"] == "length"
    assert_serving(fault_server)


def test_top_k_beyond_int32_is_a_400(fault_server):
    assert_error(complete(fault_server, top_k=2**70), 400, "top_k")
    assert_serving(fault_server)


# ------------------------------------------------------------------------------- a refused request leaks nothing
def test_largest_seed_with_n_2_leaves_nothing_behind(fault_server):
    r = complete(fault_server, seed=2**64 - 1, n=2, temperature=1, ignore_eos=True)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 2
    assert_error(complete(fault_server, seed=2**64, n=2), 400, "seed")
    assert_pool_whole(fault_server)


# ------------------------------------------------------------------------------- body size, the event loop, the key
def test_oversized_body_is_a_413_before_parsing(fault_server):
    big = b'{"prompt": "' + b"a" * MAX_REQUEST_BYTES + b'"}'
    assert_error(fault_server.http.post("/v1/completions", content=big), 413)

    def chunked():  # no Content-Length: the running count must stop it
        for i in range(0, len(big), 65536):
            yield big[i : i + 65536]

    assert_error(fault_server.http.post("/tokenize", content=chunked(), headers=JSON), 413)
    assert_serving(fault_server)


def test_tokenizing_a_long_text_does_not_block_the_event_loop(fault_server, monkeypatch):
    """While a long text is being tokenized, /health is answered: the tokenizer holds until it is, so a server that
    tokenized on its event loop would never answer it during the tokenization (events, not a time bound)."""
    text = "the quick brown fox jumps over the lazy dog. " * (MAX_REQUEST_BYTES // 60)
    tokenizer = fault_server.engine.tokenizer
    real_encode, tokenizing, health_answered, overlapped = tokenizer.encode, threading.Event(), threading.Event(), []

    def encode(prompt, *args, **kwargs):
        if prompt == text:
            tokenizing.set()
            overlapped.append(health_answered.wait(60))  # False: /health waited for this tokenization
        return real_encode(prompt, *args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", encode)
    result = {}
    worker = threading.Thread(
        target=lambda: result.update(r=fault_server.http.post("/tokenize", json={"prompt": text}))
    )
    worker.start()
    assert tokenizing.wait(60)
    assert fault_server.http.get("/health").status_code == 200
    health_answered.set()
    worker.join()
    assert overlapped == [True], "/health was answered only after the tokenization"
    assert result["r"].status_code == 200 and result["r"].json()["count"] > 100_000


# A web page may post these to a local server without a CORS preflight (a form, fetch's text/plain or untyped
# Blob body); only application/json needs one.
NOT_JSON = [
    "text/plain",
    "text/plain;charset=UTF-8",
    "application/x-www-form-urlencoded",
    "multipart/form-data; boundary=x",
    "application/jsonp",
    None,
]


@pytest.mark.parametrize("kind", NOT_JSON)
def test_a_body_that_is_not_labelled_json_is_a_415_on_every_post_route(fault_server, kind, monkeypatch):
    """Issue 38.5: a JSON body sent as anything but application/json is answered 415 before it is read, on every
    POST route /openapi.json lists, and nothing reaches the engine; application/json with a charset is served."""
    from pagedllm.server.serving_engine import ServingContext

    s, submitted, submit = fault_server, [], ServingContext.submit

    async def recorded(self, prompts, *args, **kwargs):
        submitted.append(prompts)
        return await submit(self, prompts, *args, **kwargs)

    monkeypatch.setattr(ServingContext, "submit", recorded)
    posts = [p for p, ops in s.http.get("/openapi.json").json()["paths"].items() if "post" in ops]
    assert {"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages", "/tokenize"} <= set(posts)
    body = json.dumps({"prompt": "hi", "max_tokens": 2, "input": "hi", "messages": [{"role": "user", "content": "x"}]})
    for path in posts:
        r = httpx.post(s.base + path, content=body, headers={**AUTH, **({"Content-Type": kind} if kind else {})})
        assert r.status_code == 415, (path, r.status_code, r.text)
        err = r.json()["error"]
        assert "application/json" in err["message"] and (path == "/v1/messages") == ("param" not in err), err
    assert submitted == []
    good = json.dumps({"prompt": "hi", "max_tokens": 2})
    ok = s.http.post("/v1/completions", content=good, headers={"Content-Type": "application/json; charset=utf-8"})
    assert ok.status_code == 200 and len(submitted) == 1, ok.text
    assert_pool_whole(s)


def test_tokenize_and_detokenize_need_the_key(fault_server):
    for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]})):
        assert_error(httpx.post(fault_server.base + path, json=body), 401)
        assert fault_server.http.post(path, json=body).status_code == 200
    assert httpx.get(fault_server.base + "/health").status_code == 200  # open, as vLLM's


# ------------------------------------------------------------------------------- malformed input is a 4xx
MALFORMED = [
    ("lone surrogate", '{"prompt": "a\\ud800b", "max_tokens": 1}', "prompt"),
    ("lone surrogate in a chat message", '{"messages": [{"role": "user", "content": "\\udfff"}]}', "messages"),
    ("100,000 nested brackets", '{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}", None),
    ("5,000-digit max_tokens", '{"prompt": "hi", "max_tokens": ' + "9" * 5000 + "}", None),
    ("4,000-digit max_tokens", '{"prompt": "hi", "max_tokens": ' + "9" * 4000 + "}", "max_tokens"),
]


@pytest.mark.parametrize("body,param", [m[1:] for m in MALFORMED], ids=[m[0] for m in MALFORMED])
def test_malformed_input_is_a_400_and_keeps_the_connection(fault_server, body, param):
    """Each used to be a 500 that also reset the next request on the same keep-alive connection."""
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    good = json.dumps({"prompt": "hi", "max_tokens": 1}).encode()
    with socket.create_connection(("127.0.0.1", fault_server.port), timeout=HANG_S) as sock:
        reader = sock.makefile("rb")
        first = _exchange(sock, reader, path, body.encode())
        second = _exchange(sock, reader, "/v1/completions", good)
    assert first[0] == 400, first
    err = json.loads(first[1])["error"]
    assert param is None or err["param"] == param, err
    assert second[0] == 200, second
    assert_pool_whole(fault_server)


def test_an_unexpected_error_is_a_500_that_keeps_the_connection(fault_server, monkeypatch):
    """A bug's 500 is logged and answered without dropping the keep-alive connection (Starlette's own error
    middleware re-raises, and uvicorn then closes it)."""
    from pagedllm.server.serving_engine import ServingContext

    def broken(self, model):
        raise RuntimeError("a bug")

    monkeypatch.setattr(ServingContext, "check_model", broken)
    with socket.create_connection(("127.0.0.1", fault_server.port), timeout=HANG_S) as sock:
        reader = sock.makefile("rb")
        first = _exchange(sock, reader, "/v1/completions", b'{"prompt": "hi", "max_tokens": 1}')
        monkeypatch.undo()
        second = _exchange(sock, reader, "/v1/completions", b'{"prompt": "hi", "max_tokens": 1}')
    assert first[0] == 500 and b"a bug" in first[1], first
    assert second[0] == 200, second


def _exchange(sock: socket.socket, reader, path: str, body: bytes) -> tuple[int, bytes]:
    """One HTTP/1.1 request on a kept-alive connection; (status, body)."""
    head = (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Authorization: {AUTH['Authorization']}\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    sock.sendall(head + body)
    status = int(reader.readline().split()[1])
    length = 0
    while (line := reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode().partition(":")
        if name.lower() == "content-length":
            length = int(value)
    return status, reader.read(length)


# ------------------------------------------------------------------------------- a field is honoured or refused by name
REFUSED = [
    ("best_of 5", {"best_of": 5}, "best_of"),
    ("best_of -1", {"best_of": -1}, "best_of"),
    ("logit_bias key not an id", {"logit_bias": {"abc": 5}}, "logit_bias"),
    ("logit_bias id past the vocabulary", {"logit_bias": {"999999": 5}}, "logit_bias"),
    (
        "response_format json_schema that does not compile",
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
        "response_format",
    ),
    ("response_format of an unknown type", {"response_format": {"type": "yaml"}}, "response_format"),
    ("booleans as token ids", {"prompt": [True, False]}, "prompt"),
    ("temperature Infinity", "Infinity", "temperature"),
    ("temperature 1e400", "1e400", "temperature"),
    ("min_tokens 2**70", {"min_tokens": 2**70, "max_tokens": None}, "min_tokens"),
    ("n over --max-waiting-requests", {"n": 17}, "n"),
    # issue 28: vLLM's request fields, each checked before anything is queued
    ("priority without --scheduling-policy priority", {"priority": 3}, "priority"),
    ("priority not an integer", {"priority": 1.5}, "priority"),
    ("allowed_token_ids past the vocabulary", {"allowed_token_ids": [999999]}, "allowed_token_ids"),
    ("allowed_token_ids empty", {"allowed_token_ids": []}, "allowed_token_ids"),
    ("bad_words of whitespace", {"bad_words": ["  "]}, "bad_words"),
    ("bad_words not strings", {"bad_words": [3]}, "bad_words"),
    ("truncate_prompt_tokens over max_model_len", {"truncate_prompt_tokens": 10**6}, "truncate_prompt_tokens"),
    ("truncate_prompt_tokens 0", {"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ("cache_salt empty", {"cache_salt": ""}, "cache_salt"),
    ("use_beam_search", {"use_beam_search": True}, "use_beam_search"),
    ("prompt_embeds", {"prompt_embeds": "AAAA"}, "prompt_embeds"),
    ("kv_blend recompute as a string", {"kv_blend": {"segments": [[0, 1]], "recompute": "0.1"}}, "kv_blend"),
]


@pytest.mark.parametrize("extra,param", [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED])
def test_fields_not_honoured_are_refused_by_name(fault_server, extra, param):
    if isinstance(extra, str):  # a JSON number Python's json.dumps cannot write
        body = f'{{"prompt": "hi", "temperature": {extra}}}'
        r = fault_server.http.post("/v1/completions", content=body, headers=JSON)
    else:
        r = complete(fault_server, **extra)
    assert_error(r, 400, param)
    assert_pool_whole(fault_server)


@pytest.mark.parametrize(
    "key",
    ["\u00b2", "\u2460", "\u0661\u0662", "\uff11\uff12"],
    ids=["superscript two", "circled one", "arabic-indic 12", "fullwidth 12"],
)
def test_logit_bias_keys_of_non_ascii_digits_are_refused_by_name(fault_server, key):
    """str.isdigit() holds for each: int() then failed outside the validator on the first two (a 500) and silently
    read the others as token 12."""
    assert_error(complete(fault_server, logit_bias={key: 5}), 400, "logit_bias")
    assert_pool_whole(fault_server)


def test_a_kv_snapshot_that_waits_past_a_slow_step_is_a_503(fault_server, monkeypatch):
    """/v1/kv/blocks waits for the engine thread between two steps; when a step outlasts the wait, the answer is
    the 503 its OpenAPI entry promises (it was a 500 with an empty message), and the server goes on."""
    from pagedllm.server import kv_page

    core = fault_server.engine.engine
    real_step, entered, release = core.step, threading.Event(), threading.Event()

    def slow_step():
        entered.set()
        release.wait(60)
        return real_step()

    monkeypatch.setattr(core, "step", slow_step)
    monkeypatch.setattr(kv_page, "ENGINE_WAIT_S", 0.2, raising=False)
    worker = threading.Thread(target=complete, args=(fault_server,))
    worker.start()
    try:
        assert entered.wait(60)
        err = assert_error(fault_server.http.get("/v1/kv/blocks"), 503)
        assert "step" in err["message"], err
    finally:
        release.set()
        worker.join(60)
    assert fault_server.http.get("/v1/kv/blocks").status_code == 200
    assert_serving(fault_server)


CHAT_REFUSED = [
    ("role wizard", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    (
        "tools with tool_choice auto, a template without tools",
        {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto"},
        "tool_choice",
    ),
    (
        "named tool_choice without tools",
        {"tool_choice": {"type": "function", "function": {"name": "f"}}},
        "tool_choice",
    ),
    ("echo", {"echo": True}, "echo"),
    ("a request chat_template on a server that does not trust them", {"chat_template": "{{ 1 }}"}, "chat_template"),
    (
        "chat_template_kwargs the server sets",
        {"chat_template_kwargs": {"add_generation_prompt": False}},
        "chat_template_kwargs",
    ),
    ("continue_final_message with add_generation_prompt", {"continue_final_message": True}, "continue_final_message"),
    ("reasoning_effort", {"reasoning_effort": "high"}, "reasoning_effort"),
]


@pytest.mark.parametrize("extra,param", [r[1:] for r in CHAT_REFUSED], ids=[r[0] for r in CHAT_REFUSED])
def test_chat_fields_not_honoured_are_refused_by_name(fault_server, extra, param):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra}
    assert_error(fault_server.http.post("/v1/chat/completions", json=body), 400, param)
    assert_pool_whole(fault_server)


def test_logit_bias_is_honoured(fault_server):
    """+100 on one token makes greedy decoding pick it every time; 1e9 is clamped to 100, as OpenAI does."""
    token = fault_server.http.post("/tokenize", json={"prompt": " banana"}).json()["tokens"][-1]
    for bias in (100, 1e9):
        r = complete(fault_server, temperature=0, logit_bias={str(token): bias}, logprobs=0)
        assert r.status_code == 200, r.text
        tokens = r.json()["choices"][0]["logprobs"]["tokens"]
        assert tokens == [" banana"] * 4, tokens


def test_scoring_echo_logprobs_max_tokens_0(fault_server):
    """lm-evaluation-harness's loglikelihood request: the prompt's tokens with their logprobs, first None."""
    prompt = "The capital of France is Paris"
    ids = fault_server.http.post("/tokenize", json={"prompt": prompt}).json()["tokens"]
    r = complete(fault_server, prompt=prompt, max_tokens=0, echo=True, logprobs=1, temperature=0)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"] == prompt and choice["finish_reason"] == "length"
    assert len(lp["tokens"]) == len(ids) and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(v < 0 and math.isfinite(v) for v in lp["token_logprobs"][1:])
    assert all(len(top) >= 1 for top in lp["top_logprobs"][1:])
    # The same numbers as prompt_logprobs, vLLM's own field.
    r2 = complete(fault_server, prompt=prompt, max_tokens=1, prompt_logprobs=0, temperature=0)
    plp = r2.json()["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids)
    assert [plp[i][str(t)]["logprob"] for i, t in enumerate(ids) if i] == pytest.approx(
        lp["token_logprobs"][1:], abs=1e-4
    )
    # echo + logprobs with generation: the prompt's part comes first, then the generated tokens'.
    r3 = complete(fault_server, prompt=prompt, max_tokens=2, echo=True, logprobs=1, temperature=0)
    lp3 = r3.json()["choices"][0]["logprobs"]
    assert len(lp3["tokens"]) == len(ids) + 2 and lp3["token_logprobs"][0] is None
    assert_pool_whole(fault_server)


# ------------------------------------------------------------------------------- the schema, /health, names
def test_openapi_schema_has_bodies_and_errors(fault_server):
    spec = fault_server.http.get("/openapi.json").json()
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        op = spec["paths"][path]["post"]
        assert "requestBody" in op and op["requestBody"]["required"], path
        assert {"200", "400", "401", "413", "503"} <= set(op["responses"]), (path, op["responses"].keys())
    schemas = spec["components"]["schemas"]
    assert {"temperature", "logit_bias", "prompt_logprobs", "best_of"} <= set(
        schemas["CompletionRequest"]["properties"]
    )


def test_health_body_and_detokenize_param(fault_server):
    r = httpx.get(fault_server.base + "/health")
    assert r.headers["content-type"] == "application/json" and r.json() == {"status": "ok"}
    assert_error(fault_server.http.post("/detokenize", json={"tokens": [10**9]}), 400, "tokens")


# ------------------------------------------------------------------------------- the engine loop itself dies
def test_engine_death_fails_streams_and_exits_non_zero(model_fp32):
    """Not a request's failure (those fail the request alone) but the loop's: every stream in flight gets an error
    event and [DONE], and the server stops with exit status 1 so that a supervisor restarts it (as vLLM). The
    steps are held after the first token, so the stream is still in flight when the engine breaks on any CPU."""
    from pagedllm.engine import EngineConfig, LLMEngine
    from pagedllm.engine.async_engine import AsyncLLMEngine

    core = LLMEngine(EngineConfig(kv_cache_memory=tiny_kv_budget(), **FAULT_ENGINE_ARGS), loaded=model_fp32)
    engine = AsyncLLMEngine(core)

    def broken_step():
        raise RuntimeError("the engine itself is broken")

    with running_server(engine) as s, StepHold(engine) as hold:
        hold.allow(1)  # the first token; then the stream waits, in flight, until the engine breaks
        with s.http.stream(
            "POST",
            "/v1/completions",
            json={"prompt": "Tell me a story", "max_tokens": 200, "ignore_eos": True, "stream": True},
        ) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            hold.inner = broken_step
            hold.release()
            events = sse_events(lines)
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == 503, events[-3:]
        s.server._thread.join(30)
        assert not s.server._thread.is_alive() and s.server.exit_code == 1
        with pytest.raises(httpx.HTTPError):
            httpx.get(s.base + "/health", timeout=2)


# ------------------------------------------------------------------------------- one request's failure
POISON = 7777  # a token id only the failing request's prompt holds


def _poisoned_runner(core, monkeypatch) -> None:
    """The model step raises whenever the failing request's prompt is in the batch, as a bug would."""
    execute = core.runner.execute

    def failing(chunks, *args, **kwargs):
        if any(POISON in c.token_ids for c in chunks):
            raise RuntimeError("injected model-step failure")
        return execute(chunks, *args, **kwargs)

    monkeypatch.setattr(core.runner, "execute", failing)


def _poisoned_sampler(core, monkeypatch) -> None:
    """Sampling raises for the failing request's row, as a numerically broken row once did."""
    from pagedllm.engine import fault_isolation

    sample = fault_isolation.sample

    def failing(logits, rows, *args, **kwargs):
        if any(POISON in row.prompt_ids for row in rows):
            raise RuntimeError("injected sampling failure")
        return sample(logits, rows, *args, **kwargs)

    monkeypatch.setattr(fault_isolation, "sample", failing)


def _once(cond):
    """True from the first time `cond()` is: a gate that stays open once opened."""
    opened = []
    return lambda: bool(opened) or (cond() and not opened.append(True))


@pytest.mark.parametrize("inject", [_poisoned_runner, _poisoned_sampler], ids=["model step", "sampling"])
def test_one_failing_request_fails_alone(model_fp32, monkeypatch, inject):
    """Three requests in one batch, one of which makes the step fail: it gets an error, the other two the very
    tokens they get alone (float32, greedy), and the server goes on serving."""
    from pagedllm.engine import EngineConfig, LLMEngine
    from pagedllm.engine.async_engine import AsyncLLMEngine

    core = LLMEngine(EngineConfig(kv_cache_memory=tiny_kv_budget(), **FAULT_ENGINE_ARGS), loaded=model_fp32)
    with running_server(AsyncLLMEngine(core)) as s:
        prompts = [[1, 504, 3821, 314, POISON, 2], "The capital of France is", "Once upon a time there"]
        body = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}
        alone = [complete(s, prompt=p, **body).json()["choices"][0]["text"] for p in prompts[1:]]
        inject(core, monkeypatch)

        def send(p):
            return complete(s, prompt=p, **body)

        threads_out: list = [None] * 3
        workers = [threading.Thread(target=lambda i=i: threads_out.__setitem__(i, send(prompts[i]))) for i in range(3)]
        with StepHold(s.engine) as hold:  # no step until all three are in: one batch, whatever the CPU's speed
            hold.run_while = _once(lambda: len(core.parents) == 3)
            for w in workers:
                w.start()
            for w in workers:
                w.join(HANG_S)
        failed, *served = threads_out
        assert_error(failed, 500, contains=["injected"])
        assert [r.json()["choices"][0]["text"] for r in served] == alone
        assert_serving(s)


def test_a_cut_kv_blend_stream_frees_its_blocks_and_passage_holds(fault_server):
    """A kv_blend request that copies stored passages, its stream cut while it runs: the abort returns its blocks
    and the holds on the passages it copied from, and the same passages are then served again from the store."""
    passages = [[2000 + 100 * i + j for j in range(40)] for i in range(3)]

    def prompt(order):
        ids, spans = [11, 12, 13], []
        for i in order:
            spans.append([len(ids), len(ids) + 40])
            ids += passages[i]
        return ids + [17, 18], spans

    a, spans_a = prompt([0, 1, 2])
    r = complete(fault_server, prompt=a, temperature=0, kv_blend={"segments": spans_a, "recompute": 0.0})
    assert r.status_code == 200, r.text
    b, spans_b = prompt([2, 0, 1])
    body = {"prompt": b, "max_tokens": 60, "ignore_eos": True, "stream": True, "temperature": 0}
    body["kv_blend"] = {"segments": spans_b, "recompute": 0.0}
    core = fault_server.engine.engine  # the LLMEngine; read between requests, when its thread is idle
    with StepHold(fault_server.engine) as hold:
        hold.allow(12)  # the prompt's compute spans (one step each, its copies between them) and a few tokens
        with httpx.Client(base_url=fault_server.base, headers={**AUTH, "X-Request-Id": "cut-blend"}, timeout=60) as c:
            with c.stream("POST", "/v1/completions", json=body) as resp:
                assert resp.status_code == 200
                for line in resp.iter_lines():
                    if line.startswith("data: "):
                        break  # the client is gone with 50 tokens or more to go
        hold.wait_abort("cmpl-cut-blend")
    assert_pool_whole(fault_server)
    assert not any(segment_store(core.kv).holds.values())
    before = core.prompt_tokens
    again = complete(fault_server, prompt=b, temperature=0, kv_blend={"segments": spans_b, "recompute": 0.0})
    assert again.status_code == 200, again.text
    assert core.prompt_tokens - before < len(b) - 64  # the passages' full blocks copied, not computed
    assert_serving(fault_server)
