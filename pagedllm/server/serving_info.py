"""GET /health, /metrics, /v1/models and /v1/kv: what the server is and how it is doing. /v1/kv is pagedllm's
debug route (the block pool and the engine's queues), so tests and the soak check that every block came back."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request, Response

from pagedllm.engine.async_engine import AsyncLLMEngine
from pagedllm.engine.metrics import CONTENT_TYPE
from pagedllm.server.errors import ERROR_RESPONSES, error_response
from pagedllm.server.protocol_info import HealthResponse, KVPool, KVState, ModelCard, ModelList
from pagedllm.server.serving_engine import ServingContext, serving

router = APIRouter()


@router.get("/health", response_model=HealthResponse, responses={503: ERROR_RESPONSES[503]})
def health(ctx: ServingContext = Depends(serving)) -> HealthResponse | Response:
    """200 while the engine loop runs; 503 once it stopped (shutting down, or crashed: then the process exits)."""
    if not ctx.engine.is_healthy:
        return error_response("the engine loop is not running", 503)
    return HealthResponse(status="ok")


@router.get("/metrics", response_class=Response, responses={200: {"content": {CONTENT_TYPE: {}}}})
def metrics(request: Request, ctx: ServingContext = Depends(serving)) -> Response:
    """Prometheus metrics with vLLM's names: the engine's stat logger, labelled with the first served name."""
    engine: AsyncLLMEngine = request.app.state.engine  # one engine in this process (a cluster has its own page)
    return Response(engine.metrics.render(engine.stats(), ctx.model_names[0]), media_type=CONTENT_TYPE)


@router.get("/v1/models", response_model=ModelList, responses={401: ERROR_RESPONSES[401]})
def models(request: Request, ctx: ServingContext = Depends(serving)) -> ModelList:
    """The served names, then those of the embedding models served beside them (--embedding-model), then the
    LoRA adapters, each with its base model as `parent` (vLLM's)."""
    embedders = getattr(request.app.state, "embedders", [])
    extra = [(n, e.max_len) for e in embedders for n in e.names if n not in ctx.model_names]
    max_len = ctx.engine.max_model_len
    cards = [(n, ctx.model_root, None, max_len) for n in ctx.model_names] + [(n, n, None, m) for n, m in extra]
    cards += [(n, lora.lora_path, lora.base_model_name or ctx.model_names[0], max_len) for n, lora in ctx.loras.items()]
    return ModelList(
        object="list",
        data=[
            ModelCard(
                id=n,
                object="model",
                created=ctx.created,
                owned_by="pagedllm",
                root=root,
                parent=parent,
                max_model_len=max_len,
            )
            for n, root, parent, max_len in cards
        ],
    )


@router.get("/v1/kv", response_model=KVState, responses={401: ERROR_RESPONSES[401]})
def kv_state(ctx: ServingContext = Depends(serving)) -> KVState:
    st = ctx.engine.stats()
    return KVState(
        **KVPool.fields_of(st),
        model_name=ctx.engine.model_config.name or ctx.model_root,
        num_aborted=ctx.engine.aborts.total,
        recent_aborted_request_ids=list(ctx.engine.aborts.recent)[-32:],
        **KVState.groups_of(st, ctx.engine.model_config.recurrent_mixer),
    )
