"""vLLM's request fields with vLLM's meaning (issue 28.5, 28.6): `cache_salt` keeps tenants' prefix blocks apart,
`priority` orders admission under `--scheduling-policy priority`, `bad_words`, `allowed_token_ids`,
`truncate_prompt_tokens`, `continue_final_message`, and a request's own `chat_template` only on a server started
with `--trust-request-chat-template` (rendered in Jinja's sandbox). A field vLLM or OpenAI define and pagedllm
does not serve is a 400 naming it; one nobody defines is ignored with one log line.
"""

from __future__ import annotations

import logging

import pytest
from engine_helpers import kv_budget
from server_helpers import assert_error, assert_pool_whole, running_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ENGINE_ARGS = dict(dtype="float32", max_model_len=256, max_num_seqs=8, log_stats_interval=0)
LONG = "The history of the city goes back many centuries, to a small village of farmers and fishers by the river. "


def _server(model_fp32, **app_args):
    from pagedllm.engine import EngineConfig, LLMEngine
    from pagedllm.engine.async_engine import AsyncLLMEngine

    engine = AsyncLLMEngine(LLMEngine(EngineConfig(kv_cache_memory=kv_budget(48), **ENGINE_ARGS), loaded=model_fp32))
    return running_server(engine, served_model_name=["m"], **app_args)


@pytest.fixture(scope="module")
def server(model_fp32):
    with _server(model_fp32) as s:
        yield s


def complete(s, **body):
    r = s.http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def chat(s, messages, **body):
    r = s.http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 4, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def cached(body: dict) -> int:
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


# ------------------------------------------------------------------------------------------------ cache_salt
def test_cache_salt_keeps_two_tenants_prefix_blocks_apart(server):
    """The same prompt under another salt shares no block; under the same salt it does (it was served another
    tenant's 1,088 cached tokens when the salt was dropped)."""
    prompt = "Tenant test. " + LONG * 2
    first = complete(server, prompt=prompt, cache_salt="tenant-a")
    assert first["usage"]["prompt_tokens"] > 32 and cached(first) == 0
    assert cached(complete(server, prompt=prompt, cache_salt="tenant-b")) == 0
    assert cached(complete(server, prompt=prompt)) == 0  # no salt is a tenant of its own
    again = complete(server, prompt=prompt, cache_salt="tenant-a")
    assert cached(again) >= 32, again["usage"]
    messages = [{"role": "user", "content": prompt}]
    chat(server, messages, cache_salt="tenant-c")
    assert cached(chat(server, messages, cache_salt="tenant-d")) == 0
    assert cached(chat(server, messages, cache_salt="tenant-c")) >= 32
    assert_pool_whole(server)


# ------------------------------------------------------------------------------------------------ priority
def test_priority_needs_the_priority_scheduling_policy(server):
    assert_error(server.http.post("/v1/completions", json={"prompt": "hi", "priority": 1}), 400, "priority")
    assert complete(server, priority=0)["choices"][0]["text"] is not None  # the default asks for nothing
    assert_pool_whole(server)


@pytest.mark.parametrize("policy,order", [("priority", ["b", "c", "a"]), ("fcfs", ["a", "b", "c"])])
def test_lower_priority_values_are_admitted_first_under_the_priority_policy(model_fp32, policy, order):
    """One request runs at a time: under priority they finish lowest value first, under fcfs in arrival order."""
    from pagedllm import SamplingParams
    from pagedllm.engine import EngineConfig, LLMEngine

    config = EngineConfig(scheduling_policy=policy, kv_cache_memory=kv_budget(32), **{**ENGINE_ARGS, "max_num_seqs": 1})
    engine = LLMEngine(config, loaded=model_fp32)
    params = SamplingParams(temperature=0, max_tokens=3)
    for rid, prio in (("a", 5), ("b", -1), ("c", 3)):
        engine.add_request(rid, "Once upon a time", params, priority=prio if policy == "priority" else 0)
    finished = []
    while engine.has_unfinished_requests():
        finished += [out.request_id for out in engine.step() if out.finished]
    assert finished == order


def test_under_the_priority_policy_the_lowest_priority_running_request_is_preempted(model_fp32):
    """When the cache is short, the request preempted is the lowest priority (highest value) one running, even
    if it was admitted first; under fcfs it is the last admitted."""
    from pagedllm import SamplingParams
    from pagedllm.engine import EngineConfig, LLMEngine

    config = EngineConfig(scheduling_policy="priority", kv_cache_memory=kv_budget(6), block_size=16, **ENGINE_ARGS)
    engine = LLMEngine(config, loaded=model_fp32)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    engine.add_request("low", [7] * 20, params, priority=9)
    engine.step()  # admitted first, alone
    engine.add_request("high", [8] * 20, params, priority=0)
    while engine.has_unfinished_requests() and not engine.scheduler.num_preemptions:
        engine.step()
    assert engine.scheduler.num_preemptions and engine.requests["low#0"].num_preemptions >= 1
    assert engine.requests.get("high#0") is None or engine.requests["high#0"].num_preemptions == 0
    while engine.has_unfinished_requests():
        engine.step()


