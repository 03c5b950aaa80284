"""Granite-MoE (granite-3.x-*-a*): Granite's four multipliers (granite.py) with sparse blocks whose router takes
the top k logits, then a softmax over them (`topk_softmax`; llama.cpp's softmax, top k, renormalised is the same
function). The experts are stored 3-D as `input_linear` ([experts, 2 * ffn, hidden], gate rows first) and
`output_linear`; Granite-MoE-shared (granitemoeshared.py) adds a shared expert (`shared_mlp`, its gate and up
stacked in `input_linear` too). llama.cpp writes both as arch "granitemoe", Q/K permuted."""

from __future__ import annotations

from typing import Any

from pagedllm.model.families.base import LLAMA_LAYER, Family, GGUFHeader, Unfuse
from pagedllm.model.families.granite import gguf_fields as granite_gguf_fields
from pagedllm.model.families.granite import hf_fields as granite_hf_fields
from pagedllm.model.families.moe import fused_experts, gguf_moe_fields, hf_moe_fields, moe_tensors

_BLOCK = "block_sparse_moe"


def hf_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    return (
        granite_hf_fields(cfg)
        | hf_moe_fields(cfg, "intermediate_size")
        | {
            "moe_router": "topk_softmax",
            "shared_expert_intermediate_size": int(cfg.get("shared_intermediate_size") or 0),
        }
    )


def gguf_fields(h: GGUFHeader) -> dict[str, Any]:
    return granite_gguf_fields(h) | {"moe_router": "topk_softmax"} | gguf_moe_fields(h, norm_topk_prob=True)


LAYER = (
    LLAMA_LAYER
    | moe_tensors(_BLOCK, router="router.layer")
    | {"shared_gate_up": ("shared_mlp.gate_proj", "shared_mlp.up_proj"), "shared_down": ("shared_mlp.output_linear",)}
)
UNFUSE = (
    Unfuse(
        f"{_BLOCK}.input_linear.weight",
        (f"{_BLOCK}.experts.{{e}}.gate_proj.weight", f"{_BLOCK}.experts.{{e}}.up_proj.weight"),
    ),
    Unfuse(f"{_BLOCK}.output_linear.weight", (f"{_BLOCK}.experts.{{e}}.down_proj.weight",)),
    Unfuse(f"{_BLOCK}.router.weight", (f"{_BLOCK}.router.layer.weight",), experts=False),  # transformers 5's
    Unfuse(
        "shared_mlp.input_linear.weight", ("shared_mlp.gate_proj.weight", "shared_mlp.up_proj.weight"), experts=False
    ),
    *fused_experts(_BLOCK),
)
GRANITEMOE = Family(
    "granitemoe",
    ("GraniteMoeForCausalLM",),
    ("granitemoe",),
    ("granitemoe",),
    hf_fields=hf_fields,
    gguf_fields=gguf_fields,
    layer_tensors=LAYER,
    gguf_permute_qk=True,
    moe=True,
    unfuse=UNFUSE,
)
