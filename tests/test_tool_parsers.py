"""The "auto" tool-call formats (issue 28.2): hermes, llama3_json, mistral (both forms), pythonic, one parser class
each; a whole answer is exactly what its stream adds up to wherever the text is cut; the format is the one
--tool-call-parser names, or the one the chat template asks for when it names exactly one (else a 400 naming
tool_choice); and a real server over the default model, its answer forced to each format's text, returns the same
calls streamed and not, under a template that renders the tools in that format."""

from __future__ import annotations

import argparse
import json

import pytest
from engine_helpers import kv_budget
from server_helpers import assert_error, assert_pool_whole, running_server, sse_events

from pagedllm.entrypoints.serve_args import add_serve_args, check_server_args
from pagedllm.errors import UserError
from pagedllm.server.config import TOOL_PARSER_NAMES
from pagedllm.server.tool_parsers import (
    TOOL_PARSERS,
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    PythonicToolParser,
    ToolParser,
    auto_parser,
)
from pagedllm.server.tools import ToolMode

AUTO = ToolMode("auto")


def whole(cls: type[ToolParser], text: str) -> tuple[str, dict[int, list[str]]]:
    got = cls(AUTO).extract(text)
    return got.content or "", {i: [c.function.name, c.function.arguments] for i, c in enumerate(got.tool_calls)}


def streamed(cls: type[ToolParser], text: str, ends: list[int]) -> tuple[str, dict[int, list[str]], list[dict]]:
    """The content and calls the deltas of `text` cut at `ends` add up to, and the deltas."""
    parser, content, calls, deltas = cls(AUTO), "", {}, []
    for end in [*ends, len(text)]:
        delta = parser.extract_streaming(text[:end], end == len(text)).body()
        deltas.append(delta)
        content += delta.get("content", "")
        for d in delta.get("tool_calls", []):
            if "id" in d:
                assert d["type"] == "function" and d["index"] == len(calls) and d["function"]["arguments"] == ""
                calls[d["index"]] = [d["function"]["name"], ""]
            calls[d["index"]][1] += d["function"]["arguments"]
    return content, calls, deltas


