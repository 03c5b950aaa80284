"""Qwen2 / Qwen2.5: Llama with q/k/v biases (always present, whatever config.json says of attention_bias)."""

from __future__ import annotations

from pagedllm.model.families.base import Family

QWEN2 = Family("qwen2", ("Qwen2ForCausalLM",), ("qwen2",), ("qwen2",), bias_default=True)
