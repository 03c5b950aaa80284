"""Structured outputs (issue 21): does constrained decoding make the default model's answers usable by a program,
and what does it cost? One run, one `pagedllm serve` started here, the official `openai` client:

1. validity: 50 varied prompts, `client.chat.completions.parse(..., response_format=<pydantic model>)`: the share
   that parses and validates, constrained vs unconstrained (the same prompt asking for the same JSON, no
   response_format); the same for `tool_choice: "required"` with two functions vs tool_choice "none" with the tools
   described in the prompt;
2. cost: output tok/s of chat requests under a JSON schema vs without one, at concurrency 1 and 16 (the same
   prompts, max_tokens fixed, EOS ignored without the schema, an open-ended schema so both run to max_tokens);
3. in-process, after the server stopped: mask time per constrained token (computing and applying the bitmask),
   and the compile time of a typical schema, first and cached.

    .venv/bin/python -m benchmarks.serving.structured_outputs [--out so.json] [--serve-args "--max-num-seqs 16"]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import jsonschema
import openai
import pydantic

from benchmarks.common import wait_ready  # noqa: E402

SUBJECTS = [
    "a retired sailor",
    "a young chemist",
    "a baker in Lyon",
    "a jazz drummer",
    "a school teacher",
    "a chess champion",
    "a farmer in Kenya",
    "a software engineer",
    "a marathon runner",
    "a museum guard",
]
FRAMINGS = [
    "Invent {s} and describe them.",
    "Write a short profile of {s}.",
    "Who is {s}? Make one up.",
    "Create a character: {s}.",
    "Give me the details of {s} for a novel.",
]
TOOL_ASKS = [
    "What is the weather in {c}?",
    "Add {a} and {b}.",
    "Is it cold in {c} today, in fahrenheit?",
    "What is {a} plus {b}?",
    "I'm going to {c}; what's the temperature there?",
]
CITIES = ["Paris", "Seoul", "Lima", "Oslo", "Cairo", "Quito", "Hanoi", "Perth", "Dakar", "Riga"]


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=30)
    age: int = pydantic.Field(ge=0, le=120)
    job: str = pydantic.Field(max_length=30)
    mood: Literal["happy", "sad", "calm"]


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 20},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "minimum": -9999, "maximum": 9999},
                    "b": {"type": "integer", "minimum": -9999, "maximum": 9999},
                },
                "required": ["a", "b"],
                "additionalProperties": False,
            },
        },
    },
]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
OPEN_SCHEMA = {
    "type": "object",
    "properties": {"notes": {"type": "array", "items": {"type": "string"}, "minItems": 100}},
    "required": ["notes"],
}  # cannot end within the budget: every request runs to max_tokens, as without


def person_prompts() -> list[str]:
    return [f.format(s=s) for f in FRAMINGS for s in SUBJECTS]


def tool_prompts() -> list[str]:
    return [TOOL_ASKS[i % 5].format(c=CITIES[i % 10], a=3 * i + 1, b=i * i) for i in range(50)]


def _person_ok(text: str | None) -> bool:
    try:
        Person.model_validate_json(text or "")
        return True
    except pydantic.ValidationError:
        return False


def _calls_ok(calls: list[dict]) -> bool:
    try:
        for c in calls:
            jsonschema.validate(json.loads(c["arguments"]), PARAMS[c["name"]])
        return bool(calls)
    except (ValueError, KeyError, TypeError, jsonschema.ValidationError):
        return False


def validity(client: openai.OpenAI, max_tokens: int) -> dict:
    """Shares of answers a program can use, constrained and not; 8 requests at a time."""
    fields = "name (string), age (integer 0-120), job (string), mood (happy, sad or calm)"

    def constrained(p: str) -> bool:
        r = client.chat.completions.parse(
            model="m",
            messages=[{"role": "user", "content": p}],
            response_format=Person,
            max_tokens=max_tokens,
            temperature=0.7,
            seed=1,
        )
        return isinstance(r.choices[0].message.parsed, Person)

    def free(p: str) -> bool:
        r = client.chat.completions.create(
            model="m",
            max_tokens=max_tokens,
            temperature=0.7,
            seed=1,
            messages=[{"role": "user", "content": f"{p} Answer only with a JSON object with the keys {fields}."}],
        )
        return _person_ok(r.choices[0].message.content)

    def tools_required(p: str, parallel: bool = True) -> bool:
        r = client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": p}],
            tools=TOOLS,
            tool_choice="required",
            max_tokens=max_tokens,
            temperature=0.7,
            seed=1,
            parallel_tool_calls=parallel,
        )
        calls = r.choices[0].message.tool_calls or []
        ok = _calls_ok([{"name": c.function.name, "arguments": c.function.arguments} for c in calls])
        if not ok:
            print(f"  tool calls failed ({r.choices[0].finish_reason}): {(r.choices[0].message.content or '')[:200]}")
        return ok

    def tools_free(p: str) -> bool:
        desc = json.dumps([t["function"] for t in TOOLS])
        r = client.chat.completions.create(
            model="m",
            max_tokens=max_tokens,
            temperature=0.7,
            seed=1,
            messages=[
                {
                    "role": "system",
                    "content": f"You can call these functions: {desc}. Answer only with a JSON array "
                    'of calls: [{"name": ..., "parameters": {...}}].',
                },
                {"role": "user", "content": p},
            ],
        )
        try:
            calls = json.loads(r.choices[0].message.content or "")
            return _calls_ok([{"name": c["name"], "arguments": json.dumps(c["parameters"])} for c in calls])
        except (ValueError, KeyError, TypeError):
            return False

    out = {}
    with ThreadPoolExecutor(8) as pool:
        for name, fn, prompts in (
            ("json_constrained", constrained, person_prompts()),
            ("json_unconstrained", free, person_prompts()),
            ("tools_required", tools_required, tool_prompts()),
            ("tools_required_one_call", lambda p: tools_required(p, False), tool_prompts()),
            ("tools_unconstrained", tools_free, tool_prompts()),
        ):
            results = list(pool.map(fn, prompts))
            out[name] = sum(results) / len(results)
            print(f"{name}: {sum(results)}/{len(results)} parse and validate", flush=True)
    return out


async def _throughput(base: str, concurrency: int, num: int, max_tokens: int, schema: dict | None) -> float:
    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=600)
    sem = asyncio.Semaphore(concurrency)
    extra = {"structured_outputs": {"json": schema}} if schema else {"ignore_eos": True}

    async def one(i: int) -> int:
        async with sem:
            r = await client.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": f"Take notes on topic {i} as JSON."}],
                max_tokens=max_tokens,
                temperature=0.8,
                seed=i,
                extra_body=extra,
            )
            return r.usage.completion_tokens

    start = time.perf_counter()
    tokens = sum(await asyncio.gather(*(one(i) for i in range(num))))
    await client.close()
    return tokens / (time.perf_counter() - start)


def _accepted_drafts(base: str) -> tuple[float, float]:
    """(accepted, proposed) draft tokens so far, from the server's vLLM-named counters (0, 0 without drafts)."""
    import httpx

    text = httpx.get(base + "/metrics", timeout=30).text

    def total(name: str) -> float:
        found = re.search(rf"^{name}(?:_total)?(?:{{[^}}]*}})? ([0-9.e+]+)$", text, re.M)
        return float(found.group(1)) if found else 0.0

    return total("vllm:spec_decode_num_accepted_tokens"), total("vllm:spec_decode_num_draft_tokens")


