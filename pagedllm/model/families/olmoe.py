"""OLMoE (OLMoE-1B-7B): Llama's pre-norm layer with OLMo 2's q/k RMSNorms over the whole projection, and sparse
blocks: softmax over the experts, the top k, not renormalised (`norm_topk_prob`, off there and in llama.cpp's
olmoe). The experts' size is `intermediate_size`; `clip_qkv` (clamping q, k, v) is refused, not skipped."""

from __future__ import annotations

from typing import Any

from pagedllm.errors import ModelLoadError
from pagedllm.model.families.base import LLAMA_LAYER, Family, GGUFHeader
from pagedllm.model.families.moe import fused_experts, gguf_moe_fields, hf_moe_fields, moe_tensors


def hf_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    if cfg.get("clip_qkv") is not None:
        raise ModelLoadError(f"OLMoE's clip_qkv ({cfg['clip_qkv']}) is not supported")
    return {"qk_norm": "full"} | hf_moe_fields(cfg, "intermediate_size")


def gguf_fields(h: GGUFHeader) -> dict[str, Any]:
    return {"qk_norm": "full"} | gguf_moe_fields(h, norm_topk_prob=False)


OLMOE = Family(
    "olmoe",
    ("OlmoeForCausalLM",),
    ("olmoe",),
    ("olmoe",),
    hf_fields=hf_fields,
    gguf_fields=gguf_fields,
    layer_tensors=LLAMA_LAYER | moe_tensors("mlp"),
    moe=True,
    unfuse=fused_experts("mlp"),
)
