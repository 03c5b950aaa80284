"""The answers of the read-only routes (serving_info.py): /health, /v1/models and /v1/kv; `KVPool` is also the
cluster's /v1/kv totals and each replica's (cluster/app.py)."""

from __future__ import annotations

from typing import Any, Literal

from pagedllm.engine.stats import EngineStats
from pagedllm.server.protocol import ResponseModel


class HealthResponse(ResponseModel):
    status: Literal["ok"]


class ModelCard(ResponseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    parent: str | None
    max_model_len: int


class ModelList(ResponseModel):
    object: Literal["list"]
    data: list[ModelCard]


class KVPool(ResponseModel):
    """A block pool and its queues: one mapping of the engine's stats, for the server's /v1/kv and the cluster's
    (its totals and each replica's)."""

    block_size: int
    total_blocks: int
    free_blocks: int
    used_blocks: int
    cached_blocks: int
    kv_cache_usage: float
    num_running: int
    num_waiting: int
    prefix_cache_queries: int
    prefix_cache_hits: int

    @staticmethod
    def fields_of(st: EngineStats) -> dict[str, Any]:
        return {
            "block_size": st.block_size,
            "total_blocks": st.num_blocks,
            "free_blocks": st.num_free_blocks,
            "used_blocks": st.num_used_blocks,
            "cached_blocks": st.num_cached_blocks,
            "kv_cache_usage": st.kv_usage,
            "num_running": st.num_running,
            "num_waiting": st.num_waiting,
            "prefix_cache_queries": st.prefix_cache_queries,
            "prefix_cache_hits": st.prefix_cache_hits,
        }


class KVState(KVPool):
    model_name: str
    num_aborted: int
    recent_aborted_request_ids: list[str]
