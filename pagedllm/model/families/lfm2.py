"""LFM2 (`Lfm2ForCausalLM`, Liquid AI): short-conv layers (layers/shortconv.py; `layer_types` "conv", or every
layer not in `full_attn_idxs`) and attention layers with q/k norms per head, a SwiGLU MLP (`feed_forward.w1/w3/w2`)
whose size is adjusted as transformers does (`block_auto_adjust_ff_dim`: 2/3, the multiplier, rounded up to
`block_multiple_of`), tied embeddings, the final norm named `embedding_norm`."""

from __future__ import annotations

from typing import Any

from pagedllm.model.families.base import Family, GGUFHeader

LFM2_LAYER: dict[str, tuple[str, ...]] = {
    "qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o": ("self_attn.out_proj",),
    "q_norm": ("self_attn.q_layernorm",),
    "k_norm": ("self_attn.k_layernorm",),
    "attn_norm": ("operator_norm",),
    "mlp_norm": ("ffn_norm",),
    "conv_in": ("conv.in_proj",),
    "conv_conv": ("conv.conv",),
    "conv_out": ("conv.out_proj",),
}


def ffn_size(cfg: dict[str, Any]) -> int:
    """Lfm2MLP's size from intermediate_size (or the original's block_ff_dim)."""
    size = int(cfg.get("intermediate_size") or cfg["block_ff_dim"])
    if cfg.get("block_auto_adjust_ff_dim", True):
        size = int(2 * size / 3)
        mult, of = cfg.get("block_ffn_dim_multiplier", 1.0), int(cfg.get("block_multiple_of", 256))
        if mult is not None:
            size = of * ((int(mult * size) + of - 1) // of)
    return size


def layer_types(cfg: dict[str, Any]) -> list[str]:
    n = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types")
    if types is None:
        full = cfg.get("full_attn_idxs")
        types = ["full_attention" if full is None or i in full else "conv" for i in range(n)]
    return ["linear_attention" if t == "conv" else str(t) for t in types]


def hf_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    bias = bool(cfg.get("conv_bias", False))
    return {
        "layer_types": layer_types(cfg),
        "recurrent_mixer": "short_conv",
        "linear_conv_kernel_dim": int(cfg.get("conv_L_cache") or 3),
        "mixer_conv_bias": bias,
        "mixer_proj_bias": bias,
        "qk_norm": "head",
        "rms_norm_eps": float(cfg.get("norm_eps") or 1e-5),
        "intermediate_size": ffn_size(cfg),
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", cfg.get("tie_embedding", True))),
    }


def gguf_fields(h: GGUFHeader) -> dict[str, Any]:
    """llama.cpp's lfm2 keys: a conv layer is one whose `attention.head_count_kv` entry is 0; the conv width is
    `shortconv.l_cache`; feed_forward_length is already the adjusted size."""
    n = int(h.get("block_count"))
    kv = h.get("attention.head_count_kv")
    per = [int(k) for k in kv] if isinstance(kv, (list, tuple)) else [int(kv)] * n
    bias = "blk.0.shortconv.in_proj.bias" in h.tensors
    return {
        "layer_types": ["full_attention" if k else "linear_attention" for k in per],
        "num_kv_heads": max(per),
        "recurrent_mixer": "short_conv",
        "linear_conv_kernel_dim": int(h.get("shortconv.l_cache") or 3),
        "mixer_conv_bias": any(name.endswith("shortconv.conv.bias") for name in h.tensors),
        "mixer_proj_bias": bias,
        "qk_norm": "head",
    }


LFM2 = Family(
    "lfm2",
    ("Lfm2ForCausalLM",),
    ("lfm2",),
    ("lfm2",),
    hf_fields=hf_fields,
    gguf_fields=gguf_fields,
    layer_tensors=LFM2_LAYER | {"gate_up": ("feed_forward.w1", "feed_forward.w3"), "down": ("feed_forward.w2",)},
    tie_default=True,
    final_norm="embedding_norm",
)