ADD, OSLO = '{"a": 1, "b": 2}', '{"city": "Oslo"}'
CASES = [
    # llama3_json: the calls, maybe after <|python_tag|>, `;` between; "parameters" or "arguments"
    (
        Llama3JsonToolParser,
        '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "get_weather", "arguments": '
        '{"city": "Oslo"}}',
        "",
        {0: ["add", ADD], 1: ["get_weather", OSLO]},
    ),
    (Llama3JsonToolParser, ' {"name": "add", "parameters": {"a": 1, "b": 2}} then text', "", {0: ["add", ADD]}),
    (Llama3JsonToolParser, '{"name": "f"}', "", {0: ["f", "{}"]}),
    (Llama3JsonToolParser, 'Sure: {"name": "add"}', 'Sure: {"name": "add"}', {}),  # not first: content
    (Llama3JsonToolParser, '{"nom": "add", "parameters": {}}', '{"nom": "add", "parameters": {}}', {}),
    (Llama3JsonToolParser, '{"name": 7}', '{"name": 7}', {}),
    (Llama3JsonToolParser, "<|python_tag|>", "<|python_tag|>", {}),
    (Llama3JsonToolParser, '{"name": "add", "parameters": {"a": 1', "", {0: ["add", '{"a": 1']}),  # cut off
    # mistral: content, then the array (pre-v11) or one [TOOL_CALLS]name[ARGS]{...} per call (v11+)
    (
        MistralToolParser,
        'Let me see. [TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "get_weather", '
        '"arguments": {"city": "Oslo"}}]',
        "Let me see.",
        {0: ["add", ADD], 1: ["get_weather", OSLO]},
    ),
    (
        MistralToolParser,
        'Ok[TOOL_CALLS]add{"a": 1, "b": 2}[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}',
        "Ok",
        {0: ["add", ADD], 1: ["get_weather", OSLO]},
    ),
    (MistralToolParser, "No [TOOL_CALLS] here", "No [TOOL_CALLS] here", {}),
    (MistralToolParser, "Hi [TOOL_CALL", "Hi [TOOL_CALL", {}),
    (MistralToolParser, "[TOOL_CALLS]add", "[TOOL_CALLS]add", {}),  # ended before the name was whole
    (MistralToolParser, '[TOOL_CALLS]add[ARGS]{"a": 1,', "", {0: ["add", '{"a": 1,']}),
    (MistralToolParser, '[TOOL_CALLS][{"arguments": {}}]', '[TOOL_CALLS][{"arguments": {}}]', {}),
    # pythonic: a Python list of calls, the keywords' literal values as a JSON object
    (
        PythonicToolParser,
        '[add(a=1, b=2), get_weather(city="Oslo")]',
        "",
        {0: ["add", ADD], 1: ["get_weather", OSLO]},
    ),
    (
        PythonicToolParser,
        "<|python_start|>[f(x=[1, (2, 3)], y={'k': None}, z=True, s='a,b)c\\'d')]<|python_end|>",
        "",
        {0: ["f", '{"x": [1, [2, 3]], "y": {"k": null}, "z": true, "s": "a,b)c\'d"}']},
    ),
    (PythonicToolParser, "[f(), g(a=1,)]", "", {0: ["f", "{}"], 1: ["g", '{"a": 1}']}),
    (PythonicToolParser, "[1, 2, 3]", "[1, 2, 3]", {}),
    (PythonicToolParser, "The answer is [f(a=1)]", "The answer is [f(a=1)]", {}),
    (PythonicToolParser, "[f(a=x), g()]", "", {0: ["f", "{"]}),  # no literal: the call stands as read
    (PythonicToolParser, '[add(a=1, b="tw', "", {0: ["add", '{"a": 1']}),  # cut off
    (PythonicToolParser, "[get_wea", "[get_wea", {}),
    # hermes, as before
    (
        HermesToolParser,
        'Ok.\n<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>',
        "Ok.",
        {0: ["add", ADD]},
    ),
]


