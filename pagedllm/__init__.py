"""pagedllm: an LLM inference and serving engine built around PagedAttention."""
