"""Qwen3.5 / Qwen3.6 text (`Qwen3_5ForCausalLM`, model_type qwen3_5_text): a hybrid of Gated DeltaNet layers
(layers/deltanet.py; `layer_types` "linear_attention", three of every four by default) and full-attention layers
whose output is gated by sigmoid(gate) (each head's gate rows beside its query rows in q_proj), q/k norms per head,
partial rotary (a quarter of each head by default; the multimodal RoPE sections coincide for text, so plain RoPE),
every RMSNorm but the DeltaNet's gated one as (1 + w). The dense MLP is Llama's. The released checkpoints are the
multimodal `Qwen3_5ForConditionalGeneration`: its `text_config` and language model's tensors are read (config.py,
`renamed`), its vision tower and multi-token-prediction head skipped."""

from __future__ import annotations

from typing import Any

from pagedllm.model.families.base import LLAMA_LAYER, Family

DELTANET_LAYER: dict[str, tuple[str, ...]] = {
    "lin_conv": ("linear_attn.conv1d",),
    "lin_a_log": ("linear_attn.A_log",),
    "lin_dt_bias": ("linear_attn.dt_bias",),
    "lin_norm": ("linear_attn.norm",),
    "lin_out": ("linear_attn.out_proj",),
}
QWEN3_5_PROJ = {
    "lin_qkv": ("linear_attn.in_proj_qkv",),
    "lin_z": ("linear_attn.in_proj_z",),
    "lin_b": ("linear_attn.in_proj_b",),
    "lin_a": ("linear_attn.in_proj_a",),
}


def layer_types(cfg: dict[str, Any]) -> list[str]:
    """config.json's `layer_types`, or transformers' default: every `full_attention_interval`-th layer full."""
    types = cfg.get("layer_types")
    if types is not None:
        return [str(t) for t in types]
    every = int(cfg.get("full_attention_interval") or 4)
    n = int(cfg["num_hidden_layers"])
    return ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n)]


def hybrid_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """What Qwen3.5 and Qwen3-Next share: the layer kinds, the DeltaNet's shape, the gated attention."""
    rp = cfg.get("rope_parameters")
    rp = rp if isinstance(rp, dict) else {}
    return {
        "qk_norm": "head",
        "norm_offset": 1.0,
        "attn_output_gate": True,
        "layer_types": layer_types(cfg),
        "partial_rotary_factor": float(cfg.get("partial_rotary_factor") or rp.get("partial_rotary_factor") or 0.25),
        "linear_num_key_heads": int(cfg.get("linear_num_key_heads", 16)),
        "linear_num_value_heads": int(cfg.get("linear_num_value_heads", 32)),
        "linear_key_head_dim": int(cfg.get("linear_key_head_dim", 128)),
        "linear_value_head_dim": int(cfg.get("linear_value_head_dim", 128)),
        "linear_conv_kernel_dim": int(cfg.get("linear_conv_kernel_dim", 4)),
    }


QWEN3_5 = Family(
    "qwen3_5",
    ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration"),  # the latter: the released checkpoints, text only
    ("qwen3_5_text", "qwen3_5"),
    ("qwen35",),
    hf_fields=hybrid_fields,
    layer_tensors=LLAMA_LAYER | DELTANET_LAYER | QWEN3_5_PROJ,
    renamed=(("model.language_model.", "model."),),
    skipped=("model.visual.", "mtp."),
)
