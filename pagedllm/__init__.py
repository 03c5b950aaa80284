"""pagedllm: an LLM inference and serving engine built around PagedAttention."""
from pagedllm.engine.llm import LLM
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams"]