def cost(base: str, a: argparse.Namespace) -> dict:
    """Output tok/s with and without the schema, per concurrency, each `--repeats` times interleaved; also the
    share of drafted tokens accepted in each run (prompt lookup pays on the looping text of EOS-ignored answers)."""
    out = {}
    for conc in a.concurrency:
        num = max(8, 2 * conc)
        runs: dict[str, list[float]] = {"plain": [], "schema": [], "plain_accept": [], "schema_accept": []}
        for _ in range(a.repeats):
            for name, schema in (("plain", None), ("schema", OPEN_SCHEMA)):
                acc0, drafts0 = _accepted_drafts(base)
                runs[name].append(asyncio.run(_throughput(base, conc, num, a.cost_tokens, schema)))
                acc1, drafts1 = _accepted_drafts(base)
                runs[f"{name}_accept"].append((acc1 - acc0) / max(1.0, drafts1 - drafts0))
        plain, constrained = (sum(runs[k]) / len(runs[k]) for k in ("plain", "schema"))
        out[f"c{conc}"] = {"plain_tok_s": plain, "schema_tok_s": constrained, "ratio": constrained / plain, **runs}
        print(
            f"concurrency {conc}: {plain:.1f} tok/s without, {constrained:.1f} with the schema: "
            f"{constrained / plain:.2f}x (drafts accepted: {runs['plain_accept']} without, "
            f"{runs['schema_accept']} with)",
            flush=True,
        )
    return out


