"""Gemma 3 (text): Gemma 2's layer (see gemma2.py) with q/k (1 + w) RMSNorms per head instead of soft-capping,
five sliding-window layers per global one, and two RoPE bases: the global layers' (rope_theta, with any
scaling) and the sliding layers' (rope_local_base_freq, 10,000, unscaled; llama.cpp fixes it there too).
"""

from __future__ import annotations

from typing import Any

from pagedllm.model.families.base import Family, GGUFHeader
from pagedllm.model.families.gemma2 import GEMMA_LAYER, gemma_gguf_fields, gemma_hf_fields


def hf_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    out = gemma_hf_fields(cfg, int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6))
    out["qk_norm"] = "head"
    if "rope_local_base_freq" in cfg:  # transformers 4's key; 5 nests it in rope_parameters (config.py)
        out["rope_local_theta"] = float(cfg["rope_local_base_freq"])
    return out


def gguf_fields(h: GGUFHeader) -> dict[str, Any]:
    out = gemma_gguf_fields(h, 6, 62)
    out["qk_norm"] = "head"
    out["rope_local_theta"] = float(h.get("rope.freq_base_swa", 10000.0))
    return out


GEMMA3 = Family(
    "gemma3",
    ("Gemma3ForCausalLM",),
    ("gemma3_text",),
    ("gemma3",),
    hf_fields=hf_fields,
    gguf_fields=gguf_fields,
    layer_tensors=GEMMA_LAYER,
    tie_default=True,
)