# ------------------------------------------------------------------------------------------------ bad_words, allowed
def test_bad_words_are_never_generated(server):
    prompt = "The capital of France is"
    free = complete(server, prompt=prompt, max_tokens=6)["choices"][0]["text"]
    assert "Paris" in free, free  # what the model says unhindered
    banned = complete(server, prompt=prompt, max_tokens=6, bad_words=["Paris"])["choices"][0]["text"]
    assert "Paris" not in banned and banned, banned
    assert_error(server.http.post("/v1/completions", json={"prompt": "x", "bad_words": [" "]}), 400, "bad_words")


def test_allowed_token_ids_are_the_only_tokens_sampled(server):
    allowed = [9, 42, 1116]
    body = complete(server, prompt="Count:", max_tokens=8, logprobs=0, allowed_token_ids=allowed, temperature=1)
    strs = {server.http.post("/detokenize", json={"tokens": [t]}).json()["prompt"] for t in allowed}
    tokens = body["choices"][0]["logprobs"]["tokens"]
    assert tokens and set(tokens) <= strs, (tokens, strs)
    for bad in ([], [10**6], [-1]):
        r = server.http.post("/v1/completions", json={"prompt": "x", "allowed_token_ids": bad})
        assert_error(r, 400, "allowed_token_ids")
    assert_pool_whole(server)


# ------------------------------------------------------------------------------------------------ prompt shaping
def test_truncate_prompt_tokens_keeps_the_prompt_tail(server):
    ids = server.http.post("/tokenize", json={"prompt": LONG}).json()["tokens"]
    body = complete(server, prompt=LONG, truncate_prompt_tokens=8, echo=True, max_tokens=1)
    assert body["usage"]["prompt_tokens"] == 8
    tail = server.http.post("/detokenize", json={"tokens": ids[-8:]}).json()["prompt"]
    assert body["choices"][0]["text"].startswith(tail)
    chat_body = chat(server, [{"role": "user", "content": LONG}], truncate_prompt_tokens=5)
    assert chat_body["usage"]["prompt_tokens"] == 5
    for bad in (0, -2, 10**6):
        r = server.http.post("/v1/completions", json={"prompt": "x", "truncate_prompt_tokens": bad})
        assert_error(r, 400, "truncate_prompt_tokens")
    assert_pool_whole(server)


def test_continue_final_message_continues_the_assistants_text(server):
    """The last assistant message is left open (no end-of-turn after it) and the answer continues it."""
    messages = [{"role": "user", "content": "Say it."}, {"role": "assistant", "content": "The capital of France"}]
    closed = chat(server, messages, add_generation_prompt=False)
    opened = chat(server, messages, add_generation_prompt=False, continue_final_message=True)
    end_of_turn = len(server.http.post("/tokenize", json={"prompt": "<|im_end|>\n"}).json()["tokens"])
    assert opened["usage"]["prompt_tokens"] == closed["usage"]["prompt_tokens"] - end_of_turn
    both = {"messages": messages, "continue_final_message": True}  # add_generation_prompt defaults to true
    assert_error(server.http.post("/v1/chat/completions", json=both), 400, "continue_final_message")
    user_last = {"messages": messages[:1], "continue_final_message": True, "add_generation_prompt": False}
    assert_error(server.http.post("/v1/chat/completions", json=user_last), 400, "continue_final_message")


# ------------------------------------------------------------------------------------------------ chat_template
PLAIN_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def test_a_request_chat_template_is_refused_unless_the_server_trusts_them(server):
    body = {"messages": [{"role": "user", "content": "hi"}], "chat_template": PLAIN_TEMPLATE}
    assert_error(server.http.post("/v1/chat/completions", json=body), 400, "chat_template")
    assert_pool_whole(server)


def test_a_trusted_request_chat_template_is_rendered_in_the_sandbox(model_fp32):
    with _server(model_fp32, trust_request_chat_template=True) as s:
        text = "Hello there, friend"
        n = len(s.http.post("/tokenize", json={"prompt": text}).json()["tokens"])
        body = chat(s, [{"role": "user", "content": text}], chat_template=PLAIN_TEMPLATE)
        assert body["usage"]["prompt_tokens"] == n  # the request's template, not the model's
        escape = "{{ ''.__class__.__mro__[1].__subclasses__() }}"  # Jinja's sandbox refuses it
        r = s.http.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "chat_template": escape}
        )
        assert_error(r, 400, "chat_template")
        assert_pool_whole(s)


# ------------------------------------------------------------------------------------------------ fields in general
HI = [{"role": "user", "content": "hi"}]
UNSERVED = [
    ("use_beam_search", True),
    ("include_stop_str_in_output", True),
    ("length_penalty", 2.0),
    ("prompt_embeds", "AAAA"),
    ("return_token_ids", True),
    ("logits_processors", ["x"]),
    ("add_special_tokens", True),
]


