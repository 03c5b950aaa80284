"""gpt-oss (gpt-oss-20b, gpt-oss-120b): a sparse block in every layer, attention with sinks and biases.

- Attention: q/k/v/o biases, one learned sink logit per head in each softmax (`self_attn.sinks`, AttentionSpec's
  sinks), a sliding window (128) on every other layer starting with the first (transformers' layer_types;
  llama.cpp's swa pattern 2), YaRN with `truncate: false` (the correction range not rounded to whole dims, as
  OpenAI's reference computes it; llama.cpp rounds it, which shifts a few frequencies).
- The sparse block: the router is a linear layer with a bias, its top k logits softmaxed (`topk_softmax`);
  each expert has biases and the clamped SwiGLU (`swigluoai`: alpha 1.702, limit 7.0).
- HF checkpoints (transformers 5 and the original layout alike): the experts are 3-D, `gate_up_proj`
  [experts, hidden, 2 * ffn] stored transposed with gate and up interleaved (gate the even columns),
  `down_proj` [experts, ffn, hidden] transposed, and their biases `*_proj_bias`.
- GGUF (llama.cpp's converter): `attn_sinks`, `ffn_gate_inp` with its bias, `ffn_{gate,up,down}_exps` split
  already, each with a `.bias`; no Q/K permutation (gpt-oss rotates NeoX-style, as transformers).
"""

from __future__ import annotations

from typing import Any

from pagedllm.model.families.base import LLAMA_LAYER, Family, GGUFHeader, Unfuse, every_nth
from pagedllm.model.families.moe import gguf_moe_fields, hf_moe_fields, moe_tensors

_EXPERT = "mlp.experts.{e}"
_FIXED = {"moe_router": "topk_softmax", "moe_activation": "swigluoai", "attention_sinks": True}


def _sliding_every_other(layers: int) -> list[str]:
    return every_nth(layers, 2, "full_attention", "sliding_attention")


def hf_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    if (cfg.get("quantization_config") or {}).get("quant_method") == "mxfp4":  # OpenAI's own upload
        raise ValueError(
            "gpt-oss experts in MXFP4 (mlp.experts.*_blocks / *_scales) are not read from an HF folder; save it "
            "dequantized (transformers' Mxfp4Config(dequantize=True)) or convert it to GGUF"
        )
    out: dict[str, Any] = hf_moe_fields(cfg, "intermediate_size") | _FIXED
    out |= {"router_bias": True, "expert_bias": True}
    out |= {"swiglu_alpha": float(cfg.get("swiglu_alpha", 1.702)), "swiglu_limit": float(cfg.get("swiglu_limit", 7.0))}
    if cfg.get("sliding_window") and not cfg.get("layer_types"):
        out["layer_types"] = _sliding_every_other(int(cfg["num_hidden_layers"]))
    if not cfg.get("rope_theta") and not (cfg.get("rope_parameters") or {}).get("rope_theta"):
        out["rope_theta"] = 150000.0  # GptOssConfig.default_theta
    return out


def gguf_fields(h: GGUFHeader) -> dict[str, Any]:
    out: dict[str, Any] = gguf_moe_fields(h, norm_topk_prob=False) | _FIXED
    out["router_bias"] = "blk.0.ffn_gate_inp.bias" in h.tensors
    out["expert_bias"] = "blk.0.ffn_gate_exps.bias" in h.tensors
    if h.get("attention.sliding_window"):
        out["layer_types"] = _sliding_every_other(int(h.get("block_count")))
    if h.get("rope.scaling.type") == "yarn":
        ctx = int(h.get("context_length", 2048))
        out["rope_scaling"] = {
            "rope_type": "yarn",
            "factor": float(h.get("rope.scaling.factor")),
            "original_max_position_embeddings": int(h.get("rope.scaling.original_context_length", ctx)),
            "beta_fast": float(h.get("rope.scaling.yarn_beta_fast", 32.0)),
            "beta_slow": float(h.get("rope.scaling.yarn_beta_slow", 1.0)),
            "truncate": False,
        }
    return out


def _experts(source: str, target: str, interleaved: bool, transposed: bool) -> Unfuse:
    """`mlp.experts.<source>` split per expert into `target`'s gate / up pieces (or its one piece)."""
    pieces = ("gate_proj", "up_proj") if interleaved else ("down_proj",)
    return Unfuse(
        f"mlp.experts.{source}", tuple(f"{_EXPERT}.{p}.{target}" for p in pieces), True, transposed, interleaved
    )


GPT_OSS = Family(
    "gpt_oss",
    ("GptOssForCausalLM",),
    ("gpt_oss",),
    ("gpt-oss",),
    hf_fields=hf_fields,
    gguf_fields=gguf_fields,
    layer_tensors=LLAMA_LAYER | moe_tensors("mlp", router="router") | {"sinks": ("self_attn.sinks",)},
    moe=True,
    unfuse=(
        _experts("gate_up_proj", "weight", interleaved=True, transposed=True),
        _experts("gate_up_proj_bias", "bias", interleaved=True, transposed=False),
        _experts("down_proj", "weight", interleaved=False, transposed=True),
        _experts("down_proj_bias", "bias", interleaved=False, transposed=False),
    ),
)
