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

The sparse block of the 26B-A4B (`enable_moe_block`) is refused by name: it runs beside the dense MLP with its own
norms and router, which the shared MoE block does not compute yet.
"""

from __future__ import annotations

from typing import Any

from pagedllm.errors import ModelLoadError
from pagedllm.model.families.base import Family, every_nth
from pagedllm.model.families.gemma2 import GEMMA_LAYER

GEMMA4_LAYER = GEMMA_LAYER | {
    "q": ("self_attn.q_proj",),  # a layer that reads another's KV projects only queries
    "qk": ("self_attn.q_proj", "self_attn.k_proj"),  # attention_k_eq_v: K is V
    "ple_gate": ("per_layer_input_gate",),
    "ple_proj": ("per_layer_projection",),
    "ple_norm": ("post_per_layer_input_norm",),
    "layer_scalar": ("layer_scalar",),
}
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


def hf_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    if cfg.get("enable_moe_block"):
        raise ModelLoadError("Gemma 4's MoE block (enable_moe_block, the 26B-A4B) is not supported yet")
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
    return out | ({} if cfg.get("rope_parameters") else _ROPE_DEFAULT)


GEMMA4 = Family(
    "gemma4",
    ("Gemma4ForCausalLM", "Gemma4ForConditionalGeneration"),
    ("gemma4_text", "gemma4"),
    (),
    hf_fields=hf_fields,
    layer_tensors=GEMMA4_LAYER,
    tie_default=True,
    multimodal_architectures=("Gemma4ForConditionalGeneration",),  # what Google ships: its text model runs
)
