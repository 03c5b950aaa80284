"""Granite 3.x: Llama with four multipliers: embeddings, each residual branch, the attention scores (in place of
1/sqrt(head_dim)) and the logits (divided)."""

from __future__ import annotations

from typing import Any

from pagedllm.model.families.base import Family, GGUFHeader


def hf_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    return {
        "embedding_multiplier": float(cfg.get("embedding_multiplier", 1.0)),
        "residual_multiplier": float(cfg.get("residual_multiplier", 1.0)),
        "attn_scale": float(cfg.get("attention_multiplier", 1.0)),
        "logits_divisor": float(cfg.get("logits_scaling", 1.0)),
    }


def gguf_fields(h: GGUFHeader) -> dict[str, Any]:
    return {
        "embedding_multiplier": float(h.get("embedding_scale", 1.0)),
        "residual_multiplier": float(h.get("residual_scale", 1.0)),
        "attn_scale": float(h.get("attention.scale", 1.0)),
        "logits_divisor": float(h.get("logit_scale", 1.0)),
    }


GRANITE = Family(
    "granite",
    ("GraniteForCausalLM",),
    ("granite",),
    ("granite",),
    hf_fields=hf_fields,
    gguf_fields=gguf_fields,
    gguf_permute_qk=True,
)
