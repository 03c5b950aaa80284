"""Requests, scheduling and the engine loop."""
from pagedllm.engine.config import EngineConfig, add_engine_args
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pagedllm.engine.stats import EngineStats

__all__ = ["EngineConfig", "add_engine_args", "LLMEngine", "RequestOutput", "CompletionOutput", "RequestMetrics", "EngineStats"]