def in_process(a: argparse.Namespace) -> dict:
    """Compile times (first, cached) and mask time per constrained token, on an engine in this process."""
    from pagedllm import SamplingParams, StructuredOutputsParams
    from pagedllm.engine import EngineConfig, LLMEngine

    engine = LLMEngine(EngineConfig(max_model_len=1024, log_stats_interval=0))
    schema = Person.model_json_schema()
    t0 = time.perf_counter()
    so = StructuredOutputsParams(json=schema)
    SamplingParams(structured_outputs=so)  # to grammar text, validated (what a request pays before it is queued)
    validate_s = time.perf_counter() - t0
    engine.grammars.compile(StructuredOutputsParams(json_object=True).grammar_text).result()  # the tokenizer, once
    t0 = time.perf_counter()
    engine.grammars.compile(so.grammar_text).result().deep_copy()
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    engine.grammars.compile(so.grammar_text).result().deep_copy()
    cached = time.perf_counter() - t0
    engine.grammars.mask_seconds, engine.grammars.mask_rows = 0.0, 0
    params = SamplingParams(
        temperature=0.7, seed=3, max_tokens=a.cost_tokens, structured_outputs=StructuredOutputsParams(json=OPEN_SCHEMA)
    )
    for i, p in enumerate(person_prompts()[:8]):
        engine.add_request(str(i), p, params)
    while engine.has_unfinished_requests():
        engine.step()
    per_token = engine.grammars.mask_seconds / max(1, engine.grammars.mask_rows)
    r = {
        "validate_ms": 1e3 * validate_s,
        "compile_first_ms": 1e3 * first,
        "compile_cached_ms": 1e3 * cached,
        "mask_us_per_token": 1e6 * per_token,
        "masked_rows": engine.grammars.mask_rows,
    }
    print(
        f"schema to grammar + validation {r['validate_ms']:.2f} ms; compile {r['compile_first_ms']:.2f} ms first, "
        f"{r['compile_cached_ms']:.3f} ms cached; mask {r['mask_us_per_token']:.0f} us per constrained token "
        f"({r['masked_rows']} rows)",
        flush=True,
    )
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--port", type=int, default=8321)
    ap.add_argument("--serve-args", default="--max-model-len 2048")
    ap.add_argument("--max-tokens", type=int, default=160, help="validity requests")
    ap.add_argument("--cost-tokens", type=int, default=48, help="tokens per request in the cost runs")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--repeats", type=int, default=2, help="cost runs per setting, interleaved")
    ap.add_argument("--skip", nargs="*", default=[], choices=["validity", "cost", "in-process"])
    ap.add_argument("--out", help="write the figures as JSON here")
    a = ap.parse_args()
    base = f"http://127.0.0.1:{a.port}"
    result: dict = {}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pagedllm.entrypoints.cli",
            "serve",
            "--port",
            str(a.port),
            "--served-model-name",
            "m",
            "--log-level",
            "warning",
            *a.serve_args.split(),
        ]
    )
    try:
        wait_ready(base, proc)
        client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=600)
        if "validity" not in a.skip:
            result["validity"] = validity(client, a.max_tokens)
        if "cost" not in a.skip:
            result["cost"] = cost(base, a)
    finally:
        proc.terminate()
        proc.wait(60)
    if "in-process" not in a.skip:
        result["in_process"] = in_process(a)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
