"""Nemotron-H (`NemotronHForCausalLM`): each layer is one block behind its own RMSNorm (`norm`) and a residual add,
the block (`mixer`) by `layers_block_type` (or the older `hybrid_override_pattern`, one character a layer): a Mamba2
mixer ("linear_attention" / "mamba" / M), attention without RoPE ("full_attention" / "attention" / *) or an MLP,
down(relu(up(x))^2) with no gate ("mlp" / -). The shared decoder runs it as single-block layers
(ModelConfig.single_block_layers, "mlp" layers without a mixer); the mixer's Mamba2 is Granite 4.0-H's
(layers/mamba2.py), its dt clamped to the config's `time_step_limit` (mamba_dt_limit; (0, inf) by default), as
mamba_ssm, vLLM, llama.cpp and transformers since 5.25 clamp it (transformers 5.24 clamped at time_step_min).

Checkpoints name the model `backbone.` (transformers 5 saves it as `model.`), the embeddings `embeddings` and the
final norm `norm_f`; llama.cpp's converter (NemotronHModel, over GraniteHybridModel) writes arch nemotron_h: a
Mamba2 layer by a `head_count_kv` and `feed_forward_length` of 0, an MLP layer by its feed_forward_length, the
Mamba2 tensors as for granitehybrid (A as -exp(A_log), D [H, 1], the gated norm [groups, inner / groups]), Q/K
rows permuted (LlamaModel's, harmless without RoPE, undone here), the epsilon as `attention.layer_norm_epsilon`.
It keeps no time_step_limit: a file's dt is unclamped, as llama.cpp's ssm_scan runs it.

The MoE blocks of the newer configs ("moe" / E: NVIDIA-Nemotron-3-Nano-30B-A3B's) are single-block layers whose block is
the sparse one (layers/moe.py; "mlp" layers here, the dense ones listed in mlp_only_layers): DeepSeek-V3's router
(sigmoid scores; the top k chosen by score + `e_score_correction_bias` within the `topk_group` best of `n_group` groups,
weighed by the scores, renormalised with norm_topk_prob, times routed_scaling_factor), experts like the MLP
(down(relu(up(x))^2), no gate) at moe_intermediate_size, one shared expert of the same form at
moe_shared_expert_intermediate_size added ungated, and, where `moe_latent_size` is set (Nemotron-3-Super), the routed
experts at that width: their input `fc1_latent_proj(x)`, their weighted sum through `fc2_latent_proj` (the router and
the shared expert read x itself; the fused C step runs the two projections as matmuls of its own). transformers saves
the experts one module per expert (`mixer.experts.N.up_proj`), its state dict as 3-D `mixer.experts.up_proj` /
`down_proj`. llama.cpp's converter writes arch nemotron_h_moe: a MoE layer by its `feed_forward_length`
(moe_intermediate_size) and its router `ffn_gate_inp` (a dense MLP layer, which that converter does not write, by
feed_forward_length alone), the experts stacked as ffn_up_exps / ffn_down_exps, the bias as exp_probs_b.bias, the shared
expert as ffn_up_shexp / ffn_down_shexp, the latent projections as ffn_latent_down / ffn_latent_up, expert_weights_norm
/ _scale and expert_group_count (and expert_group_used_count, which a file of more than one group must have); its gating
is sigmoid whatever expert_gating_func says (llama.cpp's graph fixes it)."""

from __future__ import annotations

from typing import Any

from pagedllm.model.families.base import Family, GGUFHeader, Unfuse
from pagedllm.model.families.granitemoehybrid import MAMBA2_LAYER, _number

PATTERN = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}  # hybrid_override_pattern
LEGACY = {"mamba": "linear_attention", "attention": "full_attention"}  # transformers' remap of the older names
NO_DT_LIMIT = (0.0, float("inf"))  # NemotronHConfig.time_step_limit's default

