"""The OpenAI-compatible server, end to end: a real server on a loopback port with the default model.

One in-process server (uvicorn in a thread, real socket, API key set) serves most tests; a second one in
process, with one running and one waiting request allowed, covers 503; a `pagedllm serve` subprocess covers
the key from the environment and SIGTERM. A test that needs a request still running holds the engine's steps
(server_helpers.StepHold), never a token count against a timeout: no test rests on the CPU's speed. The official
`openai` client drives completions and chat; raw httpx does the rest. Every bad input must leave the block pool
whole, checked through the debug route GET /v1/kv.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import time
from types import SimpleNamespace

import httpx
import openai
import pytest
from server_helpers import (
    AUTH,
    HANG_S,
    KEY,
    StepHold,
    assert_error,
    assert_pool_whole,
    kv,
    running_server,
    sse_events,
)

from pagedllm.bench.server_process import free_port, serve

os.environ.setdefault("HF_HUB_OFFLINE", "1")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

MODEL = "SmolLM2-135M-Instruct"
MAX_MODEL_LEN = 256
ENGINE_ARGS = dict(max_model_len=MAX_MODEL_LEN, kv_cache_memory=64 * 2**20, log_stats_interval=0)


# ---------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def server():
    from pagedllm.engine import EngineConfig, LLMEngine
    from pagedllm.engine.async_engine import AsyncLLMEngine
    from pagedllm.server.api_server import Server, build_app
    from pagedllm.server.config import ServerConfig

    engine = AsyncLLMEngine(LLMEngine(EngineConfig(**ENGINE_ARGS)), max_waiting_requests=256)
    app = build_app(engine, ServerConfig(served_model_name=[MODEL], api_key=KEY))
    srv = Server(app, host="127.0.0.1", port=0, log_level="warning")
    srv.start_in_thread()
    port = srv.uvicorn.servers[0].sockets[0].getsockname()[1]
    base = f"http://127.0.0.1:{port}"
    http = httpx.Client(base_url=base, headers=AUTH, timeout=60)
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=60)
    try:
        yield SimpleNamespace(base=base, http=http, client=client, engine=engine)
    finally:
        http.close()
        srv.stop()
    assert not engine.is_running


def n_tokens(s, text: str) -> int:
    r = s.http.post("/tokenize", json={"model": MODEL, "prompt": text})
    assert r.status_code == 200, r.text
    return r.json()["count"]


def metric(s, name: str) -> float:
    text = s.http.get("/metrics").text
    total = 0.0
    found = False
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
            found = True
    assert found, f"{name} not in /metrics"
    return total


# ---------------------------------------------------------------------------------------------- basics
def test_health_models_metrics(server):
    assert httpx.get(server.base + "/health").json() == {"status": "ok"}  # no key needed
    models = server.client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    text = httpx.get(server.base + "/metrics").text  # open, like /health
    for name in [
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:num_preemptions_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:e2e_request_latency_seconds_bucket",
    ]:
        assert re.search(rf"^{re.escape(name)}[{{ ]", text, re.M), name
    state = kv(server)
    assert state["total_blocks"] > 0 and state["block_size"] == 16


def test_auth(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.post(server.base + "/v1/completions", json={"model": MODEL, "prompt": "hi"}, headers=headers)
        assert_error(r, 401)
        assert_error(httpx.get(server.base + "/v1/models", headers=headers), 401)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.base + "/v1", api_key="wrong", max_retries=0).models.list()
    assert httpx.get(server.base + "/health").status_code == 200
    assert_pool_whole(server)


def test_tokenize_detokenize(server):
    r = server.http.post("/tokenize", json={"model": MODEL, "prompt": "Hello world"})
    body = r.json()
    assert body["count"] == len(body["tokens"]) > 0 and body["max_model_len"] == MAX_MODEL_LEN
    r2 = server.http.post("/detokenize", json={"model": MODEL, "tokens": body["tokens"]})
    assert r2.json() == {"prompt": "Hello world"}
    chat = server.http.post("/tokenize", json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]})
    assert chat.json()["count"] > body["count"]  # the template adds its own tokens
    assert_error(server.http.post("/detokenize", json={"tokens": [10**9]}), 400, "tokens")


# ---------------------------------------------------------------------------------------------- generation
PROMPT = "The capital of France is"


def test_completion_and_stream_agree(server):
    c = server.client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    assert c.object == "text_completion" and c.model == MODEL and len(c.choices) == 1
    assert c.choices[0].finish_reason == "length" and c.choices[0].text
    n_prompt = n_tokens(server, PROMPT)
    assert (c.usage.prompt_tokens, c.usage.completion_tokens, c.usage.total_tokens) == (n_prompt, 6, n_prompt + 6)
    assert n_prompt < 16 and c.usage.prompt_tokens_details.cached_tokens == 0  # no full block to share

    chunks = list(
        server.client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == c.choices[0].text
    finals = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert chunks[-1].usage.prompt_tokens == n_prompt
    assert all(ch.usage is None for ch in chunks[:-1])
    assert_pool_whole(server)


def test_continuous_usage_stats_on_every_chunk(server):
    """vLLM's stream_options.continuous_usage_stats: usage on every chunk, completion tokens counting up."""
    chunks = list(
        server.client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Count to ten."}],
            max_tokens=5,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
            extra_body={"ignore_eos": True},
        )
    )
    content = [ch for ch in chunks if ch.choices and ch.choices[0].delta.content]
    assert content and all(ch.usage is not None for ch in content)
    counts = [ch.usage.completion_tokens for ch in content]
    assert counts == sorted(counts) and counts[-1] == 5
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert_pool_whole(server)