@pytest.mark.parametrize("field,value", UNSERVED)
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_vllm_field_not_served_is_a_400_naming_it_and_its_default_is_taken(server, path, field, value):
    body = {"max_tokens": 2, "prompt": "hi"} if path == "/v1/completions" else {"max_tokens": 2, "messages": HI}
    assert_error(server.http.post(path, json={**body, field: value}), 400, field)
    default = {"use_beam_search": False, "include_stop_str_in_output": False, "length_penalty": 1.0}
    if field in default:
        assert server.http.post(path, json={**body, field: default[field]}).status_code == 200
    assert_pool_whole(server)


CHAT_UNSERVED = [("reasoning_effort", "high"), ("audio", {"voice": "x"}), ("modalities", ["audio"]), ("store", True)]


@pytest.mark.parametrize("field,value", CHAT_UNSERVED)
def test_an_openai_chat_field_not_served_is_a_400_naming_it(server, field, value):
    body = {"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], field: value}
    assert_error(server.http.post("/v1/chat/completions", json=body), 400, field)


def test_a_field_nobody_defines_is_ignored_with_one_log_line(server, caplog):
    with caplog.at_level(logging.INFO, logger="pagedllm.server"):
        body = complete(server, frobnicate=1, zz_top={"a": 1})
    assert body["choices"][0]["finish_reason"] in ("length", "stop")
    lines = [r.getMessage() for r in caplog.records if "nobody defines" in r.getMessage()]
    assert len(lines) == 1 and "frobnicate, zz_top" in lines[0], lines


def test_tokenize_renders_chats_with_the_same_template_arguments(server):
    """/tokenize's chat form takes continue_final_message and chat_template_kwargs as chat completions do, and
    counts the same prompt."""
    messages = [{"role": "user", "content": "Say it."}, {"role": "assistant", "content": "The capital of France"}]
    args = {"add_generation_prompt": False, "continue_final_message": True, "chat_template_kwargs": {"x": 1}}
    counted = server.http.post("/tokenize", json={"messages": messages, **args}).json()["count"]
    assert counted == chat(server, messages, **args)["usage"]["prompt_tokens"]
    for bad in ({"chat_template_kwargs": {"messages": 1}}, {"chat_template": "{{ 1 }}"}):
        param = next(iter(bad))
        assert_error(server.http.post("/tokenize", json={"messages": messages, **bad}), 400, param)


# ------------------------------------------------------------------------------------------------ kv_blend
def _passages_prompt(order):
    """Token ids: a head, three passages of 40 ids in `order`, a tail; with the passages' spans."""
    passages = [[1000 + 100 * i + j for j in range(40)] for i in range(3)]
    ids, spans = [1, 2, 3, 4, 5], []
    for i in order:
        spans.append([len(ids), len(ids) + 40])
        ids += passages[i]
    return ids + [7, 8, 9], spans


def test_kv_blend_reuses_passages_in_another_order_and_is_off_when_absent(server):
    """The extension field marks the spans; the same passages in another order are copied (the prefix cache
    alone serves only the head); without the field the answer is the plain one, bit for bit."""
    a, spans_a = _passages_prompt([0, 1, 2])
    b, spans_b = _passages_prompt([2, 0, 1])
    c, spans_c = _passages_prompt([1, 2, 0])
    plain = complete(server, prompt=b)
    complete(server, prompt=a, kv_blend={"segments": spans_a, "recompute": 0.0})
    exact = complete(server, prompt=b, kv_blend={"segments": spans_b, "recompute": 1.0})
    assert exact["choices"][0]["text"] == plain["choices"][0]["text"]
    first = cached(complete(server, prompt=c))  # the prefix cache alone: the head, not a passage
    assert first < 16
    engine = server.engine.engine  # the LLMEngine; read between requests, when its thread is idle
    before = engine.prompt_tokens
    complete(server, prompt=c + [10], kv_blend={"segments": spans_c, "recompute": 0.0})
    assert engine.prompt_tokens - before < len(c) - 64  # the passages' stored full blocks were copied
    assert complete(server, prompt=b)["choices"][0]["text"] == plain["choices"][0]["text"]
    assert_pool_whole(server)


@pytest.mark.parametrize(
    "kv_blend",
    [
        {"segments": [[5, 2]]},
        {"segments": [[0, 10_000]]},
        {"segments": [[0, 10], [5, 20]]},
        {"segments": [[0, 10]], "recompute": 2},
        {"segments": "0-10"},
        {"segments": [[0, 10]], "ratio": 0.1},
        {"segments": [[0, 10]], "max_deviation": 1.5},
        {"segments": [[0, 10]], "max_deviation": 0.05, "recompute": 0.1},  # the bound or the share, not both
    ],
)
def test_bad_kv_blend_is_a_400_naming_it_and_queues_nothing(server, kv_blend):
    ids, _ = _passages_prompt([0, 1, 2])
    r = server.http.post("/v1/completions", json={"prompt": ids, "max_tokens": 2, "kv_blend": kv_blend})
    assert_error(r, 400, "kv_blend")
    assert_pool_whole(server)
