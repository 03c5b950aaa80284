"""Requests, scheduling and the engine loop."""
from pagedllm.engine.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pagedllm.engine.stats import EngineStats

__all__ = ["EngineConfig", "LLMEngine", "RequestOutput", "CompletionOutput", "RequestMetrics", "EngineStats"]