def test_raw_stream_ends_with_done(server):
    with server.http.stream(
        "POST", "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "stream": True}
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]" and all(isinstance(e, dict) for e in events[:-1])
    assert all(e["object"] == "text_completion" for e in events[:-1])


def test_completion_prompt_forms_n_logprobs(server):
    ids = server.http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    c = server.client.completions.create(
        model=MODEL, prompt=[PROMPT, "Once upon a time"], max_tokens=2, n=2, temperature=0.8, seed=1, logprobs=2
    )
    assert sorted(ch.index for ch in c.choices) == [0, 1, 2, 3]
    for ch in c.choices:
        assert len(ch.logprobs.tokens) == len(ch.logprobs.token_logprobs) == 2
        assert all(len(top) == 2 for top in ch.logprobs.top_logprobs)
        assert all(lp <= 0 for lp in ch.logprobs.token_logprobs)
    assert c.usage.completion_tokens == sum(len(ch.logprobs.tokens) for ch in c.choices)
    by_ids = server.client.completions.create(model=MODEL, prompt=ids, max_tokens=3, temperature=0)
    by_text = server.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    two = server.client.completions.create(model=MODEL, prompt=[ids, ids], max_tokens=3, temperature=0)
    assert [ch.text for ch in two.choices] == [by_text.choices[0].text] * 2
    greedy = by_text.choices[0].text
    word = greedy.strip()[:2]
    assert word, greedy
    stop = server.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, stop=[word])
    assert (stop.choices[0].finish_reason, stop.choices[0].model_extra["stop_reason"]) == ("stop", word)
    assert stop.choices[0].text == greedy[: greedy.index(word)]
    extras = server.client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=3,
        temperature=0.7,
        seed=3,
        extra_body={"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.1, "min_tokens": 3, "ignore_eos": True},
        presence_penalty=0.1,
        frequency_penalty=0.1,
        user="u1",
    )
    assert extras.choices[0].finish_reason == "length" and extras.usage.completion_tokens == 3
    assert_pool_whole(server)


def test_chat(server):
    messages = [{"role": "user", "content": "Say hello."}]
    # Both requests below then take the same prefix from the cache: a cold prefill and a cached one may round
    # differently in bfloat16, and this test is about the server's streaming, not about that.
    server.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, temperature=0)
    c = server.client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2
    )
    msg = c.choices[0].message
    assert c.object == "chat.completion" and msg.role == "assistant" and msg.content
    assert len(c.choices[0].logprobs.content) == c.usage.completion_tokens <= 5
    n_prompt = server.http.post("/tokenize", json={"messages": messages}).json()["count"]
    assert c.usage.prompt_tokens == n_prompt

    stream = server.client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_completion_tokens=5,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(ch.object == "chat.completion.chunk" for ch in chunks)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == msg.content
    assert chunks[-1].usage.completion_tokens == c.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == n_prompt
    assert_pool_whole(server)


def test_greedy_matches_offline_llm(server):
    from pagedllm import LLM, SamplingParams

    prompt = "List three colors of the rainbow:"
    c = server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0)
    llm = LLM(**ENGINE_ARGS)
    try:
        out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[0]
    finally:
        del llm
    assert c.choices[0].text == out.outputs[0].text
    assert c.usage.completion_tokens == len(out.outputs[0].token_ids)