@pytest.mark.parametrize("cls, text, content, calls", CASES)
def test_a_stream_adds_up_to_the_whole_answer_wherever_the_text_is_cut(cls, text, content, calls):
    assert whole(cls, text) == (content, calls)
    cuts = [
        list(range(len(text))),  # a character at a time
        [i for i, ch in enumerate(text) if ch in "\"'[]{}(),;|"],  # at every quote, bracket and separator
        [len(text) // 3, len(text) // 2],
        [],
    ]
    for ends in cuts:
        got_content, got_calls, _ = streamed(cls, text, ends)
        assert (got_content, got_calls) == (content, calls), ends


@pytest.mark.parametrize("cls, text", [(c[0], c[1]) for c in CASES if len(c[3]) == 2])
def test_a_stream_sends_content_first_a_header_once_the_name_is_read_and_arguments_in_pieces(cls, text):
    _, _, deltas = streamed(cls, text, list(range(len(text))))
    kinds = [k for d in deltas for k in d]
    if "content" in kinds:
        assert kinds[0] == "content" and "content" not in kinds[kinds.index("tool_calls") :], kinds
    pieces = [t["function"]["arguments"] for d in deltas for t in d.get("tool_calls", []) if "id" not in t]
    assert len(pieces) >= 4, pieces  # not the whole arguments at the end
    name = next(t["function"]["name"] for d in deltas for t in d.get("tool_calls", []))
    at = text.index(name) + len(name)
    head = text[: at + 2]  # the name and what says it is whole ('", ' / '{' / '(')
    assert [c.name for c in cls(AUTO).scan(head, False).calls][:1] == [name], head
    assert cls(AUTO).scan(text[: at - 1], False).calls[:1] in ([], [(None, "")])  # not before


def test_content_that_could_still_become_a_call_waits():
    for cls, held in (
        (Llama3JsonToolParser, ["  ", "<|py", "<|python_tag|>", '{"na']),
        (MistralToolParser, ["Hi [TOOL_", "Hi [TOOL_CALLS]", "Hi [TOOL_CALLS]ad", "Hi [TOOL_CALLS]add[AR"]),
        (PythonicToolParser, ["[", "<|python_st", "[get_weather", "[get_weather "]),
    ):
        for text in held:
            delta = cls(AUTO).extract_streaming(text, False).body()
            assert delta.get("content", "") in ("", "Hi") and "tool_calls" not in delta, (cls.name, text, delta)
    assert Llama3JsonToolParser(AUTO).extract_streaming("Hello", False).body() == {"content": "Hello"}
    assert PythonicToolParser(AUTO).extract_streaming("[get weather", False).body() == {"content": "[get weather"}


LLAMA3_TEMPLATE = (
    "{% if tools %}<|start_header_id|>system<|end_header_id|>\n\nGiven the following functions, please respond "
    "with a JSON for a function call with its proper arguments that best answers the given prompt.\n\nRespond in "
    'the format {"name": function name, "parameters": dictionary of argument name and its value}. Do not use '
    "variables.\n\n{% for t in tools %}{{ t | tojson }}\n\n{% endfor %}<|eot_id|>{% endif %}"
    "{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] }}<|eot_id|>"
    "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
MISTRAL_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}{% if tools and loop.last %}[AVAILABLE_TOOLS]"
    "{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}[INST]{{ m['content'] }}[/INST]"
    "{% elif m.tool_calls %}{% for c in m.tool_calls %}[TOOL_CALLS]{{ c.function.name }}[ARGS]"
    "{{ c.function.arguments }}{% endfor %}</s>{% else %}{{ m['content'] }}</s>{% endif %}{% endfor %}"
)
PYTHONIC_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nYou can call these functions: {{ tools | tojson }}. To call them, answer "
    "only [func_name1(params_name1=params_value1, params_name2=params_value2...), func_name2(params)]<|im_end|>\n"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}. Answer with <tool_call>{...}</tool_call>"
    "<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TEMPLATES = {
    "hermes": HERMES_TEMPLATE,
    "llama3_json": LLAMA3_TEMPLATE,
    "mistral": MISTRAL_TEMPLATE,
    "pythonic": PYTHONIC_TEMPLATE,
}


def test_the_template_names_the_format_or_the_flag_must():
    for name, template in TEMPLATES.items():
        assert auto_parser(template) is TOOL_PARSERS[name]
        assert auto_parser(HERMES_TEMPLATE, name) is TOOL_PARSERS[name]  # the flag wins
    with pytest.raises(ValueError, match="has no tools"):
        auto_parser("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    with pytest.raises(ValueError, match="asks for hermes and mistral calls.*--tool-call-parser NAME"):
        auto_parser(HERMES_TEMPLATE + "[TOOL_CALLS]")
    with pytest.raises(ValueError, match="names no tool-call format"):
        auto_parser("{{ tools | tojson }}{% for m in messages %}{{ m['content'] }}{% endfor %}")


def test_the_flags_are_vllms_and_come_together():
    assert set(TOOL_PARSER_NAMES) == set(TOOL_PARSERS)
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    ok = parser.parse_args(["--enable-auto-tool-choice", "--tool-call-parser", "pythonic"])
    check_server_args(ok)
    assert ok.tool_call_parser == "pythonic"
    for argv, flag in (
        (["--enable-auto-tool-choice"], "--enable-auto-tool-choice"),
        (["--tool-call-parser", "mistral"], "--tool-call-parser"),
    ):
        with pytest.raises(UserError, match=f"^{flag}: needs"):
            check_server_args(parser.parse_args(argv))
    with pytest.raises(SystemExit):
        parser.parse_args(["--enable-auto-tool-choice", "--tool-call-parser", "nope"])
    from pagedllm.entrypoints.serve_cluster import settings_from_args

    cluster = parser.parse_args(["--replicas", "2", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"])
    assert settings_from_args(cluster)[2].server.tool_call_parser == "hermes"  # the cluster's ingress parses them
    with pytest.raises(UserError, match="^--tool-call-parser: needs"):  # `serve run`'s builder checks it too
        settings_from_args(parser.parse_args(["--replicas", "2", "--tool-call-parser", "hermes"]))


# ------------------------------------------------------------------------------------------ a real server
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
        },
    },
    {
        "type": "function",
        "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {}}}},
    },
]
ANSWERS = {  # what the model is made to write (a choice constraint), and the calls it holds
    "llama3_json": '<|python_tag|>{"name": "add", "parameters": {"a": 12, "b": 34}}',
    "mistral": 'Adding.[TOOL_CALLS]add[ARGS]{"a": 12, "b": 34}[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}',
    "pythonic": '[add(a=12, b=34), get_weather(city="Oslo")]',
}
CALLS = {
    "llama3_json": ("", [("add", {"a": 12, "b": 34})]),
    "mistral": ("Adding.", [("add", {"a": 12, "b": 34}), ("get_weather", {"city": "Oslo"})]),
    "pythonic": ("", [("add", {"a": 12, "b": 34}), ("get_weather", {"city": "Oslo"})]),
}


