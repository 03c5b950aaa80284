"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's attention (q/k/v biases: `qkv_bias`) with sparse blocks:
softmax over the experts, the top k (renormalised only with `norm_topk_prob`, off in these models and always off
in llama.cpp's qwen2moe), beside a shared expert whose output is scaled by sigmoid(x @ shared_expert_gate);
dense layers where `mlp_only_layers` / `decoder_sparse_step` say."""

from __future__ import annotations

from typing import Any

from pagedllm.model.families.base import LLAMA_LAYER, Family, GGUFHeader
from pagedllm.model.families.moe import QWEN_SHARED_EXPERT, fused_experts, gguf_moe_fields, hf_moe_fields, moe_tensors


def hf_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    return hf_moe_fields(cfg) | {
        "attention_bias": bool(cfg.get("qkv_bias", True)),
        "shared_expert_intermediate_size": int(cfg.get("shared_expert_intermediate_size") or 0),
        "shared_expert_gate": bool(cfg.get("shared_expert_intermediate_size")),
    }


def gguf_fields(h: GGUFHeader) -> dict[str, Any]:
    return gguf_moe_fields(h, norm_topk_prob=False)


QWEN2_MOE = Family(
    "qwen2_moe",
    ("Qwen2MoeForCausalLM",),
    ("qwen2_moe",),
    ("qwen2moe",),
    hf_fields=hf_fields,
    gguf_fields=gguf_fields,
    layer_tensors=LLAMA_LAYER | moe_tensors("mlp") | QWEN_SHARED_EXPERT,
    bias_default=True,
    moe=True,
    unfuse=fused_experts("mlp"),
)
