"""Granite 4.0-H (`GraniteMoeHybridForCausalLM`): Mamba2 layers (layers/mamba2.py) and attention layers per
`layer_types` (or the older `layers_block_type`; "mamba" / "attention" are transformers' legacy names of
"linear_attention" / "full_attention"), Granite's four multipliers (granite.py), no RoPE unless
`position_embedding_type` is "rope". Every layer's MLP is the shared one (`shared_mlp`, gate and up stacked in
`input_linear`) plus, where `num_local_experts` > 0, Granite-MoE's sparse block (granitemoe.py) beside it, added
without a gate; with no experts the shared MLP is the layer's dense MLP."""

from __future__ import annotations

from typing import Any

from pagedllm.model.families.base import Family
from pagedllm.model.families.granite import hf_fields as granite_hf_fields
from pagedllm.model.families.granitemoe import LAYER, UNFUSE
from pagedllm.model.families.moe import hf_moe_fields

LEGACY_LAYER_TYPES = {"mamba": "linear_attention", "attention": "full_attention"}  # transformers' remap

MAMBA2_LAYER: dict[str, tuple[str, ...]] = {
    "ssm_in": ("mamba.in_proj",),
    "ssm_conv": ("mamba.conv1d",),
    "ssm_a_log": ("mamba.A_log",),
    "ssm_dt_bias": ("mamba.dt_bias",),
    "ssm_d": ("mamba.D",),
    "ssm_norm": ("mamba.norm",),
    "ssm_out": ("mamba.out_proj",),
}


def _number(v: Any) -> float:
    """A float from config.json, where transformers 5 writes infinity as {"__float__": "Infinity"}."""
    return float(v["__float__"] if isinstance(v, dict) else v)


def mamba2_fields(cfg: dict[str, Any], types: list[str]) -> dict[str, Any]:
    """The Mamba2 mixer's shape from transformers' mamba_* keys (shared with Nemotron-H's names where they agree)."""
    hidden = int(cfg["hidden_size"])
    heads = int(cfg.get("mamba_n_heads") or 128)
    head_dim = cfg.get("mamba_d_head", "auto")
    limit = cfg.get("time_step_limit") or (0.0, float("inf"))
    return {
        "layer_types": [LEGACY_LAYER_TYPES.get(str(t), str(t)) for t in types],
        "recurrent_mixer": "mamba2",
        "mamba_num_heads": heads,
        "mamba_head_dim": int(cfg.get("mamba_expand", 2)) * hidden // heads if head_dim == "auto" else int(head_dim),
        "mamba_state_size": int(cfg.get("mamba_d_state") or 256),
        "mamba_num_groups": int(cfg.get("mamba_n_groups") or 1),
        "mamba_dt_limit": (_number(limit[0]), _number(limit[1])),
        "linear_conv_kernel_dim": int(cfg.get("mamba_d_conv") or 4),
        "mixer_conv_bias": bool(cfg.get("mamba_conv_bias", True)),
        "mixer_proj_bias": bool(cfg.get("mamba_proj_bias", False)),
    }


def hf_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    n = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types") or cfg.get("layers_block_type") or ["mamba"] * n
    out = granite_hf_fields(cfg) | mamba2_fields(cfg, types)
    if cfg.get("position_embedding_type") != "rope":
        out["no_rope_layers"] = [0] * n
    shared = int(cfg.get("shared_intermediate_size") or 1024)
    if not cfg.get("num_local_experts"):
        return out | {"intermediate_size": shared}
    moe = hf_moe_fields(cfg, "intermediate_size")
    return out | moe | {"moe_router": "topk_softmax", "shared_expert_intermediate_size": shared}


GRANITEMOEHYBRID = Family(
    "granitemoehybrid",
    ("GraniteMoeHybridForCausalLM",),
    ("granitemoehybrid",),
    (),
    hf_fields=hf_fields,
    layer_tensors=LAYER
    | MAMBA2_LAYER
    | {"gate_up": ("shared_mlp.gate_proj", "shared_mlp.up_proj"), "down": ("shared_mlp.output_linear",)},
    moe=True,
    unfuse=UNFUSE,
)
