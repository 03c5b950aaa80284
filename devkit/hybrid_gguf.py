"""GGUF files of the hybrid families, written from an HF folder the way llama.cpp's converter writes them
(convert_hf_to_gguf.py with conversion/qwen.py, granite.py, mamba.py, lfm2.py), so that the loader's reading of each
change is tested against the change itself:

- qwen35 / qwen35moe / qwen3next (Qwen3NextModel): every `*norm.weight` but the DeltaNet's gated
  `linear_attn.norm` stored as 1 + w; `A_log` as A = -exp(A_log) (`ssm_a`, no `.weight`); `dt_bias` as
  `ssm_dt.bias`; the conv squeezed to [C, K]; qwen35 / qwen35moe (_LinearAttentionVReorderBase) reorder every
  value-head-indexed row (the V part of in_proj_qkv and of the conv, in_proj_z, in_proj_a / b, A_log, dt_bias)
  and out_proj's columns from grouped-by-key-head to tiled order when there are more value heads than key heads;
  qwen3next splits `in_proj_qkvz` (per key head [q, k, v, z]) into attn_qkv ([all q, all k, all v]) and
  attn_gate (z), and keeps `in_proj_ba` as ssm_ba; the recurrent layers as `attention.recurrent_layers`, the
  DeltaNet's shape as ssm.* keys; experts stacked into ffn_{gate,up,down}_exps.
- lfm2moe (LFM2MoeModel): the short conv squeezed to [C, K], experts stacked, `expert_bias` as exp_probs_b.bias,
  KV heads 0 for a conv layer, the dense lead and sigmoid gating as keys.
- granitehybrid (GraniteHybridModel = Mamba2Model + GraniteMoeModel): Q/K rows permuted (LlamaModel), the Mamba2
  layers' conv squeezed, A as -exp(A_log) and D both [H, 1], the gated norm [groups, inner / groups],
  `dt_bias` as ssm_dt.bias; the shared MLP's stacked `input_linear` split into gate and up (ffn_*_shexp beside
  experts, the plain ffn_* without), `head_count_kv` 0 for a Mamba2 layer, no RoPE (`rope.scaling.finetuned`
  false) unless the model is Bamba.
- nemotron_h (NemotronHModel over GraniteHybridModel): the Mamba2 layers as granitehybrid's, Q/K permuted in the
  attention layers, the MLP layers' up / down as ffn_up / ffn_down; per layer `head_count_kv` (0 but in attention
  layers) and `feed_forward_length` (0 but in MLP layers), the epsilon as attention.layer_norm_epsilon, head size as
  key / value length.
- nemotron_h_moe (NemotronHModel of a config with experts): as nemotron_h, and per MoE layer the experts stacked into
  ffn_up_exps / ffn_down_exps, the router as ffn_gate_inp, `e_score_correction_bias` as exp_probs_b.bias, the
  shared expert as ffn_up_shexp / ffn_down_shexp, `feed_forward_length` moe_intermediate_size; the expert_* keys
  (count, used count, feed-forward and shared lengths, weights norm and scale, group count). Beyond the converter,
  which writes neither: a dense MLP layer's feed_forward_length (its converter gives the "-" layers of a MoE
  config 0, as if they were Mamba2 layers) and expert_group_used_count (topk_group, which a file of more than one
  group needs). The latent projections (moe_latent_size) as ffn_latent_down / ffn_latent_up, the size as
  moe_latent_size.

Matrices go in `fmt` (f32, f16, q8_0, q4_0: gguf.quants), kept in F32 where the converter keeps them: 1-D
tensors, norms, routers, the conv, any tensor not named `.weight` (ssm_a, ssm_d, biases); a row that is no whole
number of blocks stays F32.

`make_hybrid` writes the tiny random checkpoints these files come from (tests/test_model_hybrid_gguf.py and
benchmarks/serving/family_parity_llamacpp.py), in shapes llama.cpp loads: key and value heads of one width (it
reads both from ssm.state_size), Qwen3.5's RoPE sections within its turning dims, Granite 4.0-H without RoPE.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import numpy as np

from devkit.family_helpers import _decode, _encode, _permute, _tokenizer_metadata
from devkit.tiny_tokenizer import save_tiny_tokenizer

_COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
# three Gated DeltaNet layers, then a full-attention one; heads of one quantization block, so that Qwen3.5's
# tiled out_proj columns move whole blocks (the quantized files' reference stays exact)
_QWEN = dict(
    intermediate_size=96,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=32,
    linear_value_head_dim=32,
    rms_norm_eps=1e-5,
    # the multimodal sections within the 4 turning dims of a head (text positions are alike: only llama.cpp's
    # check that they fit cares)
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 1e4,
        "partial_rotary_factor": 0.25,
        "mrope_section": [1, 1, 0],
    },
)
_QWEN_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64)
# Mamba2 and attention layers in the released checkpoints' legacy names; the dense one's intermediate_size that of
# its shared MLP, as in the released configs (llama.cpp sizes the MLP by it)
_GRANITE = dict(
    intermediate_size=32,
    shared_intermediate_size=64,
    layer_types=["mamba", "attention", "mamba", "attention"],
    mamba_n_heads=8,
    mamba_d_head=16,
    mamba_d_state=16,
    mamba_n_groups=2,
    mamba_d_conv=4,
    mamba_expand=2,
    rms_norm_eps=1e-5,
    embedding_multiplier=2.0,
    residual_multiplier=0.5,
    attention_multiplier=0.2,
    logits_scaling=3.0,
    position_embedding_type=None,
)
# short-conv and attention layers, a dense first layer, then sparse blocks (routed_scaling_factor 1: the converter
# writes no scale, llama.cpp's lfm2moe uses none)
_LFM2_MOE = dict(
    intermediate_size=96,
    moe_intermediate_size=32,
    layer_types=["conv", "full_attention", "conv", "conv"],
    num_dense_layers=1,
    num_experts=4,
    num_experts_per_tok=2,
    conv_L_cache=3,
    norm_eps=1e-5,
)
# each layer one block: Mamba2, MLP, attention (no RoPE), MLP, Mamba2, attention; two attention layers, so that
# KV blocks, not state slots, run out first in a preemption test
_NEMOTRON_H = dict(
    num_hidden_layers=6,
    layers_block_type=["linear_attention", "mlp", "full_attention", "mlp", "linear_attention", "full_attention"],
    head_dim=16,
    intermediate_size=96,
    mamba_num_heads=8,
    mamba_head_dim=16,
    ssm_state_size=16,
    n_groups=2,
    conv_kernel=4,
    layer_norm_epsilon=1e-5,
)
# Nemotron-H's MoE variant: Mamba2, MoE, attention, MLP, MoE, attention; 8 experts in 4 groups, the top 2 within
# the best 2 groups (DeepSeek-V3's router), a shared expert, the correction bias drawn so that it changes choices
_NEMOTRON_H_MOE = _NEMOTRON_H | dict(
    layers_block_type=["linear_attention", "moe", "full_attention", "mlp", "moe", "full_attention"],
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    moe_shared_expert_intermediate_size=64,
    n_group=4,
    topk_group=2,
    norm_topk_prob=True,
    routed_scaling_factor=1.5,
)
CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3_5": ("Qwen3_5TextConfig", _QWEN),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", {k: v for k, v in _QWEN.items() if k != "intermediate_size"} | _QWEN_MOE),
    "qwen3_next": ("Qwen3NextConfig", {k: v for k, v in _QWEN.items() if k != "rope_parameters"} | _QWEN_MOE),
    "granitemoehybrid": ("GraniteMoeHybridConfig", _GRANITE | {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "granitemoehybrid_dense": ("GraniteMoeHybridConfig", _GRANITE | {"intermediate_size": 64, "num_local_experts": 0}),
    "lfm2_moe": ("Lfm2MoeConfig", _LFM2_MOE),
    "nemotron_h": ("NemotronHConfig", _NEMOTRON_H),
    "nemotron_h_moe": ("NemotronHConfig", _NEMOTRON_H_MOE),
    # Nemotron-3-Super's latent experts: routed at 32 wide between fc1_latent_proj and fc2_latent_proj
    "nemotron_h_moe_latent": ("NemotronHConfig", _NEMOTRON_H_MOE | {"moe_latent_size": 32}),
}
# Nemotron-H's MoE variants in the released checkpoints' pattern, every MLP block sparse (Mamba2, MoE, attention,
# MoE, Mamba2, attention): llama.cpp's nemotron_h_moe takes every feed-forward layer for a sparse one and refuses
# the mixed shape above (no ffn_gate_inp in its dense MLP layer), so that benchmarks/serving/family_parity_llamacpp.py
# checks the MoE layout against llama.cpp on these; not in CONFIGS (the tests' families), which pagedllm runs
_SPARSE = ["linear_attention", "moe", "full_attention", "moe", "linear_attention", "full_attention"]
SPARSE_TWINS: dict[str, tuple[str, dict[str, Any]]] = {
    f"{family}_sparse": (CONFIGS[family][0], CONFIGS[family][1] | {"layers_block_type": _SPARSE})
    for family in ("nemotron_h_moe", "nemotron_h_moe_latent")
}


def make_hybrid(family: str, folder: str) -> Any:
    """A tiny random `family` checkpoint saved in `folder` (float32, a word-level tokenizer); its transformers
    model. Weights drawn wide enough that a wrong state, gate, decay or rotation moves the logits far past the
    tests' tolerance: matrices N(0, 0.3^2), decays spread by A_log, norms, dt biases, skips and conv biases off
    their neutral init."""
    import torch
    import transformers

    cls, extra = (CONFIGS | SPARSE_TWINS)[family]
    cfg = getattr(transformers, cls)(**(_COMMON | extra))
    cfg.architectures = [cls.replace("TextConfig", "ForCausalLM").replace("Config", "ForCausalLM")]
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("A_log"):
                p.uniform_(-2, 1)
            elif name.endswith(("norm.weight", "layernorm.weight")):  # Qwen's (1 + w) around 1 too
                p.uniform_(0.7, 1.3) if "linear_attn" in name or not family.startswith("qwen") else p.uniform_(
                    -0.3, 0.3
                )
            elif name.endswith(("dt_bias", ".D", "conv1d.bias")):
                p.uniform_(-1, 1)
            else:
                p.normal_(0, 0.3)
        for name, b in hf.named_buffers():
            if name.endswith(("expert_bias", "e_score_correction_bias")):  # drawn so that it changes the choice
                b.uniform_(-0.3, 0.3)
    hf.save_pretrained(folder, safe_serialization=True)
    save_tiny_tokenizer(folder, _COMMON["vocab_size"])
    return hf


ARCHS = {
    "qwen3_5": "qwen35",
    "qwen3_5_moe": "qwen35moe",
    "qwen3_next": "qwen3next",
    "granitemoehybrid": "granitehybrid",
    "granitemoehybrid_dense": "granitehybrid",
    "lfm2_moe": "lfm2moe",
    "nemotron_h": "nemotron_h",
    "nemotron_h_moe": "nemotron_h_moe",
    "nemotron_h_moe_latent": "nemotron_h_moe",
    "nemotron_h_moe_sparse": "nemotron_h_moe",
    "nemotron_h_moe_latent_sparse": "nemotron_h_moe",
}
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_F32 = ("ffn_gate_inp", "ffn_gate_inp_shexp", "ssm_conv1d")  # besides 1-D tensors and norms


def _tiled(t: np.ndarray, dim: int, key_heads: int, per_key: int, size: int) -> np.ndarray:
    """Value heads along `dim` from grouped-by-key-head order to tiled (the converter's _reorder_v_heads)."""
    shape = list(t.shape)
    t = t.reshape(shape[:dim] + [key_heads, per_key, size] + shape[dim + 1 :])
    return np.ascontiguousarray(np.swapaxes(t, dim, dim + 1)).reshape(shape)


def _qwen_v_order(name: str, t: np.ndarray, cfg: dict[str, Any]) -> np.ndarray:
    """qwen35 / qwen35moe: the value-head-indexed rows (and out_proj's columns) in tiled order."""
    hk, hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    if hk == hv or "linear_attn." not in name:
        return t
    r, qk = hv // hk, 2 * hk * dk
    if ".in_proj_qkv." in name or ".conv1d." in name:
        return np.concatenate([t[:qk], _tiled(t[qk:], 0, hk, r, dv)])
    if ".in_proj_z." in name:
        return _tiled(t, 0, hk, r, dv)
    if ".in_proj_a." in name or ".in_proj_b." in name or name.endswith((".A_log", ".dt_bias")):
        return _tiled(t, 0, hk, r, 1)
    if ".out_proj." in name:
        return _tiled(t, 1, hk, r, dv)
    return t


def _qwen(name: str, t: np.ndarray, cfg: dict[str, Any], arch: str) -> list[tuple[str, np.ndarray]]:
    """Qwen3NextModel.modify_tensors: (HF-style name for the name map, or a GGUF name, array) pieces."""
    if arch != "qwen3next":
        t = _qwen_v_order(name, t, cfg)
    if name.endswith(".A_log"):
        t = -np.exp(t)
    elif name.endswith(".dt_bias"):
        name = name.removesuffix(".dt_bias") + ".dt_proj.bias"
    elif "conv1d" in name:
        t = t.squeeze()
    elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        t = t + 1
    if "in_proj_qkvz" not in name:
        return [(name, t)]
    hk, hv, dk, dv = (
        cfg[f"linear_{k}"] for k in ("num_key_heads", "num_value_heads", "key_head_dim", "value_head_dim")
    )
    sizes = np.cumsum([dk, dk, hv // hk * dv])
    per_head = t.T.reshape(cfg["hidden_size"], hk, -1)  # [hidden, key heads, q + k + v + z]
    q, k, v, z = (p.reshape(cfg["hidden_size"], -1) for p in np.split(per_head, sizes, axis=-1))
    bid = _LAYER.fullmatch(name).group(1)  # type: ignore[union-attr]
    return [(f"blk.{bid}.attn_qkv.weight", np.concatenate([q, k, v], 1).T), (f"blk.{bid}.attn_gate.weight", z.T)]


def _granite(name: str, t: np.ndarray, cfg: dict[str, Any], types: list[str]) -> list[tuple[str, np.ndarray]]:
    """GraniteHybridModel.modify_tensors: Mamba2Model's changes in its Mamba2 layers, Llama's Q/K permutation in
    the attention layers, GraniteMoeModel's split of the stacked gate / up."""
    m = _LAYER.fullmatch(name)
    bid, rest = (int(m.group(1)), m.group(2)) if m else (-1, "")
    experts = bool(cfg.get("num_local_experts"))
    if rest == "shared_mlp.input_linear.weight":
        gate, up = np.split(t, 2)
        kind = "_shexp" if experts else ""
        return [(f"blk.{bid}.ffn_gate{kind}.weight", gate), (f"blk.{bid}.ffn_up{kind}.weight", up)]
    if rest == "shared_mlp.output_linear.weight" and not experts:
        return [(f"blk.{bid}.ffn_down.weight", t)]
    if rest == "block_sparse_moe.input_linear.weight":
        gate, up = np.split(t, 2, axis=1)
        return [(f"blk.{bid}.ffn_gate_exps.weight", gate), (f"blk.{bid}.ffn_up_exps.weight", up)]
    if m and types[bid] in ("attention", "full_attention"):
        if rest in ("self_attn.q_proj.weight", "self_attn.k_proj.weight"):
            t = _permute(t, cfg["num_attention_heads"] if "q_proj" in rest else cfg["num_key_value_heads"])
        return [(name, t)]
    if rest == "mamba.dt_bias":
        return [(name.removesuffix(".dt_bias") + ".dt_proj.bias", t)]
    if rest == "mamba.conv1d.weight":
        return [(name, t.squeeze())]
    if rest in ("mamba.A_log", "mamba.D"):
        return [(name, (-np.exp(t) if rest == "mamba.A_log" else t).reshape(-1, 1))]
    if rest == "mamba.norm.weight":
        return [(name, t.reshape(cfg["mamba_n_groups"], -1))]
    return [(name, t)]


def _nemotron_h(name: str, t: np.ndarray, cfg: dict[str, Any]) -> list[tuple[str, np.ndarray]]:
    """NemotronHModel.modify_tensors (non-MoE): Llama's Q/K permutation, Mamba2Model's changes to the mixers (the
    checkpoint's `backbone.` names, which its name map knows)."""
    m = re.fullmatch(r"backbone\.layers\.(\d+)\.(.+)", name)
    if not m:
        return [(name, t)]
    rest = m.group(2)
    if rest == "mixer.gate.e_score_correction_bias":
        name = name.removesuffix("_bias") + ".bias"
    elif rest in ("mixer.q_proj.weight", "mixer.k_proj.weight"):
        t = _permute(t, cfg["num_attention_heads"] if "q_proj" in rest else cfg["num_key_value_heads"])
    elif rest == "mixer.dt_bias":
        name = name.removesuffix(".dt_bias") + ".dt_proj.bias"
    elif rest == "mixer.conv1d.weight":
        t = t.squeeze()
    elif rest in ("mixer.A_log", "mixer.D"):
        t = (-np.exp(t) if rest == "mixer.A_log" else t).reshape(-1, 1)
    elif rest == "mixer.norm.weight":
        t = t.reshape(cfg["n_groups"], -1)
    return [(name, t)]


def _lfm2(name: str, t: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """LFM2MoeModel: the conv squeezed to [C, K], expert_bias named as a bias (experts stacked beforehand)."""
    if "conv.conv" in name:
        return [(name, t.squeeze(1))]
    if name.endswith(".expert_bias"):
        return [(name + ".bias", t)]
    return [(name, t)]


_EXPERT = re.compile(r"((?:model|backbone)\.layers\.\d+\.(?:mlp|feed_forward|mixer)\.experts)\.(\d+)\.(\w+)\.weight")


def _stack_experts(tensors: dict[str, np.ndarray], experts: int) -> dict[str, tuple[np.ndarray, list[str]]]:
    """save_pretrained's one module per expert stacked into 3-D tensors (Qwen2MoeModel.modify_tensors); the 3-D
    `experts.gate_up_proj` of transformers 5 split into gate and up. Each with the stored tensors it came from."""
    out: dict[str, tuple[np.ndarray, list[str]]] = {}
    for name, t in tensors.items():
        m = _EXPERT.fullmatch(name)
        if m and m.group(2) == "0":
            names = [f"{m.group(1)}.{e}.{m.group(3)}.weight" for e in range(experts)]
            out[f"{m.group(1)}.{m.group(3)}.weight"] = np.stack([tensors[n] for n in names]), names
        elif name.endswith("mlp.experts.gate_up_proj"):
            gate, up = np.split(t, 2, axis=1)
            out[name.replace("gate_up_proj", "gate_proj.weight")] = gate, [name]
            out[name.replace("gate_up_proj", "up_proj.weight")] = up, [name]
        elif name.endswith("mlp.experts.down_proj"):
            out[name + ".weight"] = t, [name]
        elif not m:
            out[name] = t, [name]
    return out


_EXPERT_NAMES = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}
_EXPERT_NAMES |= {"w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}  # LFM2-MoE's


def _gguf_name(name: str, tmap: Any) -> str:
    if name.startswith("blk."):
        return name
    m = re.fullmatch(r"(?:model|backbone)\.layers\.(\d+)\.(?:mlp|feed_forward|mixer)\.experts\.(\w+)\.weight", name)
    if m:
        return f"blk.{m.group(1)}.{_EXPERT_NAMES[m.group(2)]}.weight"
    new = tmap.get_name(name, try_suffixes=(".weight", ".bias"))
    assert new is not None, name
    return new


def _qtype(new: str, t: np.ndarray, target: Any) -> Any:
    import gguf

    kind = new.split(".")[-2] if new.count(".") >= 2 else ""
    f32 = t.ndim <= 1 or new.endswith(("_norm.weight", "shortconv.conv.weight")) or kind in _F32
    f32 = f32 or not new.endswith(".weight")
    block = gguf.GGML_QUANT_SIZES[target][0]
    return gguf.GGMLQuantizationType.F32 if f32 or t.shape[-1] % block else target


def _metadata(w: Any, family: str, cfg: dict[str, Any]) -> None:
    """The keys the converter writes (TextModel's, then each class's own)."""
    n = cfg["num_hidden_layers"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(n)
    w.add_head_count(cfg["num_attention_heads"])
    w.add_vocab_size(cfg["vocab_size"])
    if family.startswith("nemotron_h"):
        _nemotron_h_metadata(w, cfg)
        return
    w.add_layer_norm_rms_eps(cfg.get("rms_norm_eps", cfg.get("norm_eps")))
    if cfg.get("intermediate_size"):
        w.add_feed_forward_length(cfg["intermediate_size"])
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg["num_experts_per_tok"])
    if family.startswith("granite"):
        _granite_metadata(w, cfg)
        return
    if family == "lfm2_moe":
        _lfm2_moe_metadata(w, cfg)
        return
    rp = cfg.get("rope_parameters") or {}
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(rp.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    if cfg.get("moe_intermediate_size"):
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if cfg.get("shared_expert_intermediate_size"):
        w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    w.add_ssm_conv_kernel(cfg["linear_conv_kernel_dim"])
    w.add_ssm_state_size(cfg["linear_key_head_dim"])
    w.add_ssm_group_count(cfg["linear_num_key_heads"])
    w.add_ssm_time_step_rank(cfg["linear_num_value_heads"])
    w.add_ssm_inner_size(cfg["linear_value_head_dim"] * cfg["linear_num_value_heads"])
    w.add_array(f"{ARCHS[family]}.attention.recurrent_layers", [t == "linear_attention" for t in cfg["layer_types"]])
    w.add_full_attention_interval(cfg.get("full_attention_interval", 4))
    w.add_rope_dimension_count(int(head_dim * rp.get("partial_rotary_factor", 0.25)))
    if family != "qwen3_next":  # the config's sections, or _Qwen35MRopeMixin's default
        w.add_rope_dimension_sections((list(rp.get("mrope_section", [11, 11, 10])) + [0])[:4])


def _lfm2_moe_metadata(w: Any, cfg: dict[str, Any]) -> None:
    """LFM2MoeModel.set_gguf_parameters: KV heads per layer (0 for a conv layer), the experts' size, the dense
    lead, sigmoid gating, the conv width."""
    import gguf

    kv = cfg["num_key_value_heads"]
    w.add_head_count_kv([kv if t == "full_attention" else 0 for t in cfg["layer_types"]])
    w.add_rope_freq_base((cfg.get("rope_parameters") or {}).get("rope_theta", 1e6))
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    w.add_leading_dense_block_count(cfg["num_dense_layers"])
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_shortconv_l_cache(cfg["conv_L_cache"])


def _nemotron_h_metadata(w: Any, cfg: dict[str, Any]) -> None:
    """NemotronHModel.set_gguf_parameters (non-MoE): the Mamba2 shape, KV heads and ffn size per layer (each 0
    where the layer's block is another), the head size, the layer norm's epsilon."""
    types = cfg["layers_block_type"]
    w.add_layer_norm_eps(cfg["layer_norm_epsilon"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_ssm_conv_kernel(cfg["conv_kernel"])
    w.add_ssm_state_size(cfg["ssm_state_size"])
    w.add_ssm_group_count(cfg["n_groups"])
    w.add_ssm_inner_size(cfg["mamba_num_heads"] * cfg["mamba_head_dim"])
    w.add_ssm_time_step_rank(cfg["mamba_num_heads"])
    kv = cfg["num_key_value_heads"]
    w.add_head_count_kv([kv if t == "full_attention" else 0 for t in types])
    ffn = {"mlp": cfg["intermediate_size"], "moe": cfg.get("moe_intermediate_size")}
    w.add_feed_forward_length([ffn.get(t) or 0 for t in types])
    if "moe" not in types:
        return
    w.add_expert_count(cfg["n_routed_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    w.add_expert_shared_feed_forward_length(cfg["moe_shared_expert_intermediate_size"])
    w.add_expert_shared_count(cfg["n_shared_experts"])
    w.add_expert_weights_norm(cfg["norm_topk_prob"])
    w.add_expert_weights_scale(cfg["routed_scaling_factor"])
    w.add_expert_group_count(cfg["n_group"])
    w.add_expert_group_used_count(cfg["topk_group"])
    if cfg.get("moe_latent_size"):
        w.add_moe_latent_size(cfg["moe_latent_size"])


def _granite_metadata(w: Any, cfg: dict[str, Any]) -> None:
    """GraniteHybridModel.set_gguf_parameters (Granite's scales, the Mamba2 shape, KV heads per layer)."""
    types = cfg["layer_types"]
    w.add_attention_scale(cfg["attention_multiplier"])
    w.add_embedding_scale(cfg["embedding_multiplier"])
    w.add_residual_scale(cfg["residual_multiplier"])
    w.add_logit_scale(cfg["logits_scaling"])
    if cfg.get("shared_intermediate_size"):
        w.add_expert_shared_feed_forward_length(cfg["shared_intermediate_size"])
    w.add_rope_freq_base(cfg.get("rope_theta", 10000.0))
    w.add_rope_dimension_count(cfg["hidden_size"] // cfg["num_attention_heads"])
    w.add_ssm_conv_kernel(cfg["mamba_d_conv"])
    w.add_ssm_state_size(cfg["mamba_d_state"])
    w.add_ssm_group_count(cfg["mamba_n_groups"])
    w.add_ssm_inner_size(cfg["mamba_expand"] * cfg["hidden_size"])
    w.add_ssm_time_step_rank(cfg["mamba_n_heads"])
    kv = cfg["num_key_value_heads"]
    w.add_head_count_kv([kv if t in ("attention", "full_attention") else 0 for t in types])
    use_rope = cfg.get("position_embedding_type") == "rope"  # llama.cpp: Bamba only, the converter's check
    w.add_rope_scaling_finetuned(use_rope)


def _check_exact(cfg: dict[str, Any], arch: str, target: Any) -> None:
    """The reference (each stored tensor quantized in its own layout) is exact only where the converter's column
    reorder (qwen35's out_proj, by value head) moves whole quantization blocks."""
    import gguf

    block = gguf.GGML_QUANT_SIZES[target][0]
    tiled = arch in ("qwen35", "qwen35moe") and cfg["linear_num_key_heads"] != cfg["linear_num_value_heads"]
    if tiled and cfg["linear_value_head_dim"] % block:
        raise ValueError(f"linear_value_head_dim must be a multiple of {block} for an exact {target.name} reference")


def write_hybrid_gguf(
    folder: str, family: str, fmt: str, path: str, merges: list[str] | None = None
) -> dict[str, np.ndarray]:
    """The HF checkpoint in `folder` (config.json, model.safetensors) as llama.cpp's converter writes it, at `path`;
    `merges`: BPE merges for the file's tokenizer (llama.cpp needs one; transformers refuses ones of tokens the
    tests' word-level vocabulary lacks). Returns model.safetensors' tensors as the file holds them (each one the
    converter quantized quantized and dequantized in its own layout: the same values, as every change the
    converter makes moves whole rows or whole blocks)."""
    import gguf
    from safetensors.numpy import load_file

    with open(os.path.join(folder, "config.json")) as f:
        cfg = json.load(f)
    cfg = cfg.get("text_config", cfg) | {"architectures": cfg.get("architectures")}
    cfg.setdefault("num_hidden_layers", len(cfg.get("layers_block_type") or []))  # Nemotron-H's saves none
    arch = ARCHS[family]
    archs = {name: key for key, name in gguf.MODEL_ARCH_NAMES.items()}
    tmap = gguf.get_tensor_name_map(archs[arch], cfg["num_hidden_layers"])
    target = gguf.GGMLQuantizationType[fmt.upper()]
    w = gguf.GGUFWriter(path, arch)
    w.add_name(f"tiny-{family}")
    _metadata(w, family, cfg)
    _tokenizer_metadata(w, merges or [])
    if target != gguf.GGMLQuantizationType.F32:
        _check_exact(cfg, arch, target)
    raw = {k: v.astype(np.float32) for k, v in load_file(os.path.join(folder, "model.safetensors")).items()}
    ref = dict(raw)
    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts") or 0
    types = cfg.get("layer_types") or cfg.get("layers_block_type") or []
    for name, (t, sources) in _stack_experts(raw, experts).items():
        if name == "lm_head.weight" and cfg.get("tie_word_embeddings"):
            continue
        if arch == "lfm2moe":
            pieces = _lfm2(name, t)
        elif arch.startswith("nemotron_h"):
            pieces = _nemotron_h(name, t, cfg)
        else:
            pieces = _granite(name, t, cfg, types) if arch == "granitehybrid" else _qwen(name, t, cfg, arch)
        for piece_name, piece in pieces:
            new = _gguf_name(piece_name, tmap)
            qtype = _qtype(new, piece, target)
            w.add_tensor(new, _encode(np.ascontiguousarray(piece), qtype), raw_dtype=qtype)
            if qtype != gguf.GGMLQuantizationType.F32:
                ref.update({n: _decode(_encode(raw[n], qtype), qtype, raw[n].shape) for n in sources})
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return ref