LAYER: dict[str, tuple[str, ...]] = {
    "attn_norm": ("norm",),  # one norm a layer: before its mixer or before its MLP, whichever it has
    "mlp_norm": ("norm",),
    "qkv": ("mixer.q_proj", "mixer.k_proj", "mixer.v_proj"),
    "o": ("mixer.o_proj",),
    "gate_up": ("mixer.up_proj",),  # the ungated MLP's up rows alone
    "down": ("mixer.down_proj",),
    "router": ("mixer.gate",),
    "score_bias": ("mixer.gate.e_score_correction_bias",),
    "experts_gate_up": ("mixer.experts.{e}.up_proj",),  # ungated: the up rows alone, as the MLP's
    "experts_down": ("mixer.experts.{e}.down_proj",),
    "shared_gate_up": ("mixer.shared_experts.up_proj",),
    "shared_down": ("mixer.shared_experts.down_proj",),
    "latent_in": ("mixer.fc1_latent_proj",),
    "latent_out": ("mixer.fc2_latent_proj",),
} | {slot: tuple(n.replace("mamba.", "mixer.") for n in names) for slot, names in MAMBA2_LAYER.items()}
# transformers 5's state dict: every expert's up / down in one 3-D tensor
UNFUSE = tuple(Unfuse(f"mixer.experts.{m}", (f"mixer.experts.{{e}}.{m}.weight",)) for m in ("up_proj", "down_proj"))


def layer_types(cfg: dict[str, Any]) -> list[str]:
    """Each layer's kind in transformers 5's names, from layers_block_type or the pattern string."""
    listed = cfg.get("layers_block_type")
    types = [LEGACY.get(str(t), str(t)) for t in listed] if listed else None
    if types is None:
        pattern = str(cfg["hybrid_override_pattern"])
        unknown = sorted(set(pattern) - set(PATTERN))
        if unknown:
            raise ValueError(f"hybrid_override_pattern has {unknown[0]!r}, not one of {''.join(PATTERN)}")
        types = [PATTERN[c] for c in pattern]
    return types


def hf_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """config.json with its layer count, which transformers 5 derives from the layer kinds and does not save."""
    return cfg if "num_hidden_layers" in cfg else cfg | {"num_hidden_layers": len(layer_types(cfg))}


