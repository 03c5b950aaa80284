"""Gemma 4 (text): Gemma 3's layer (gemma2.py, gemma3.py) with plain-weight RMSNorms (no 1 + w), a softmax scale
of 1 (the q/k norms set the scale), V RMS-normed without a weight, and what is new in Gemma 4:

- full-attention layers with their own head size and, with `attention_k_eq_v`, their own KV heads and no V
  projection (V is K's projection before its norm and RoPE); their RoPE is "proportional" (rope.py) over that head;
- the last `num_kv_shared_layers` layers read the KV of the last earlier layer of their kind and store none
  (kv_spec.py gives them no cache slot); with `use_double_wide_mlp` their MLP is twice as wide;
- per-layer input embeddings (PLE, `hidden_size_per_layer_input`): a second embedding table gives every layer a
  small vector per token, mixed with a projection of the main embedding (layers/per_layer_input.py), which
  each layer gates into the residual stream after its MLP;
- a learned scalar on each layer's output (`layer_scalar`).

Google's checkpoints are Gemma4ForConditionalGeneration (text, vision, audio): the text model runs, read from
config.json's text_config and the tensors under model.language_model.; images and audio are not taken.

The 26B-A4B's sparse block (`enable_moe_block`, every layer) runs beside the dense MLP (ModelConfig.moe_beside_mlp:
each output normed, then summed), the experts reading their own norm of the stream and the router the stream
itself, RMS-normed times a learned scale, its routing weights times a learned number per expert. llama.cpp
stores each layer's experts' gate and up in one `ffn_gate_up_exps` (the loader splits each expert's rows).
"""

from __future__ import annotations

from typing import Any

from pagedllm.errors import ModelLoadError
from pagedllm.model.families.base import Family, GGUFHeader, Unfuse, every_nth
from pagedllm.model.families.gemma2 import GEMMA_LAYER

GEMMA4_LAYER = GEMMA_LAYER | {
    "q": ("self_attn.q_proj",),  # a layer that reads another's KV projects only queries
    "qk": ("self_attn.q_proj", "self_attn.k_proj"),  # attention_k_eq_v: K is V
    "ple_gate": ("per_layer_input_gate",),
    "ple_proj": ("per_layer_projection",),
    "ple_norm": ("post_per_layer_input_norm",),
    "layer_scalar": ("layer_scalar",),
    # the 26B-A4B's sparse block, beside the dense MLP (its 3-D experts split by UNFUSE)
    "experts_gate_up": ("experts.{e}.gate_proj", "experts.{e}.up_proj"),
    "experts_down": ("experts.{e}.down_proj",),
    "router": ("router.proj",),
    "router_scale": ("router.scale",),
    "expert_scale": ("router.per_expert_scale",),
    "moe_norm": ("pre_feedforward_layernorm_2",),
    "mlp_out_norm_1": ("post_feedforward_layernorm_1",),
    "moe_out_norm": ("post_feedforward_layernorm_2",),
}
UNFUSE = (
    Unfuse("experts.gate_up_proj", ("experts.{e}.gate_proj.weight", "experts.{e}.up_proj.weight")),
    Unfuse("experts.down_proj", ("experts.{e}.down_proj.weight",)),
)
# transformers' defaults where config.json leaves them out (Gemma4TextConfig)
_ROPE_DEFAULT = {
    "rope_theta": 1_000_000.0,
    "rope_scaling": {"rope_type": "proportional", "partial_rotary_factor": 0.25},
    "rope_local_theta": 10_000.0,
}


def _global_shape(cfg: dict[str, Any]) -> tuple[int, int | None]:
    """The full-attention layers' head size and KV heads: transformers 5's per_layer_config (one entry per full
    layer) or the released configs' global_head_dim / num_global_key_value_heads (the KV heads only with k_eq_v)."""
    per_layer = cfg.get("per_layer_config") or {}
    full = next(iter(per_layer.values()), None) if isinstance(per_layer, dict) else None
    if isinstance(full, dict):
        heads = full.get("num_key_value_heads")
        return int(full.get("head_dim") or cfg.get("head_dim") or 256), None if heads is None else int(heads)
    heads = cfg.get("num_global_key_value_heads") if cfg.get("attention_k_eq_v") else None
    return int(cfg.get("global_head_dim") or 512), None if heads is None else int(heads)


def _moe_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """The 26B-A4B's sparse block in every layer: softmax over the experts, the top k renormalised."""
    if not cfg.get("enable_moe_block"):
        return {}
    return {
        "num_experts": int(cfg["num_experts"]),
        "num_experts_per_tok": int(cfg["top_k_experts"]),
        "moe_intermediate_size": int(cfg["moe_intermediate_size"]),
        "norm_topk_prob": True,
        "moe_beside_mlp": True,
    }


