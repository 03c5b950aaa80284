"""Every example in README.md runs as written against the default model and does what the README says of it
(issue 24.8). The snippets are read from README.md itself (each code block under an `<!-- example: NAME -->`
line), so the test breaks when the README drifts: a block changed, added without a check, or dropped.

The curl commands are sent as curl would send them (their URL, headers and `-d` body); the Python ones run
with `exec`, their printed lines held to the output their comments claim (`...` stands for anything). The
server is the default model (GGUF weights, float32 activations) with `pagedllm serve`'s defaults otherwise.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
from engine_helpers import kv_budget
from server_helpers import assert_pool_whole, running_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

README = Path(__file__).resolve().parents[1] / "README.md"
EXAMPLE = re.compile(r"^<!-- example: (\S+) -->\n```(\w+)\n(.*?)^```$", re.S | re.M)
# An example that needs another model than the default (a reasoning model): shown, compiled, not run.
NOT_RUN = re.compile(r"^<!-- example-not-run: (\S+) \((.+?)\) -->\n```(\w+)\n(.*?)^```$", re.S | re.M)
BASE = "http://127.0.0.1:8000"  # where the README's server listens


def readme_examples() -> dict[str, tuple[str, str]]:
    """NAME -> (language, code) of every marked block."""
    found: dict[str, tuple[str, str]] = {}
    for name, lang, code in EXAMPLE.findall(README.read_text(encoding="utf-8")):
        assert name not in found, f"two README examples are called {name}"
        found[name] = (lang, code)
    return found


@pytest.fixture(scope="module")
def server(model_fp32):
    from pagedllm.engine import EngineConfig, LLMEngine
    from pagedllm.engine.async_engine import AsyncLLMEngine
    from pagedllm.entrypoints.serve_args import DEFAULT_SERVED_NAME
    from pagedllm.server.embedders import SentenceTransformerEmbedder

    config = EngineConfig(dtype="float32", max_model_len=2048, kv_cache_memory=kv_budget(256), log_stats_interval=0)
    engine = AsyncLLMEngine(LLMEngine(config, loaded=model_fp32))
    embedders = [SentenceTransformerEmbedder("default")]  # --embedding-model default
    with running_server(engine, api_key=None, served_model_name=[DEFAULT_SERVED_NAME], embedders=embedders) as s:
        yield s


def run_curl(code: str, base: str) -> list[tuple[dict, dict]]:
    """(request body, answer) of each curl command in the block, sent with httpx to `base`."""
    sent = []
    for command in re.split(r"^(?=curl )", code, flags=re.M):
        if not command.strip():
            continue
        args = shlex.split(command.replace("\\\n", " "))
        url = next(a for a in args if a.startswith("http"))
        headers = dict(args[i + 1].split(": ", 1) for i, a in enumerate(args) if a == "-H")
        data = args[args.index("-d") + 1]
        r = httpx.post(url.replace(BASE, base), content=data, headers=headers, timeout=300)
        assert r.status_code == 200, (command, r.text)
        sent.append((json.loads(data), r.json()))
    return sent


def run_python(code: str, base: str) -> dict[str, Any]:
    """The names the block defined; its printed lines must show what its comments claim they print."""
    out, names = io.StringIO(), {"__name__": "readme_example"}
    with contextlib.redirect_stdout(out):
        exec(compile(code.replace(BASE, base), str(README), "exec"), names)  # noqa: S102 - the README's own code
    claims = [line.split("# ", 1)[1] for line in code.splitlines() if line.startswith("print(") and "  # " in line]
    printed = out.getvalue().splitlines()
    for claim in claims:
        pattern = ".+?".join(re.escape(part) for part in claim.split("..."))
        assert any(re.fullmatch(pattern, line) for line in printed), (claim, printed)
    names["printed"] = printed
    return names


def check_tour_curl(sent: list[tuple[dict, dict]]) -> None:
    ((body, answer),) = sent
    choice = answer["choices"][0]
    assert answer["model"] == body["model"] and choice["finish_reason"] == "stop" and choice["message"]["content"]


def check_tour_python(names: dict[str, Any]) -> None:
    reply, printed = names["reply"], names["printed"]
    assert reply.choices[0].finish_reason == "stop" and reply.choices[0].message.content, reply
    assert printed[0].startswith(reply.choices[0].message.content) and "CompletionUsage(" in printed[0]
    assert len(printed) > 1 and printed[1].strip(), printed  # the streamed completion


def check_structured_curl(sent: list[tuple[dict, dict]]) -> None:
    """As the README says: schema-valid JSON that finishes with "stop", and one of the choices."""
    (person_body, person), (choice_body, choice) = sent
    answer = person["choices"][0]
    assert answer["finish_reason"] == "stop", answer
    schema = person_body["response_format"]["json_schema"]["schema"]
    jsonschema.validate(json.loads(answer["message"]["content"]), schema)
    answer = choice["choices"][0]
    assert answer["finish_reason"] == "stop" and answer["text"] in choice_body["guided_choice"], answer


def check_structured_python(names: dict[str, Any]) -> None:
    choice = names["reply"].choices[0]
    assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, names["Person"]), choice


def check_tools_python(names: dict[str, Any]) -> None:
    """tool_choice "required": a call of the tool, its arguments valid for its parameters, finished."""
    choice, schema = names["reply"].choices[0], names["weather"]["function"]["parameters"]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), schema)


def check_fields_curl(sent: list[tuple[dict, dict]]) -> None:
    """As the README says: no "Paris" under bad_words, and the assistant's text continued."""
    (_, banned), (_, continued) = sent
    assert "Paris" not in banned["choices"][0]["text"] and banned["choices"][0]["text"], banned
    assert continued["choices"][0]["message"]["content"], continued


