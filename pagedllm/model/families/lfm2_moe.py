"""LFM2-MoE (`Lfm2MoeForCausalLM`, Liquid AI's LFM2-8B-A1B): LFM2's short-conv and attention layers (lfm2.py) whose
MLP is, after the first `num_dense_layers` dense ones (LFM2's SwiGLU at `intermediate_size`, not adjusted), a
sparse block: a sigmoid router whose top k are chosen by score + a learned bias per expert (`expert_bias`) and
weighed by the scores, renormalised (`norm_topk_prob`) and scaled (`routed_scaling_factor`): moe.py's "sigmoid"
router. `save_pretrained` writes one module per expert (`feed_forward.experts.N.w1 / w3 / w2`); transformers 5's
state dict, 3-D `feed_forward.experts.gate_up_proj` / `down_proj`. llama.cpp's lfm2moe files: the bias as
`exp_probs_b.bias`, sigmoid gating (`expert_gating_func` 2), the dense lead as `leading_dense_block_count`, the
top k always renormalised, scaled by `expert_weights_scale` where written."""

from __future__ import annotations

from typing import Any

from pagedllm.model.families.base import Family, GGUFHeader
from pagedllm.model.families.lfm2 import LFM2_LAYER
from pagedllm.model.families.lfm2 import gguf_fields as lfm2_gguf_fields
from pagedllm.model.families.lfm2 import hf_fields as lfm2_fields
from pagedllm.model.families.moe import fused_experts, moe_tensors

_EXPERT = ("w1", "w3", "w2")  # an expert's gate, up, down


def hf_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    dense = int(cfg.get("num_dense_layers") or 0)
    return lfm2_fields(cfg) | {
        "intermediate_size": int(cfg["intermediate_size"]),
        "num_experts": int(cfg["num_experts"]),
        "num_experts_per_tok": int(cfg["num_experts_per_tok"]),
        "moe_intermediate_size": int(cfg["moe_intermediate_size"]),
        "moe_router": "sigmoid",
        "norm_topk_prob": bool(cfg.get("norm_topk_prob", True)),
        "e_score_correction_bias": bool(cfg.get("use_expert_bias", True)),
        "routed_scaling_factor": float(cfg.get("routed_scaling_factor") or 1.0),
        "mlp_only_layers": list(range(dense)),
    }


def gguf_fields(h: GGUFHeader) -> dict[str, Any]:
    if h.get("expert_gating_func") not in (None, 2):
        return {"moe_router": f"gating function {h.get('expert_gating_func')}"}  # named by config.py's check
    dense = int(h.get("leading_dense_block_count") or 0)
    return lfm2_gguf_fields(h) | {
        "num_experts": int(h.get("expert_count")),
        "num_experts_per_tok": int(h.get("expert_used_count")),
        "moe_intermediate_size": int(h.get("expert_feed_forward_length")),
        "moe_router": "sigmoid",
        "norm_topk_prob": True,
        "e_score_correction_bias": f"blk.{dense}.exp_probs_b.bias" in h.tensors,
        "routed_scaling_factor": float(h.get("expert_weights_scale") or 1.0),
        "mlp_only_layers": list(range(dense)),
    }


LFM2_MOE = Family(
    "lfm2_moe",
    ("Lfm2MoeForCausalLM",),
    ("lfm2_moe",),
    ("lfm2moe",),
    hf_fields=hf_fields,
    gguf_fields=gguf_fields,
    layer_tensors=LFM2_LAYER
    | {"gate_up": ("feed_forward.w1", "feed_forward.w3"), "down": ("feed_forward.w2",)}
    | moe_tensors("feed_forward", names=_EXPERT)
    | {"score_bias": ("feed_forward.expert_bias",)},
    tie_default=True,
    moe=True,
    unfuse=fused_experts("feed_forward", names=_EXPERT),
    final_norm="embedding_norm",
)
