"""Nemotron-H (`NemotronHForCausalLM`): each layer is one block behind its own RMSNorm (`norm`) and a residual add,
the block (`mixer`) by `layers_block_type` (or the older `hybrid_override_pattern`, one character a layer): a Mamba2
mixer ("linear_attention" / "mamba" / M), attention without RoPE ("full_attention" / "attention" / *) or an MLP,
down(relu(up(x))^2) with no gate ("mlp" / -). The shared decoder runs it as single-block layers
(ModelConfig.single_block_layers, "mlp" layers without a mixer); the mixer's Mamba2 is Granite 4.0-H's
(layers/mamba2.py), its dt clamped below at `time_step_min` as transformers clamps it (the mixer's
time_step_limit is (time_step_min, inf) whatever the config's says).

Checkpoints name the model `backbone.` (transformers 5 saves it as `model.`), the embeddings `embeddings` and the
final norm `norm_f`; llama.cpp's converter (NemotronHModel, over GraniteHybridModel) writes arch nemotron_h: a
Mamba2 layer by a `head_count_kv` and `feed_forward_length` of 0, an MLP layer by its feed_forward_length, the
Mamba2 tensors as for granitehybrid (A as -exp(A_log), D [H, 1], the gated norm [groups, inner / groups]), Q/K
rows permuted (LlamaModel's, harmless without RoPE, undone here), the epsilon as `attention.layer_norm_epsilon`.
It keeps no time_step_min: a file's is transformers' default, 0.001.

The MoE blocks of the newer configs ("moe" / E: DeepSeek-V3's grouped sigmoid router over ungated relu2 experts, a
latent projection; llama.cpp's nemotron_h_moe) are not run: the sparse block (layers/moe.py) has gated experts
only, so such a config is a ModelLoadError naming it."""

from __future__ import annotations

from typing import Any

from pagedllm.model.families.base import Family, GGUFHeader
from pagedllm.model.families.granitemoehybrid import MAMBA2_LAYER, _number

PATTERN = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}  # hybrid_override_pattern
LEGACY = {"mamba": "linear_attention", "attention": "full_attention"}  # transformers' remap of the older names
DT_MIN = 0.001  # NemotronHConfig.time_step_min's default

LAYER: dict[str, tuple[str, ...]] = {
    "attn_norm": ("norm",),  # one norm a layer: before its mixer or before its MLP, whichever it has
    "mlp_norm": ("norm",),
    "qkv": ("mixer.q_proj", "mixer.k_proj", "mixer.v_proj"),
    "o": ("mixer.o_proj",),
    "gate_up": ("mixer.up_proj",),  # the ungated MLP's up rows alone
    "down": ("mixer.down_proj",),
} | {slot: tuple(n.replace("mamba.", "mixer.") for n in names) for slot, names in MAMBA2_LAYER.items()}


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


def _moe_refused(types: list[str]) -> None:
    if "moe" in types:
        raise ValueError(
            f"layer {types.index('moe')} is a MoE block (Nemotron-H's ungated experts and grouped router), "
            "which pagedllm does not run"
        )


def hf_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    types = layer_types(cfg)
    _moe_refused(types)
    if str(cfg.get("mamba_hidden_act", "silu")) != "silu":
        raise ValueError(f"mamba_hidden_act {cfg['mamba_hidden_act']!r} (the Mamba2 mixer's is SiLU)")

    def key(*names: str, default: Any = None) -> Any:  # the config's name, or the older mamba_* one
        return next((cfg[n] for n in names if cfg.get(n) is not None), default)

    heads = int(key("mamba_num_heads", default=128))
    hidden = int(cfg["hidden_size"])
    return {
        "num_layers": len(types),
        "layer_types": types,
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
        "mamba_dt_limit": (_number(key("time_step_min", "mamba_dt_min", default=DT_MIN)), float("inf")),
        "linear_conv_kernel_dim": int(key("conv_kernel", "mamba_d_conv", default=4)),
        "mixer_conv_bias": bool(key("use_conv_bias", "mamba_conv_bias", default=True)),
        "mixer_proj_bias": bool(cfg.get("use_bias", False)),
    }


def gguf_fields(h: GGUFHeader) -> dict[str, Any]:
    kv = [int(k) for k in h.require("attention.head_count_kv")]
    ff = [int(f) for f in h.require("feed_forward_length")]
    heads, tensors = int(h.require("ssm.time_step_rank")), h.tensors
    types = ["full_attention" if k else "mlp" if f else "linear_attention" for k, f in zip(kv, ff)]
    first = next((i for i, t in enumerate(types) if t == "linear_attention"), 0)
    return {
        "layer_types": types,
        "num_kv_heads": max(kv),
        "intermediate_size": max(ff),
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
        "mamba_dt_limit": (DT_MIN, float("inf")),
        "linear_conv_kernel_dim": int(h.require("ssm.conv_kernel")),
        "mixer_conv_bias": f"blk.{first}.ssm_conv1d.bias" in tensors,
        "mixer_proj_bias": f"blk.{first}.ssm_in.bias" in tensors,
    }


NEMOTRON_H = Family(
    "nemotron_h",
    ("NemotronHForCausalLM",),
    ("nemotron_h",),
    ("nemotron_h",),
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
    final_norm="norm_f",
    hf_config=hf_config,
)
