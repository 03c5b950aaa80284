"""Qwen3.5-MoE / Qwen3.6-MoE text (`Qwen3_5MoeForCausalLM`, model_type qwen3_5_moe_text: Qwen3.5-35B-A3B,
Qwen3.6-35B-A3B): Qwen3.5's layers (qwen3_5.py: separate DeltaNet projections, gated attention) with Qwen3-Next's
sparse block in every layer (qwen3_next.py: softmax over the experts, the top k, a shared expert scaled by
sigmoid(x @ shared_expert_gate)), except that the top k are always renormalised (transformers' router does, and
the config has no `norm_topk_prob`). The released checkpoints are the multimodal
`Qwen3_5MoeForConditionalGeneration`, read as Qwen3.5's are: its `text_config` and language model's tensors.
llama.cpp's qwen35moe files are read as its qwen35 ones are (value heads tiled), its experts as every MoE GGUF's."""

from __future__ import annotations

from typing import Any

from pagedllm.model.families.base import Family, GGUFHeader
from pagedllm.model.families.moe import QWEN_SHARED_EXPERT, fused_experts, gguf_moe_fields, moe_tensors
from pagedllm.model.families.qwen3_5 import QWEN3_5
from pagedllm.model.families.qwen3_5 import gguf_fields as qwen3_5_gguf_fields
from pagedllm.model.families.qwen3_next import hf_fields as qwen3_next_fields


def hf_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    return qwen3_next_fields(cfg) | {"norm_topk_prob": True, "linear_proj": "split"}


def gguf_fields(h: GGUFHeader) -> dict[str, Any]:
    return qwen3_5_gguf_fields(h) | gguf_moe_fields(h, norm_topk_prob=True)


QWEN3_5_MOE = Family(
    "qwen3_5_moe",
    ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration"),
    ("qwen3_5_moe_text", "qwen3_5_moe"),
    ("qwen35moe",),
    hf_fields=hf_fields,
    gguf_fields=gguf_fields,
    layer_tensors=QWEN3_5.layer_tensors | moe_tensors("mlp") | QWEN_SHARED_EXPERT,
    moe=True,
    unfuse=fused_experts("mlp"),
    renamed=QWEN3_5.renamed,
    skipped=QWEN3_5.skipped,
)
