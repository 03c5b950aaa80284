"""GET /health, /metrics, /v1/models and /v1/kv: what the server is and how it is doing. /v1/kv is pagedllm's
debug route (the block pool and the engine's queues), so tests and the soak check that every block came back."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request, Response

from pagedllm.engine.metrics import CONTENT_TYPE, ServerMetrics
from pagedllm.server.errors import ERROR_RESPONSES, error_response
from pagedllm.server.protocol import HealthResponse, KVState, ModelCard, ModelList
from pagedllm.server.serving_engine import ServingContext, serving

router = APIRouter()


@router.get("/health", response_model=HealthResponse, responses={503: ERROR_RESPONSES[503]})
def health(ctx: ServingContext = Depends(serving)) -> HealthResponse | Response:
    """200 while the engine loop runs; 503 once it stopped (shutting down, or crashed: then the process exits)."""
    if not ctx.engine.is_healthy:
        return error_response("the engine loop is not running", 503)
    return HealthResponse(status="ok")


@router.get("/metrics", response_class=Response, responses={200: {"content": {CONTENT_TYPE: {}}}})
def metrics(request: Request) -> Response:
    """Prometheus metrics with vLLM's names."""
    m: ServerMetrics = request.app.state.metrics
    return Response(m.render(), media_type=CONTENT_TYPE)


@router.get("/v1/models", response_model=ModelList, responses={401: ERROR_RESPONSES[401]})
def models(ctx: ServingContext = Depends(serving)) -> ModelList:
    return ModelList(
        object="list",
        data=[
            ModelCard(
                id=n,
                object="model",
                created=ctx.created,
                owned_by="pagedllm",
                root=ctx.model_root,
                parent=None,
                max_model_len=ctx.engine.max_model_len,
            )
            for n in ctx.model_names
        ],
    )


@router.get("/v1/kv", response_model=KVState, responses={401: ERROR_RESPONSES[401]})
def kv_state(ctx: ServingContext = Depends(serving)) -> KVState:
    st = ctx.engine.stats()
    return KVState(
        model_name=ctx.engine.engine.model_config.name or ctx.model_root,
        block_size=st.block_size,
        total_blocks=st.num_blocks,
        free_blocks=st.num_free_blocks,
        used_blocks=st.num_used_blocks,
        cached_blocks=st.num_cached_blocks,
        kv_cache_usage=st.kv_usage,
        num_running=st.num_running,
        num_waiting=st.num_waiting,
        num_aborted=ctx.engine.num_aborted,
        recent_aborted_request_ids=ctx.engine.aborted_ids[-32:],
    )
