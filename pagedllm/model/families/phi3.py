"""Phi-3 / 3.5 / Phi-4-mini: fused qkv_proj and gate_up_proj, partial rotary (Phi-4-mini: 3/4 of each head),
longrope scaling. In GGUF the factors are the `rope_factors_long` / `rope_factors_short` tensors and
`rope.dimension_count` gives the rotary width (config.py turns it into partial_rotary_factor)."""

from __future__ import annotations

from typing import Any

from pagedllm.model.families.base import LLAMA_LAYER, Family, GGUFHeader


def gguf_fields(h: GGUFHeader) -> dict[str, Any]:
    if "rope_factors_long.weight" not in h.tensors:
        return {}
    scaling: dict[str, Any] = {
        "rope_type": "longrope",
        "long_factor": h.read("rope_factors_long.weight"),
        "short_factor": h.read("rope_factors_short.weight"),
        "original_max_position_embeddings": int(h.get("rope.scaling.original_context_length")),
    }
    if h.get("rope.scaling.attn_factor") is not None:
        scaling["attention_factor"] = float(h.get("rope.scaling.attn_factor"))
    return {"rope_scaling": scaling}


PHI3 = Family(
    "phi3",
    ("Phi3ForCausalLM",),
    ("phi3",),
    ("phi3",),
    gguf_fields=gguf_fields,
    layer_tensors=LLAMA_LAYER | {"qkv": ("self_attn.qkv_proj",), "gate_up": ("mlp.gate_up_proj",)},
)
