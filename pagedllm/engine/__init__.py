"""Requests, scheduling and the engine loop. These names are the package's public surface (what bench/ and rag/
may use), the /kv snapshot and its block-map layout among them."""

from pagedllm.engine.block_map import STATES, BlockMap, block_map, expand_row
from pagedllm.engine.config import EngineConfig, KVCacheDType, add_engine_args
from pagedllm.engine.kv_snapshot import KVSnapshot, RequestState, take_snapshot
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pagedllm.engine.stats import EngineStats
from pagedllm.engine.stream import stream_request

__all__ = [
    "KVCacheDType",
    "EngineConfig",
    "add_engine_args",
    "LLMEngine",
    "RequestOutput",
    "CompletionOutput",
    "RequestMetrics",
    "EngineStats",
    "KVSnapshot",
    "RequestState",
    "take_snapshot",
    "STATES",
    "BlockMap",
    "block_map",
    "expand_row",
    "stream_request",
]
