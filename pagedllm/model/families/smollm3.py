"""SmolLM3: Llama with no RoPE at every 4th layer (`no_rope_layers[i]` 0 = NoPE), tied embeddings by default.
llama.cpp fixes the interval at 4 (no GGUF key carries it)."""

from __future__ import annotations

from typing import Any

from pagedllm.model.families.base import Family, GGUFHeader, every_nth


def hf_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    layers = int(cfg["num_hidden_layers"])
    flags = cfg.get("no_rope_layers")
    if flags is None:
        flags = [int(t == "rope") for t in every_nth(layers, int(cfg.get("no_rope_layer_interval", 4)), "nope", "rope")]
    return {"no_rope_layers": [int(f) for f in flags]}


def gguf_fields(h: GGUFHeader) -> dict[str, Any]:
    layers = int(h.get("block_count"))
    return {"no_rope_layers": [int(t == "rope") for t in every_nth(layers, 4, "nope", "rope")]}


SMOLLM3 = Family(
    "smollm3",
    ("SmolLM3ForCausalLM",),
    ("smollm3",),
    ("smollm3",),
    hf_fields=hf_fields,
    gguf_fields=gguf_fields,
    tie_default=True,
    gguf_permute_qk=True,
)