def hf_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    if cfg.get("use_bidirectional_attention") == "all":
        raise ModelLoadError("use_bidirectional_attention 'all' is not supported (pagedllm decodes causally)")
    layers = int(cfg["num_hidden_layers"])
    types = list(cfg.get("layer_types") or every_nth(layers, 6, "full_attention", "sliding_attention"))
    types[-1] = "full_attention"  # transformers forces it so
    head_dim, kv_heads = _global_shape(cfg)
    out: dict[str, Any] = {
        "norm_offset": 0.0,
        "embedding_multiplier": int(cfg["hidden_size"]) ** 0.5,
        "post_norms": True,
        "qk_norm": "head",
        "v_norm": True,
        "layer_scalar": True,
        "hidden_act": cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh",
        "attn_scale": 1.0,
        "final_logit_softcapping": cfg.get("final_logit_softcapping"),
        "layer_types": types,
        "partial_rotary_factor": 1.0,  # proportional RoPE turns the whole head (its zero frequencies: none)
        "global_head_dim": head_dim,
        "num_global_kv_heads": kv_heads,
        "attention_k_eq_v": bool(cfg.get("attention_k_eq_v")),
        "num_kv_shared_layers": int(cfg.get("num_kv_shared_layers") or 0),
        "double_wide_shared_mlp": bool(cfg.get("use_double_wide_mlp")),
        "hidden_size_per_layer_input": int(cfg.get("hidden_size_per_layer_input") or 0),
        "vocab_size_per_layer_input": int(cfg.get("vocab_size_per_layer_input") or cfg["vocab_size"]),
    }
    return out | _moe_fields(cfg) | ({} if cfg.get("rope_parameters") else _ROPE_DEFAULT)


def _per_layer(value: Any, types: list[str]) -> tuple[int, int]:
    """(sliding layers', full layers') value of a GGUF key that is one number, or one per layer."""
    if not isinstance(value, list):
        return int(value), int(value)
    return int(value[types.index("sliding_attention")]), int(value[types.index("full_attention")])


def gguf_fields(h: GGUFHeader) -> dict[str, Any]:
    """llama.cpp's gemma4 keys: per-layer sliding flags, KV heads and ffn sizes, the full layers' head size in
    key_length (the sliding ones' in key_length_swa), the proportional RoPE as rope_freqs factors (1 where a
    frequency turns, 1e30 where it does not); a full layer without attn_v has keys equal to values."""
    types = ["sliding_attention" if s else "full_attention" for s in h.get("attention.sliding_window_pattern")]
    kv_swa, kv_full = _per_layer(h.get("attention.head_count_kv"), types)
    ff = h.get("feed_forward_length")
    head_full, head_swa = int(h.get("attention.key_length")), int(h.get("attention.key_length_swa"))
    factors = h.read("rope_freqs.weight") if "rope_freqs.weight" in h.tensors else [1.0] * (head_full // 2)
    per_layer = h.tensors.get("per_layer_token_embd.weight")
    first_full = types.index("full_attention")
    return {
        "norm_offset": 0.0,
        "embedding_multiplier": int(h.get("embedding_length")) ** 0.5,
        "post_norms": True,
        "qk_norm": "head",
        "v_norm": True,
        "layer_scalar": True,
        "hidden_act": "gelu_pytorch_tanh",
        "attn_scale": 1.0,
        "final_logit_softcapping": h.get("final_logit_softcapping"),
        "layer_types": types,
        "head_dim": head_swa,
        "num_kv_heads": kv_swa,
        "global_head_dim": head_full,
        "num_global_kv_heads": kv_full,
        "partial_rotary_factor": 1.0,
        "rope_local_theta": float(h.get("rope.freq_base_swa", 10_000.0)),
        "rope_scaling": {"rope_type": "proportional", "partial_rotary_factor": 2 * factors.count(1.0) / head_full},
        "attention_k_eq_v": f"blk.{first_full}.attn_v.weight" not in h.tensors,
        "num_kv_shared_layers": int(h.get("attention.shared_kv_layers") or 0),
        "intermediate_size": int(ff[0]) if isinstance(ff, list) else int(ff),
        "double_wide_shared_mlp": isinstance(ff, list) and int(ff[-1]) == 2 * int(ff[0]),
        "hidden_size_per_layer_input": int(h.get("embedding_length_per_layer_input") or 0),
        "vocab_size_per_layer_input": int(per_layer[0]) if per_layer else 0,
    } | _gguf_moe_fields(h)


def _gguf_moe_fields(h: GGUFHeader) -> dict[str, Any]:
    """The sparse block as llama.cpp stores it: every expert's gate and up in one `ffn_gate_up_exps`, the router's
    scale as `ffn_gate_inp.scale`, the per-expert scales as `ffn_down_exps.scale`."""
    if not h.get("expert_count"):
        return {}
    return {
        "num_experts": int(h.get("expert_count")),
        "num_experts_per_tok": int(h.get("expert_used_count")),
        "moe_intermediate_size": int(h.get("expert_feed_forward_length")),
        "norm_topk_prob": True,
        "moe_beside_mlp": True,
    }


GEMMA4 = Family(
    "gemma4",
    ("Gemma4ForCausalLM", "Gemma4ForConditionalGeneration"),
    ("gemma4_text", "gemma4"),
    ("gemma4",),
    hf_fields=hf_fields,
    gguf_fields=gguf_fields,
    layer_tensors=GEMMA4_LAYER,
    tie_default=True,
    unfuse=UNFUSE,
    multimodal_architectures=("Gemma4ForConditionalGeneration",),  # what Google ships: its text model runs
)
