"""Qwen3: Llama with an RMSNorm over each head's query and key (`q_norm`, `k_norm`) before RoPE, no biases."""

from __future__ import annotations

from typing import Any

from pagedllm.model.families.base import Family


def fields(_source: Any) -> dict[str, Any]:
    return {"qk_norm": "head"}


QWEN3 = Family("qwen3", ("Qwen3ForCausalLM",), ("qwen3",), ("qwen3",), hf_fields=fields, gguf_fields=fields)
