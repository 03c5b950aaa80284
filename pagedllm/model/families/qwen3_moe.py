"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (q/k norms per head) with sparse blocks: softmax
over the experts, the top k, renormalised with `norm_topk_prob` (llama.cpp's qwen3moe always renormalises);
dense layers where `mlp_only_layers` / `decoder_sparse_step` say."""

from __future__ import annotations

from typing import Any

from pagedllm.model.families.base import LLAMA_LAYER, Family, GGUFHeader
from pagedllm.model.families.moe import fused_experts, gguf_moe_fields, hf_moe_fields, moe_tensors


def hf_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    return {"qk_norm": "head"} | hf_moe_fields(cfg)


def gguf_fields(h: GGUFHeader) -> dict[str, Any]:
    return {"qk_norm": "head"} | gguf_moe_fields(h, norm_topk_prob=True)


QWEN3_MOE = Family(
    "qwen3_moe",
    ("Qwen3MoeForCausalLM",),
    ("qwen3_moe",),
    ("qwen3moe",),
    hf_fields=hf_fields,
    gguf_fields=gguf_fields,
    layer_tensors=LLAMA_LAYER | moe_tensors("mlp"),
    moe=True,
    unfuse=fused_experts("mlp"),
)
