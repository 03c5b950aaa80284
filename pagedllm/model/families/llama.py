"""Llama (1, 2, 3.x) and Mistral: the plain pre-norm decoder; Llama 3.x's RoPE scaling from either source.

An HF folder carries Llama 3 scaling as `rope_scaling: {rope_type: llama3, ...}`; llama.cpp's converter turns
it into the `rope_freqs` tensor (one divisor per frequency), which is read here as RoPE type "factors".
Mistral v0.1 attends within `sliding_window` tokens; its GGUF files say "llama".
"""

from __future__ import annotations

from typing import Any

from pagedllm.model.families.base import Family, GGUFHeader


def gguf_fields(h: GGUFHeader) -> dict[str, Any]:
    if "rope_freqs.weight" in h.tensors:
        return {"rope_scaling": {"rope_type": "factors", "factors": h.read("rope_freqs.weight")}}
    return {}


LLAMA = Family("llama", ("LlamaForCausalLM",), ("llama",), ("llama",), gguf_fields=gguf_fields, gguf_permute_qk=True)
MISTRAL = Family(
    "mistral", ("MistralForCausalLM",), ("mistral",), ("mistral",), gguf_fields=gguf_fields, gguf_permute_qk=True
)