def hf_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    types = layer_types(cfg)
    if str(cfg.get("mamba_hidden_act", "silu")) != "silu":
        raise ValueError(f"mamba_hidden_act {cfg['mamba_hidden_act']!r} (the Mamba2 mixer's is SiLU)")

    def key(*names: str, default: Any = None) -> Any:  # the config's name, or the older mamba_* one
        return next((cfg[n] for n in names if cfg.get(n) is not None), default)

    heads = int(key("mamba_num_heads", default=128))
    hidden = int(cfg["hidden_size"])
    return _moe_fields(cfg, types) | {
        "num_layers": len(types),
        "layer_types": ["mlp" if t == "moe" else t for t in types],
        "single_block_layers": True,
        "mlp_gated": False,
        "hidden_act": str(cfg.get("mlp_hidden_act") or "relu2"),
        "rms_norm_eps": float(cfg.get("layer_norm_epsilon", 1e-5)),
        "attention_bias": False,  # NemotronHAttention's projections have none, whatever attention_bias says
        "o_proj_bias": False,
        "no_rope_layers": [0] * len(types),
        "recurrent_mixer": "mamba2",
        "mamba_num_heads": heads,
        "mamba_head_dim": int(
            key("mamba_head_dim", default=int(key("expand", "mamba_expand", default=2)) * hidden // heads)
        ),
        "mamba_state_size": int(key("ssm_state_size", default=128)),
        "mamba_num_groups": int(key("n_groups", "mamba_n_groups", default=8)),
        "mamba_dt_limit": tuple(_number(v) for v in key("time_step_limit", "mamba_dt_limit", default=NO_DT_LIMIT)),
        "linear_conv_kernel_dim": int(key("conv_kernel", "mamba_d_conv", default=4)),
        "mixer_conv_bias": bool(key("use_conv_bias", "mamba_conv_bias", default=True)),
        "mixer_proj_bias": bool(cfg.get("use_bias", False)),
    }


def _moe_fields(cfg: dict[str, Any], types: list[str]) -> dict[str, Any]:
    """The sparse block's fields where some layer is "moe" (the "mlp" ones stay dense)."""
    if "moe" not in types:
        return {}
    return {
        "num_experts": int(cfg["n_routed_experts"]),
        "num_experts_per_tok": int(cfg["num_experts_per_tok"]),
        "moe_intermediate_size": int(cfg["moe_intermediate_size"]),
        "shared_expert_intermediate_size": int(cfg.get("moe_shared_expert_intermediate_size") or 0),
        "moe_latent_size": int(cfg.get("moe_latent_size") or 0),
        "moe_router": "sigmoid",
        "e_score_correction_bias": True,  # NemotronHTopkRouter's buffer, always there
        "norm_topk_prob": bool(cfg.get("norm_topk_prob", True)),
        "routed_scaling_factor": float(cfg.get("routed_scaling_factor") or 1.0),
        "num_expert_group": int(cfg.get("n_group") or 1),
        "topk_group": int(cfg.get("topk_group") or 1),
        "mlp_only_layers": [i for i, t in enumerate(types) if t == "mlp"],
    }


def _gguf_moe_fields(h: GGUFHeader, types: list[str]) -> dict[str, Any]:
    """nemotron_h_moe's keys (see the module's docstring); {} for a file without experts."""
    if not h.get("expert_count"):
        return {}
    groups = int(h.get("expert_group_count") or 1)
    first = types.index("moe") if "moe" in types else 0
    shared = h.tensors.get(f"blk.{first}.ffn_up_shexp.weight", (0,))[0]
    latent = h.get("moe_latent_size")
    return {
        "num_experts": int(h.require("expert_count")),
        "num_experts_per_tok": int(h.require("expert_used_count")),
        "moe_intermediate_size": int(h.require("expert_feed_forward_length")),
        "shared_expert_intermediate_size": int(h.get("expert_shared_feed_forward_length") or shared),
        "moe_latent_size": int(latent or 0),
        "moe_router": "sigmoid",
        "e_score_correction_bias": f"blk.{first}.exp_probs_b.bias" in h.tensors,
        "norm_topk_prob": bool(h.get("expert_weights_norm") or False),
        "routed_scaling_factor": float(h.get("expert_weights_scale") or 1.0),
        "num_expert_group": groups,
        "topk_group": int(h.require("expert_group_used_count")) if groups > 1 else 1,
        "mlp_only_layers": [i for i, t in enumerate(types) if t == "mlp"],
    }


def gguf_fields(h: GGUFHeader) -> dict[str, Any]:
    kv = [int(k) for k in h.require("attention.head_count_kv")]
    ff = [int(f) for f in h.require("feed_forward_length")]
    heads, tensors = int(h.require("ssm.time_step_rank")), h.tensors
    types = ["full_attention" if k else "mlp" if f else "linear_attention" for k, f in zip(kv, ff)]
    types = ["moe" if f"blk.{i}.ffn_gate_inp.weight" in tensors else t for i, t in enumerate(types)]
    first = next((i for i, t in enumerate(types) if t == "linear_attention"), 0)
    return _gguf_moe_fields(h, types) | {
        "layer_types": ["mlp" if t == "moe" else t for t in types],
        "num_kv_heads": max(kv),
        "intermediate_size": max((f for f, t in zip(ff, types) if t == "mlp"), default=0),
        "single_block_layers": True,
        "mlp_gated": False,
        "hidden_act": "relu2",
        "rms_norm_eps": float(h.get("attention.layer_norm_rms_epsilon") or h.require("attention.layer_norm_epsilon")),
        "no_rope_layers": [0] * len(kv),
        "recurrent_mixer": "mamba2",
        "mamba_num_heads": heads,
        "mamba_head_dim": int(h.require("ssm.inner_size")) // heads,
        "mamba_state_size": int(h.require("ssm.state_size")),
        "mamba_num_groups": int(h.get("ssm.group_count") or 1),
        "mamba_dt_limit": NO_DT_LIMIT,
        "linear_conv_kernel_dim": int(h.require("ssm.conv_kernel")),
        "mixer_conv_bias": f"blk.{first}.ssm_conv1d.bias" in tensors,
        "mixer_proj_bias": f"blk.{first}.ssm_in.bias" in tensors,
    }


NEMOTRON_H = Family(
    "nemotron_h",
    ("NemotronHForCausalLM",),
    ("nemotron_h",),
    ("nemotron_h", "nemotron_h_moe"),
    hf_fields=hf_fields,
    gguf_fields=gguf_fields,
    layer_tensors=LAYER,
    gguf_permute_qk=True,
    renamed=(
        ("backbone.embeddings.", "model.embed_tokens."),
        ("model.embeddings.", "model.embed_tokens."),
        ("backbone.", "model."),
    ),
    skipped=("mtp.",),
    moe=True,
    unfuse=UNFUSE,
    final_norm="norm_f",
    hf_config=hf_config,
)
