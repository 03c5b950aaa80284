"""Gemma 2: (1 + w) RMSNorms, a norm before and after both attention and MLP, GeGLU, embeddings scaled by
sqrt(hidden), tanh soft-capping of attention scores and of the logits, the softmax scale from
query_pre_attn_scalar, sliding-window layers alternating with global ones.

llama.cpp's converter stores every norm weight as 1 + w (so a GGUF's norms have no offset), and computes the
softmax scale from the head size except for the 27B shape (46 layers), where it is 1/sqrt(hidden / heads).
"""

from __future__ import annotations

from typing import Any

from pagedllm.model.families.base import LLAMA_LAYER, Family, GGUFHeader, every_nth

GEMMA_LAYER = LLAMA_LAYER | {
    "attn_out_norm": ("post_attention_layernorm",),
    "mlp_norm": ("pre_feedforward_layernorm",),
    "mlp_out_norm": ("post_feedforward_layernorm",),
}


def gemma_hf_fields(cfg: dict[str, Any], pattern: int) -> dict[str, Any]:
    """What Gemma 2 and 3 read alike from config.json; `pattern`: one global layer in this many."""
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    out: dict[str, Any] = {
        "norm_offset": 1.0,
        "embedding_multiplier": hidden**0.5,
        "post_norms": True,
        "hidden_act": cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh",
        "attn_scale": float(cfg.get("query_pre_attn_scalar") or head_dim) ** -0.5,
        "attn_logit_softcapping": cfg.get("attn_logit_softcapping"),
        "final_logit_softcapping": cfg.get("final_logit_softcapping"),
    }
    if not cfg.get("layer_types") and cfg.get("sliding_window"):
        layers = int(cfg["num_hidden_layers"])
        out["layer_types"] = every_nth(layers, pattern, "full_attention", "sliding_attention")
    return out


def gemma_gguf_fields(h: GGUFHeader, pattern: int, big_layers: int) -> dict[str, Any]:
    """What Gemma 2 and 3 read alike from GGUF metadata (llama.cpp's sliding pattern and softmax scale)."""
    layers, hidden, heads = (
        int(h.get("block_count")),
        int(h.get("embedding_length")),
        int(h.get("attention.head_count")),
    )
    stored = h.get("attention.sliding_window_pattern")
    if isinstance(stored, list):  # newer files: one flag per layer, True = sliding
        types = ["sliding_attention" if s else "full_attention" for s in stored]
    else:
        types = every_nth(layers, int(stored or pattern), "full_attention", "sliding_attention")
    softcap, final = h.get("attn_logit_softcapping"), h.get("final_logit_softcapping")
    return {
        "norm_offset": 0.0,
        "embedding_multiplier": hidden**0.5,
        "post_norms": True,
        "hidden_act": "gelu_pytorch_tanh",
        "attn_scale": (hidden / heads) ** -0.5 if layers == big_layers else None,
        "attn_logit_softcapping": None if softcap is None else float(softcap),
        "final_logit_softcapping": None if final is None else float(final),
        "layer_types": types if h.get("attention.sliding_window") else None,
    }


GEMMA2 = Family(
    "gemma2",
    ("Gemma2ForCausalLM",),
    ("gemma2",),
    ("gemma2",),
    hf_fields=lambda cfg: gemma_hf_fields(cfg, 2),
    gguf_fields=lambda h: gemma_gguf_fields(h, 2, 46),
    layer_tensors=GEMMA_LAYER,
    tie_default=True,
)