def check_embeddings_python(names: dict[str, Any]) -> None:
    """Two unit vectors of MiniLM's 384 numbers; two sentences about paging a KV cache are close."""
    res = names["res"]
    assert res.model == "all-MiniLM-L6-v2" and [d.index for d in res.data] == [0, 1]
    for d in res.data:
        assert len(d.embedding) == 384 and abs(sum(x * x for x in d.embedding) - 1) < 1e-4
    assert sum(x * y for x, y in zip(names["a"], names["b"])) > 0.5


def check_offline_python(names: dict[str, Any]) -> None:
    (out,) = names["outs"]
    assert out.outputs[0].text and len(out.outputs[0].token_ids) <= 16, out
    assert len(names["printed"]) >= 2 and names["printed"][-1].strip(), names["printed"]


def check_responses_python(names: dict[str, Any]) -> None:
    resp, printed = names["resp"], names["printed"]
    assert resp.status == "completed" and resp.output_text and resp.output[0].type == "message", resp
    assert printed[0] == f"completed {resp.output_text}".splitlines()[0] and printed[-1].strip(), printed


def check_messages_python(names: dict[str, Any]) -> None:
    msg, printed = names["msg"], names["printed"]
    assert msg.stop_reason == "end_turn" and msg.content[0].type == "text" and msg.content[0].text, msg
    assert printed[0] == f"end_turn {msg.content[0].text}".splitlines()[0] and printed[-1].strip(), printed


CHECKS: dict[str, Callable[[Any], None]] = {
    "tour-curl": check_tour_curl,
    "tour-python": check_tour_python,
    "structured-curl": check_structured_curl,
    "structured-python": check_structured_python,
    "tools-python": check_tools_python,
    "fields-curl": check_fields_curl,
    "embeddings-python": check_embeddings_python,
    "offline-python": check_offline_python,
    "responses-python": check_responses_python,
    "messages-python": check_messages_python,
}


def test_every_readme_example_is_marked_and_checked():
    """A code block that calls the server or the engine is an example: it must be marked, and have a check."""
    examples = readme_examples()
    assert set(examples) == set(CHECKS)
    blocks = re.findall(r"^```\w*\n(.*?)^```$", README.read_text(encoding="utf-8"), re.S | re.M)
    for code in blocks:
        if "curl http" in code or "OpenAI(" in code or "Anthropic(" in code or "LLM(" in code:
            marked = [c for _, c in examples.values()] + [m[3] for m in NOT_RUN.findall(README.read_text("utf-8"))]
            assert code in marked, f"an unmarked README example:\n{code}"


def test_examples_not_run_say_why_and_compile():
    """An example for another model is not run here, but it says why and is valid Python."""
    found = NOT_RUN.findall(README.read_text(encoding="utf-8"))
    assert found
    for name, why, lang, code in found:
        assert why.startswith("needs "), (name, why)
        if lang == "python":
            compile(code, name, "exec")


def test_every_readme_example_is_greedy():
    """The README says so: each answer is the same every time, so one run checks it."""
    for name, (_, code) in readme_examples().items():
        # an embedding samples nothing: only generations need temperature 0
        calls = len(re.findall(r"(?<!embeddings)\.(?:create|parse)\(|SamplingParams\(", code)) or code.count("curl ")
        assert code.count("temperature=0") + code.count('"temperature": 0') == calls, name


@pytest.mark.parametrize("name", list(CHECKS))
def test_readme_example_does_what_the_readme_says(server, name):
    lang, code = readme_examples()[name]
    CHECKS[name](run_curl(code, server.base) if lang == "sh" else run_python(code, server.base))
    assert_pool_whole(server)
