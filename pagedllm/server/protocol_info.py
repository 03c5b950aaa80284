"""The answers of the read-only routes (serving_info.py): /health, /v1/models and /v1/kv; `KVPool` is also the
cluster's /v1/kv totals and each replica's (cluster/app.py)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

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


class KVGroupState(ResponseModel):
    """A KV-cache group: layers that attend alike, with a block table per request (kv/kv_spec.py)."""

    window: int | None = Field(description="tokens a query of these layers sees, itself included; null: all")
    layers: list[int]
    frees_blocks: bool = Field(description="whether blocks out of the window go back to the pool before the end")
    blocks: int = Field(description="blocks the running requests hold in this group now (a shared one once)")


class RecurrentState(ResponseModel):
    """A hybrid model's linear-attention layers: a state slot per running request, and the prefix cache's
    checkpoints of it at block boundaries (kv/state_slots.py)."""

    mixer: str = Field(description="gated_deltanet, mamba2 or short_conv")
    layers: list[int]
    bytes_per_request: int = Field(description="one slot: every such layer's conv and recurrent state")
    slots: int = Field(description="slots reserved out of the KV budget: at most that many requests run at once")
    slots_used: int
    slots_free: int
    checkpoint_blocks_each: int = Field(description="pool blocks one checkpoint takes (0: prefix caching off)")
    checkpoints: int = Field(description="checkpoints cached now (all their blocks in the pool)")
    checkpoint_blocks: int = Field(description="pool blocks those take, evictable with the KV blocks unless held")
    checkpoints_held: int = Field(description="of those, held by a prefix hit until it is copied")
    checkpoint_disk_loads: int = Field(description="checkpoints read back from the disk tier (cumulative)")


class KVState(KVPool):
    model_name: str
    num_aborted: int
    recent_aborted_request_ids: list[str]
    kv_groups: list[KVGroupState] = Field(description="the KV-cache groups, each with its own block tables")
    recurrent_state: RecurrentState | None = Field(description="a hybrid model's state slots; null: none")

    @staticmethod
    def groups_of(st: EngineStats, mixer: str) -> dict[str, Any]:
        """The `kv_groups` and `recurrent_state` fields of the engine's stats (`mixer`: the model's)."""
        rs = st.recurrent_state
        return {
            "kv_groups": [
                KVGroupState(window=g.window, layers=g.layers, frees_blocks=g.window is not None, blocks=g.blocks)
                for g in st.kv_groups
            ],
            "recurrent_state": None
            if rs is None
            else RecurrentState(mixer=mixer, slots_free=rs.slots - rs.slots_used, **vars(rs)),
        }
