"""LoRA adapters served by name (vLLM's interface): `--lora-modules name=path ...` (or vLLM's JSON form
`{"name": ..., "path": ..., "base_model_name": ...}`) names adapters that a request picks with its `model`; with
VLLM_ALLOW_RUNTIME_LORA_UPDATING true, POST /v1/load_lora_adapter and /v1/unload_lora_adapter add and drop them
while the server runs. Each adapter gets a fresh id when it is named: the id, never the name, keys its KV blocks,
so an adapter unloaded and loaded again from another path never meets the old one's cache.

Unloading an adapter that requests still use is refused (400), so no request breaks; a request already queued
when its adapter is unloaded still runs (the engine loads the adapter again from its path).
"""

from __future__ import annotations

import json
import os

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import PlainTextResponse

from pagedllm.errors import UserError
from pagedllm.lora_request import LoRARequest
from pagedllm.server.errors import ERROR_RESPONSES, APIError
from pagedllm.server.protocol_lora import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from pagedllm.server.serving_engine import ServingContext, serving

RUNTIME_UPDATES_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def runtime_updates_allowed() -> bool:
    """vLLM's switch for the load / unload routes: "1" or "true" (any case)."""
    return os.environ.get(RUNTIME_UPDATES_ENV, "0").strip().lower() in ("1", "true")


def parse_lora_modules(items: list[str], first_id: int = 1) -> list[LoRARequest]:
    """--lora-modules' values: `name=path`, or a JSON object with name, path and base_model_name; ids from
    `first_id` on. A bad one is a UserError naming the flag."""
    out: list[LoRARequest] = []
    for i, item in enumerate(items, first_id):
        base = None
        if item.lstrip().startswith("{"):
            try:
                spec = json.loads(item)
                name, path, base = spec["name"], spec["path"], spec.get("base_model_name")
            except (ValueError, KeyError, TypeError):
                raise UserError(f"--lora-modules: {item!r} is not a JSON object with name and path") from None
        else:
            name, sep, path = item.partition("=")
            if not sep or not name or not path:
                raise UserError(f"--lora-modules: {item!r} is not name=path")
        if not isinstance(name, str) or not isinstance(path, str):
            raise UserError(f"--lora-modules: {item!r}: name and path must be strings")
        if any(lora.lora_name == name for lora in out):
            raise UserError(f"--lora-modules: the name {name!r} is given twice")
        out.append(LoRARequest(name, i, path, base))
    return out


router = APIRouter()


@router.post(
    "/v1/load_lora_adapter",
    response_class=PlainTextResponse,
    responses={400: ERROR_RESPONSES[400], 401: ERROR_RESPONSES[401]},
)
async def load_lora_adapter(
    body: LoadLoRAAdapterRequest, request: Request, ctx: ServingContext = Depends(serving)
) -> Response:
    """vLLM's: load an adapter (checked against the model now) and serve it under `lora_name`."""
    name = body.lora_name
    if name in ctx.loras or name in ctx.model_names:
        raise APIError(f"The lora adapter '{name}' has already been loaded.", 400, param="lora_name")
    lora = LoRARequest(name, ctx.next_lora_id(), body.lora_path, ctx.model_names[0])
    await request.app.state.engine.add_lora(lora)
    ctx.loras[name] = lora
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


@router.post(
    "/v1/unload_lora_adapter",
    response_class=PlainTextResponse,
    responses={400: ERROR_RESPONSES[400], 401: ERROR_RESPONSES[401], 404: ERROR_RESPONSES[404]},
)
async def unload_lora_adapter(
    body: UnloadLoRAAdapterRequest, request: Request, ctx: ServingContext = Depends(serving)
) -> Response:
    """vLLM's: stop serving an adapter and unload it; refused (400) while requests use it."""
    name = body.lora_name
    lora = ctx.loras.pop(name, None)
    if lora is None:
        raise APIError(f"The lora adapter '{name}' cannot be found.", 404, param="lora_name")
    try:
        await request.app.state.engine.remove_lora(lora.lora_int_id)
    except BaseException:
        ctx.loras[name] = lora  # still served: its requests run on
        raise
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