@pytest.fixture(scope="module")
def server(model_fp32):
    from pagedllm.engine import EngineConfig, LLMEngine
    from pagedllm.engine.async_engine import AsyncLLMEngine

    config = EngineConfig(
        dtype="float32", max_model_len=512, kv_cache_memory=kv_budget(48), max_num_seqs=4, log_stats_interval=0
    )
    with running_server(AsyncLLMEngine(LLMEngine(config, loaded=model_fp32)), served_model_name=["m"]) as s:
        yield s


def _stream(s, body: dict) -> tuple[str, list[tuple[str, dict]], str, list[dict]]:
    with s.http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        events = [e for e in sse_events(r.iter_lines()) if e != "[DONE]"]
    deltas = [c["delta"] for e in events for c in e["choices"]]
    content, calls = "", []
    for d in deltas:
        content += d.get("content") or ""
        for t in d.get("tool_calls", []):
            if "id" in t:
                calls.append([t["function"]["name"], ""])
            calls[t["index"]][1] += t["function"]["arguments"]
    finish = next(c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"])
    return content, [(n, json.loads(a)) for n, a in calls], finish, deltas


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("fmt", list(ANSWERS))
def test_each_format_is_served_for_auto_streamed_and_not(server, monkeypatch, fmt):
    """The template renders the tools in the format (the prompt grows by them) and names it; the model's answer
    in that format is parsed into the same message streamed and not, finishing with "tool_calls"."""
    monkeypatch.setattr(server.engine.tokenizer.hf, "chat_template", TEMPLATES[fmt])
    msgs = [{"role": "user", "content": "Add 12 and 34, and the weather in Oslo?"}]
    body = {"messages": msgs, "tools": TOOLS, "max_tokens": 96, "temperature": 0}
    plain = server.http.post("/v1/chat/completions", json={**body, "tools": None, "max_tokens": 1}).json()
    r = server.http.post("/v1/chat/completions", json={**body, "structured_outputs": {"choice": [ANSWERS[fmt]]}})
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"] + 40  # the tools are in the prompt
    choice = answer["choices"][0]
    message = choice["message"]
    got = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]]
    assert (message["content"] or "", got) == CALLS[fmt] and choice["finish_reason"] == "tool_calls", answer
    content, calls, finish, deltas = _stream(server, {**body, "structured_outputs": {"choice": [ANSWERS[fmt]]}})
    assert (content, calls, finish) == (*CALLS[fmt], "tool_calls")
    assert sum(1 for d in deltas for t in d.get("tool_calls", []) if t["function"]["arguments"]) > 1, deltas
    assert_pool_whole(server)


