"""Granite 4.0-H (`GraniteMoeHybridForCausalLM`): Mamba2 layers (layers/mamba2.py) and attention layers per
`layer_types` (or the older `layers_block_type`; "mamba" / "attention" are transformers' legacy names of
"linear_attention" / "full_attention"), Granite's four multipliers (granite.py), no RoPE unless
`position_embedding_type` is "rope". Every layer's MLP is the shared one (`shared_mlp`, gate and up stacked in
`input_linear`) plus, where `num_local_experts` > 0, Granite-MoE's sparse block (granitemoe.py) beside it, added
without a gate; with no experts the shared MLP is the layer's dense MLP.

llama.cpp's granitehybrid files (its converter: Mamba2Model + GraniteMoeModel) say which layers are Mamba2 by a
`head_count_kv` of 0, keep the Mamba2 shape in ssm.* keys (time_step_rank: the heads), store A as -exp(A_log)
and D as [heads, 1], the gated norm as [groups, inner / groups], the shared MLP as ffn_*_shexp beside experts and
as the plain ffn_* without, Q/K permuted; RoPE only where `rope.scaling.finetuned` says so (Bamba)."""

from __future__ import annotations

from typing import Any

from pagedllm.model.families.base import Family, GGUFHeader
from pagedllm.model.families.granite import gguf_fields as granite_gguf_fields
from pagedllm.model.families.granite import hf_fields as granite_hf_fields
from pagedllm.model.families.granitemoe import LAYER, UNFUSE
from pagedllm.model.families.moe import gguf_moe_fields, hf_moe_fields

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


def gguf_fields(h: GGUFHeader) -> dict[str, Any]:
    kv = [int(k) for k in h.require("attention.head_count_kv")]
    heads, tensors = int(h.require("ssm.time_step_rank")), h.tensors
    first = next(i for i, k in enumerate(kv + [0]) if not k)  # a Mamba2 layer (or none)
    out = granite_gguf_fields(h) | {
        "layer_types": ["full_attention" if k else "linear_attention" for k in kv],
        "num_kv_heads": max(kv),
        "recurrent_mixer": "mamba2",
        "mamba_num_heads": heads,
        "mamba_head_dim": int(h.require("ssm.inner_size")) // heads,
        "mamba_state_size": int(h.require("ssm.state_size")),
        "mamba_num_groups": int(h.get("ssm.group_count") or 1),
        "linear_conv_kernel_dim": int(h.require("ssm.conv_kernel")),
        "mixer_conv_bias": f"blk.{first}.ssm_conv1d.bias" in tensors,
        "mixer_proj_bias": f"blk.{first}.ssm_in.bias" in tensors,
    }
    if not h.get("rope.scaling.finetuned"):
        out["no_rope_layers"] = [0] * len(kv)
    if not h.get("expert_count"):
        return out | {"intermediate_size": int(tensors[f"blk.{first % len(kv)}.ffn_up.weight"][0])}
    return out | gguf_moe_fields(h, norm_topk_prob=True) | {"moe_router": "topk_softmax"}


def gguf_layer_names(experts: bool) -> dict[str, str]:
    """The shared MLP: the converter's ffn_*_shexp beside experts, the plain ffn_* without."""
    kind = "_shexp" if experts else ""
    return {f"shared_mlp.{hf}": f"ffn_{g}{kind}" for hf, g in (("gate_proj", "gate"), ("up_proj", "up"))} | {
        "shared_mlp.output_linear": f"ffn_down{kind}"
    }


GRANITEMOEHYBRID = Family(
    "granitemoehybrid",
    ("GraniteMoeHybridForCausalLM",),
    ("granitemoehybrid",),
    ("granitehybrid",),
    hf_fields=hf_fields,
    gguf_fields=gguf_fields,
    layer_tensors=LAYER
    | MAMBA2_LAYER
    | {"gate_up": ("shared_mlp.gate_proj", "shared_mlp.up_proj"), "down": ("shared_mlp.output_linear",)},
    gguf_permute_qk=True,
    moe=True,
    unfuse=UNFUSE,
    gguf_layer_names=gguf_layer_names,
)
