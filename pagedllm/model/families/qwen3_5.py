"""Qwen3.5 / Qwen3.6 text (`Qwen3_5ForCausalLM`, model_type qwen3_5_text): a hybrid of Gated DeltaNet layers
(layers/deltanet.py; `layer_types` "linear_attention", three of every four by default) and full-attention layers
whose output is gated by sigmoid(gate) (each head's gate rows beside its query rows in q_proj), q/k norms per head,
partial rotary (a quarter of each head by default; the multimodal RoPE sections coincide for text, so plain RoPE),
every RMSNorm but the DeltaNet's gated one as (1 + w). The dense MLP is Llama's. The released checkpoints are the
multimodal `Qwen3_5ForConditionalGeneration`: its `text_config` and language model's tensors are read (config.py,
`renamed`), its vision tower and multi-token-prediction head skipped.

llama.cpp's converter (its qwen35 / qwen35moe / qwen3next files) stores those norms as 1 + w, A_log as
A = -exp(A_log), dt_bias as ssm_dt.bias, the conv squeezed to [C, K]; for qwen35 / qwen35moe it reorders the
value heads from grouped (by key head) to tiled, which the model reads as stored (`linear_value_heads_tiled`)
so that quantized weights stay as they are."""

from __future__ import annotations

from typing import Any

from pagedllm.model.families.base import LLAMA_LAYER, Family, GGUFHeader

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


def gguf_hybrid_fields(h: GGUFHeader) -> dict[str, Any]:
    """What llama.cpp's qwen35, qwen35moe and qwen3next keys say alike: the recurrent layers (a flag per layer, or
    every `full_attention_interval`-th one full), the DeltaNet's shape in its ssm.* keys (groups = key heads,
    time_step_rank = value heads, state_size = key head size, inner_size = all value heads' width)."""
    n = int(h.get("block_count"))
    flags = h.get("attention.recurrent_layers")
    every = int(h.get("full_attention_interval") or 4)
    recurrent = [bool(f) for f in flags][:n] if isinstance(flags, list) else [(i + 1) % every != 0 for i in range(n)]
    heads_v = int(h.require("ssm.time_step_rank"))
    return {
        "qk_norm": "head",
        "norm_offset": 0.0,  # stored as 1 + w
        "attn_output_gate": True,
        "layer_types": ["linear_attention" if r else "full_attention" for r in recurrent],
        "linear_num_key_heads": int(h.require("ssm.group_count")),
        "linear_num_value_heads": heads_v,
        "linear_key_head_dim": int(h.require("ssm.state_size")),
        "linear_value_head_dim": int(h.require("ssm.inner_size")) // heads_v,
        "linear_conv_kernel_dim": int(h.require("ssm.conv_kernel")),
    }


def gguf_fields(h: GGUFHeader) -> dict[str, Any]:
    return gguf_hybrid_fields(h) | {"linear_value_heads_tiled": True}


QWEN3_5 = Family(
    "qwen3_5",
    ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration"),  # the latter: the released checkpoints, text only
    ("qwen3_5_text", "qwen3_5"),
    ("qwen35",),
    hf_fields=hybrid_fields,
    gguf_fields=gguf_fields,
    layer_tensors=LLAMA_LAYER | DELTANET_LAYER | QWEN3_5_PROJ,
    renamed=(("model.language_model.", "model."),),
    skipped=("model.visual.", "mtp."),
)