def _special_tool_calls_tokenizer(tokenizer):
    """The default model's tokenizer with its special token 3 named `[TOOL_CALLS]`, as Mistral's tokenizers have
    it: a special token, dropped from the text whenever special tokens are skipped."""
    import tokenizers
    from transformers import PreTrainedTokenizerFast

    from pagedllm.model.tokenizer import Tokenizer

    spec = json.loads(tokenizer.hf.backend_tokenizer.to_str())
    old = spec["added_tokens"][3]["content"]
    spec["added_tokens"][3]["content"] = "[TOOL_CALLS]"
    spec["model"]["vocab"]["[TOOL_CALLS]"] = spec["model"]["vocab"].pop(old)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tokenizers.Tokenizer.from_str(json.dumps(spec)),
        eos_token=tokenizer.hf.eos_token,
        additional_special_tokens=["[TOOL_CALLS]"],
    )
    hf.chat_template = MISTRAL_TEMPLATE
    return Tokenizer(hf, tokenizer.eos_token_ids)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_mistral_calls_behind_a_special_token_are_read_and_eos_never_shows(model_fp32):
    """`[TOOL_CALLS]` as a special token (vLLM's MistralToolParser.adjust_request keeps special tokens for it):
    the calls are read streamed and not, and the EOS that ends an answer never shows in its content."""
    from dataclasses import replace

    from pagedllm.engine import EngineConfig, LLMEngine
    from pagedllm.engine.async_engine import AsyncLLMEngine

    loaded = replace(model_fp32, tokenizer=_special_tool_calls_tokenizer(model_fp32.tokenizer))
    config = EngineConfig(dtype="float32", max_model_len=512, kv_cache_memory=kv_budget(48), log_stats_interval=0)
    grammar = 'start: "Adding." <[3]> "add[ARGS]{\\"a\\": 12, \\"b\\": 34}"'  # token 3 itself, not its text
    msgs = [{"role": "user", "content": "Add 12 and 34."}]
    body = {"messages": msgs, "tools": TOOLS, "max_tokens": 64, "temperature": 0}
    forced = {**body, "structured_outputs": {"grammar": grammar}}
    eos = {**body, "logit_bias": {str(i): 100 for i in model_fp32.tokenizer.eos_token_ids}}
    with running_server(AsyncLLMEngine(LLMEngine(config, loaded=loaded)), served_model_name=["m"]) as s:
        r = s.http.post("/v1/chat/completions", json=forced)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        got = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in choice["message"]["tool_calls"]]
        assert (choice["message"]["content"], got) == ("Adding.", [("add", {"a": 12, "b": 34})]), choice
        assert choice["finish_reason"] == "tool_calls"
        content, calls, finish, _ = _stream(s, forced)
        assert (content, calls, finish) == ("Adding.", [("add", {"a": 12, "b": 34})], "tool_calls")
        r = s.http.post("/v1/chat/completions", json=eos)  # special tokens kept, the answer is EOS alone
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert (choice["message"]["content"], choice["finish_reason"]) == (None, "stop"), choice
        assert _stream(s, eos)[0] == ""
        assert_pool_whole(s)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_ambiguous_template_needs_the_flag_and_the_flag_picks_the_format(server, monkeypatch):
    monkeypatch.setattr(server.engine.tokenizer.hf, "chat_template", HERMES_TEMPLATE + "[TOOL_CALLS]")
    body = {"messages": [{"role": "user", "content": "Add 12 and 34."}], "tools": TOOLS, "max_tokens": 64}
    for stream in (False, True):
        r = server.http.post("/v1/chat/completions", json={**body, "stream": stream})
        assert_error(r, 400, "tool_choice", ["--tool-call-parser", "hermes and mistral"])
    monkeypatch.setattr(server.server.app.state.serving, "tool_call_parser", "pythonic")
    forced = {**body, "temperature": 0, "structured_outputs": {"choice": [ANSWERS["pythonic"]]}}
    r = server.http.post("/v1/chat/completions", json=forced)
    assert r.status_code == 200, r.text
    assert [c["function"]["name"] for c in r.json()["choices"][0]["message"]["tool_calls"]] == ["add", "get_weather"]
    assert_pool_whole(server)


def test_the_server_settings_refuse_an_unknown_parser():
    from pagedllm.server.config import ServerConfig

    with pytest.raises(UserError, match="--tool-call-parser: input should be 'hermes'"):
        ServerConfig(enable_auto_tool_choice=True, tool_call_parser="nope")  # type: ignore[arg-type]