def test_32_concurrent_streams(server):
    async def main():
        client = openai.AsyncOpenAI(base_url=server.base + "/v1", api_key=KEY, max_retries=0, timeout=120)

        async def one(i):
            prompt = f"Request {i}: the number after {i} is"
            stream = await client.completions.create(
                model=MODEL,
                prompt=prompt,
                max_tokens=3,
                temperature=0.7,
                seed=i,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            text, usage, finish = "", None, None
            async for ch in stream:
                if ch.choices:
                    text += ch.choices[0].text
                    finish = ch.choices[0].finish_reason or finish
                if ch.usage is not None:
                    usage = ch.usage
            return prompt, text, usage, finish

        try:
            return await asyncio.gather(*(one(i) for i in range(32)))
        finally:
            await client.close()

    steps = server.engine.engine.stats().num_steps
    results = asyncio.run(main())
    steps = server.engine.engine.stats().num_steps - steps
    for prompt, text, usage, finish in results:
        assert finish == "length" and text
        assert usage.completion_tokens == 3
        assert usage.prompt_tokens == n_tokens(server, prompt)
        assert usage.total_tokens == usage.prompt_tokens + 3
    # One at a time, 32 requests of a prompt step and 2 decode steps each take 96 steps; batched, far fewer.
    assert steps < 32 * 3 // 2, f"requests were not batched together ({steps} steps)"
    assert_pool_whole(server)


def test_prefix_cache_hits(server):
    prefix = "You are a careful assistant. Answer briefly and precisely. " * 8
    assert n_tokens(server, prefix) >= 64
    hits_before = metric(server, "vllm:prefix_cache_hits_total")
    first = server.client.completions.create(
        model=MODEL, prompt=prefix + "Question one: what is 2+2?", max_tokens=1, temperature=0
    )
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    second = server.client.completions.create(
        model=MODEL, prompt=prefix + "Question two: name a fruit.", max_tokens=1, temperature=0
    )
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < second.usage.prompt_tokens
    assert metric(server, "vllm:prefix_cache_hits_total") >= hits_before + cached
    state = assert_pool_whole(server)
    # The shared prefix's blocks are free again but still cached: /v1/kv reads that from the engine's stats.
    assert state["cached_blocks"] >= cached // state["block_size"] > 0
    assert state["model_name"]


def test_client_disconnect_aborts(server):
    """A stream cut while its request runs aborts the request and frees its blocks. The engine makes three
    tokens and then holds its steps, so the request is still running when the client leaves on any CPU."""
    rid = f"disconnect-{time.monotonic_ns()}"
    body = {
        "model": MODEL,
        "prompt": "Write a very long story about a dragon.",
        "max_tokens": 200,
        "stream": True,
        "ignore_eos": True,
    }
    with StepHold(server.engine) as hold:
        hold.allow(3)  # the prompt's step and two decode steps: 3 tokens of 200
        with httpx.Client(base_url=server.base, headers={**AUTH, "X-Request-Id": rid}, timeout=60) as c:
            with c.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                got = 0
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        got += 1
                        if got == 2:
                            assert kv(server)["num_running"] == 1
                            break  # leaving the iterator closes the response: the client is gone
        hold.wait_abort(f"cmpl-{rid}")  # the server aborts, with at least 197 tokens to go
    wait_aborted(server, rid)
    assert_pool_whole(server)
    assert metric(server, "vllm:generation_tokens_total") > 0


def wait_aborted(s, rid: str) -> None:
    """Until the engine lists the request among those it aborted (not finished)."""
    deadline = time.monotonic() + HANG_S  # a hang guard: the abort is already asked for
    while not any(a.startswith(f"cmpl-{rid}") for a in kv(s)["recent_aborted_request_ids"]):
        assert time.monotonic() < deadline, kv(s)
        time.sleep(0.05)


def test_40_streams_cut_at_once_free_every_block(server):
    """The hostile client's case that held before issue 11 and must keep holding: 40 streams cut after their
    first event all free their blocks (finished or aborted, whichever the CPU's speed makes it)."""
    body = {
        "model": MODEL,
        "prompt": "Write a long story about the sea.",
        "max_tokens": 100,
        "ignore_eos": True,
        "stream": True,
    }

    async def cut(client):
        async with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    return

    async def main():
        async with httpx.AsyncClient(base_url=server.base, headers=AUTH, timeout=120) as client:
            await asyncio.gather(*(cut(client) for _ in range(40)))

    asyncio.run(main())
    assert_pool_whole(server)


def test_non_streaming_disconnect_aborts(server):
    """A client that leaves a non-streaming request aborts it. No step runs until the server asked for the
    abort, so the request cannot finish first however fast the CPU (before: 200 tokens had to outlast a 1.5 s
    read timeout, which they do not on a Zen 5); the client leaves by closing its socket."""
    rid = f"gone-{time.monotonic_ns()}"
    body = {"model": MODEL, "prompt": "Write a very long story about a cat.", "max_tokens": 200, "ignore_eos": True}
    with StepHold(server.engine) as hold:
        with socket.create_connection(("127.0.0.1", int(server.base.rsplit(":", 1)[1])), timeout=60) as sock:
            data = json.dumps(body).encode()
            head = (
                f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                f"X-Request-Id: {rid}\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
            )
            sock.sendall(head.encode() + data)
            hold.wait_held()  # the request is in the engine, and no token of it is made
            assert kv(server)["num_waiting"] + kv(server)["num_running"] == 1
        hold.wait_abort(f"cmpl-{rid}")
    wait_aborted(server, rid)
    assert_pool_whole(server)


# ---------------------------------------------------------------------------------------------- bad input
LONG_PROMPT = "hello " * (MAX_MODEL_LEN + 20)

BAD_COMPLETIONS = [
    ("malformed json", f'{{"model": "{MODEL}", "prompt": "hi",', 400, None),
    ("not an object", "[1, 2, 3]", 400, None),
    ("missing prompt", {"model": MODEL}, 400, "prompt"),
    ("prompt wrong type", {"model": MODEL, "prompt": 123}, 400, "prompt"),
    ("max_tokens wrong type", {"model": MODEL, "prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
    ("temperature wrong type", {"model": MODEL, "prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("stream wrong type", {"model": MODEL, "prompt": "hi", "stream": "yes"}, 400, "stream"),
    ("temperature < 0", {"model": MODEL, "prompt": "hi", "temperature": -0.5}, 400, "temperature"),
    ("top_p 0", {"model": MODEL, "prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("top_p > 1", {"model": MODEL, "prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ("max_tokens < 0", {"model": MODEL, "prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    ("n 0", {"model": MODEL, "prompt": "hi", "n": 0}, 400, "n"),
    ("n too large", {"model": MODEL, "prompt": "hi", "n": 1000}, 400, "n"),
    ("empty prompt list", {"model": MODEL, "prompt": []}, 400, "prompt"),
    ("token id out of range", {"model": MODEL, "prompt": [1, 10**9]}, 400, "prompt"),
    ("unknown model", {"model": "no-such-model", "prompt": "hi"}, 404, "model"),
    ("unknown model, streaming", {"model": "no-such-model", "prompt": "hi", "stream": True}, 404, "model"),
    ("logprobs too many", {"model": MODEL, "prompt": "hi", "logprobs": 50}, 400, "logprobs"),
]


@pytest.mark.parametrize("name,body,status,param", BAD_COMPLETIONS, ids=[b[0] for b in BAD_COMPLETIONS])
def test_bad_completion_input(server, name, body, status, param):
    if isinstance(body, str):
        r = server.http.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
    else:
        r = server.http.post("/v1/completions", json=body)
    assert_error(r, status, param)
    assert_pool_whole(server)


@pytest.mark.parametrize("stream", [False, True])
def test_prompt_longer_than_max_model_len(server, stream):
    n_prompt = n_tokens(server, LONG_PROMPT)
    assert n_prompt > MAX_MODEL_LEN
    r = server.http.post(
        "/v1/completions", json={"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 4, "stream": stream}
    )
    assert_error(r, 400, "prompt", contains=[str(MAX_MODEL_LEN), str(n_prompt)])
    # Fits alone, but not with the completion asked for.
    short = "hello " * (MAX_MODEL_LEN - 20)
    r = server.http.post("/v1/completions", json={"model": MODEL, "prompt": short, "max_tokens": 100})
    assert_error(r, 400, "max_tokens", contains=[str(MAX_MODEL_LEN)])
    with pytest.raises(openai.BadRequestError):
        server.client.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=4)
    assert_pool_whole(server)


BAD_CHAT = [
    ("empty messages", {"model": MODEL, "messages": []}, 400, "messages"),
    ("missing messages", {"model": MODEL}, 400, "messages"),
    ("messages wrong type", {"model": MODEL, "messages": "hello"}, 400, "messages"),
    ("message without role", {"model": MODEL, "messages": [{"content": "hi"}]}, 400, "messages"),
    (
        "temperature < 0",
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": -1},
        400,
        "temperature",
    ),
    (
        "max_completion_tokens < 0",
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": -1},
        400,
        "max_completion_tokens",
    ),
    ("unknown model", {"model": "gpt-17", "messages": [{"role": "user", "content": "hi"}]}, 404, "model"),
    (
        "too long",
        {"model": MODEL, "messages": [{"role": "user", "content": LONG_PROMPT}], "stream": True},
        400,
        "messages",
    ),
]


@pytest.mark.parametrize("name,body,status,param", BAD_CHAT, ids=[b[0] for b in BAD_CHAT])
def test_bad_chat_input(server, name, body, status, param):
    assert_error(server.http.post("/v1/chat/completions", json=body), status, param)
    assert_pool_whole(server)


def test_openai_client_errors_and_still_serving(server):
    with pytest.raises(openai.NotFoundError):
        server.client.completions.create(model="nope", prompt="hi", max_tokens=1)
    with pytest.raises(openai.BadRequestError):
        server.client.chat.completions.create(model=MODEL, messages=[], max_tokens=1)
    assert_error(server.http.get("/v1/no-such-route"), 404)
    c = server.client.completions.create(model=MODEL, prompt="hi", max_tokens=1)
    assert c.usage.completion_tokens == 1
    assert_pool_whole(server)


# ---------------------------------------------------------------------------------------------- subprocess
@pytest.fixture(scope="module")
def small_server(tmp_path_factory):
    """`pagedllm serve` with one running and one waiting request allowed; the key comes from the environment."""
    port = free_port()
    key = "sk-env-key"
    log = open(tmp_path_factory.mktemp("small") / "server.log", "w")
    proc = serve(
        port,
        "--max-num-seqs",
        "1",
        "--max-waiting-requests",
        "1",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--kv-cache-memory",
        "32MiB",
        "--log-level",
        "warning",
        timeout=180,
        log=log,
        env={"PAGEDLLM_API_KEY": key},
    )
    base = f"http://127.0.0.1:{port}"
    http = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=60)
    try:
        yield SimpleNamespace(base=base, http=http, proc=proc, key=key)
    finally:
        http.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


def _read_first_event(lines) -> dict:
    for line in lines:
        if line.startswith("data: "):
            return json.loads(line[6:])
    raise AssertionError("no event")


@pytest.fixture
def one_slot_server():
    """One running and one waiting request allowed (as `--max-num-seqs 1 --max-waiting-requests 1`), in this
    process so that a test can hold its engine's steps."""
    from pagedllm.engine import EngineConfig, LLMEngine
    from pagedllm.engine.async_engine import AsyncLLMEngine

    config = EngineConfig(**{**ENGINE_ARGS, "max_num_seqs": 1, "kv_cache_memory": 32 * 2**20})
    engine = AsyncLLMEngine(LLMEngine(config), max_waiting_requests=1)
    with running_server(engine, served_model_name=[MODEL]) as s:
        yield s


def test_too_many_waiting_requests_503(one_slot_server):
    """With one request running and one waiting, a third is refused with a 503. The engine makes the running
    request's first token and then holds its steps, so the running one cannot finish while the others are
    refused (before, it had to outlast them by its token count, which 100 tokens once did not)."""
    s = one_slot_server
    body = {"model": MODEL, "prompt": "Tell me a story.", "max_tokens": 100, "ignore_eos": True, "stream": True}
    with StepHold(s.engine) as hold, httpx.Client(base_url=s.base, headers=AUTH, timeout=60) as c:
        hold.allow(1)
        with c.stream("POST", "/v1/completions", json=body) as running:
            lines = running.iter_lines()  # kept: a dropped line iterator closes the response
            _read_first_event(lines)
            with httpx.Client(base_url=s.base, headers=AUTH, timeout=60) as c2:
                with c2.stream("POST", "/v1/completions", json=body) as waiting:
                    assert waiting.status_code == 200
                    deadline = time.monotonic() + HANG_S  # a hang guard: the add is applied while steps wait
                    while kv(s)["num_waiting"] < 1:
                        assert time.monotonic() < deadline, kv(s)
                        time.sleep(0.05)
                    assert kv(s)["num_running"] == 1
                    assert_error(s.http.post("/v1/completions", json={**body, "stream": False}), 503)
                    chat = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
                    assert_error(s.http.post("/v1/chat/completions", json=chat), 503)
    assert_pool_whole(s)
    r = s.http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 1})
    assert r.status_code == 200, r.text


def test_sigterm_graceful_shutdown(small_server):
    s = small_server
    assert_error(httpx.get(s.base + "/v1/models"), 401)  # the key from PAGEDLLM_API_KEY is enforced
    body = {"model": MODEL, "prompt": "Tell me a story.", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=s.base, headers={"Authorization": f"Bearer {s.key}"}, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            _read_first_event(lines)
            s.proc.send_signal(signal.SIGTERM)
            rest = sse_events(lines)
    assert rest[-1] == "[DONE]"  # the stream was ended, not cut
    assert s.proc.wait(timeout=60) == 0
    with pytest.raises(httpx.HTTPError):
        httpx.get(s.base + "/health", timeout=2)
