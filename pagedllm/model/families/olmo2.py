"""OLMo 2: norms after attention and after the MLP (none before), and q/k RMSNorms over the whole projection
(all heads at once, unlike Qwen3's per head)."""

from __future__ import annotations

from typing import Any

from pagedllm.model.families.base import LLAMA_LAYER, Family


def fields(_source: Any) -> dict[str, Any]:
    return {"qk_norm": "full", "pre_norms": False, "post_norms": True}


_LAYER = {k: v for k, v in LLAMA_LAYER.items() if k not in ("attn_norm", "mlp_norm")} | {
    "attn_out_norm": ("post_attention_layernorm",),
    "mlp_out_norm": ("post_feedforward_layernorm",),
}
OLMO2 = Family(
    "olmo2", ("Olmo2ForCausalLM",), ("olmo2",), ("olmo2",), hf_fields=fields, gguf_fields=fields, layer_tensors=_LAYER
)
