"""Qwen3-Next (`Qwen3NextForCausalLM`, Qwen3-Next-80B-A3B): Qwen3.5's hybrid layers (qwen3_5.py) with sparse blocks
as Qwen2-MoE's (softmax over the experts, the top k renormalised with `norm_topk_prob`, a shared expert scaled by
sigmoid(x @ shared_expert_gate)); its DeltaNet projections are two fused ones, `in_proj_qkvz` and `in_proj_ba`,
interleaved per key head (layers/deltanet.py reorders them). llama.cpp's converter splits `in_proj_qkvz` into
q, k, v (attn_qkv) and z (attn_gate) and keeps b and a interleaved (ssm_ba): `linear_proj` "qkv_z_ba"."""

from __future__ import annotations

from typing import Any

from pagedllm.model.families.base import LLAMA_LAYER, Family, GGUFHeader
from pagedllm.model.families.moe import QWEN_SHARED_EXPERT, fused_experts, gguf_moe_fields, hf_moe_fields, moe_tensors
from pagedllm.model.families.qwen3_5 import DELTANET_LAYER, QWEN3_5_PROJ, gguf_hybrid_fields, hybrid_fields


def hf_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    return (
        hybrid_fields(cfg)
        | hf_moe_fields(cfg)
        | {
            "shared_expert_intermediate_size": int(cfg.get("shared_expert_intermediate_size") or 0),
            "shared_expert_gate": bool(cfg.get("shared_expert_intermediate_size")),
            "linear_proj": "fused",
        }
    )


def gguf_fields(h: GGUFHeader) -> dict[str, Any]:
    """llama.cpp renormalises the top k of qwen3next and qwen35moe whatever the config said."""
    return gguf_hybrid_fields(h) | gguf_moe_fields(h, norm_topk_prob=True) | {"linear_proj": "qkv_z_ba"}


QWEN3_NEXT = Family(
    "qwen3_next",
    ("Qwen3NextForCausalLM",),
    ("qwen3_next",),
    ("qwen3next",),
    hf_fields=hf_fields,
    gguf_fields=gguf_fields,
    layer_tensors=LLAMA_LAYER
    | DELTANET_LAYER
    | QWEN3_5_PROJ
    | {"lin_qkvz": ("linear_attn.in_proj_qkvz",), "lin_ba": ("linear_attn.in_proj_ba",)}
    | moe_tensors("mlp")
    | QWEN_SHARED_EXPERT,
    moe=True,
    unfuse=fused_experts("mlp"),
    skipped=("mtp.",),  # the multi-token-prediction head
)
