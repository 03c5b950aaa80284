"""Tiny random mixture-of-experts checkpoints of every sparse family: Hugging Face folders in the layout
`save_pretrained` writes (one module per expert; Granite's 3-D `input_linear`), in transformers 5's own layout
(3-D `experts.gate_up_proj` / `experts.down_proj`, written from the state dict), and GGUF files written as
llama.cpp's converter writes MoE models: experts stacked into `blk.N.ffn_{gate,up,down}_exps` ([experts, rows,
cols]), the router `ffn_gate_inp` and the shared expert's gate `ffn_gate_inp_shexp` in F32, the shared expert as
`ffn_*_shexp`, `<arch>.expert_count` / `expert_used_count` / `expert_feed_forward_length` /
`expert_shared_feed_forward_length`, Mixtral as arch "llama" and Mixtral / Granite-MoE with Q/K permuted.

Weights as family_helpers draws them (0.25 * N(0, 1), norms around 1): router logits spread by ~2 so the
routing differs from token to token and a wrong expert moves the logits far past the tolerance. `write_gguf`
returns the state dict (transformers' own names) that the file's dequantized values stand for.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import numpy as np
import torch

from devkit.family_helpers import (
    _decode,
    _encode,
    _metadata,
    _permute,
    _randomize,
    _tokenizer_metadata,
    _unpermute,
    save_tokenizer,
)

_COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    max_position_embeddings=512,
)
_GRANITE = {"embedding_multiplier": 3.0, "residual_multiplier": 0.5, "attention_multiplier": 0.2, "logits_scaling": 2.0}
# family -> (transformers config class, arguments beyond _COMMON, GGUF arch)
SPECS: dict[str, tuple[str, dict[str, Any], str]] = {
    "qwen2_moe": (
        "Qwen2MoeConfig",
        {
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "intermediate_size": 96,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 64,
        },
        "qwen2moe",
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        {
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "intermediate_size": 96,
            "moe_intermediate_size": 32,
            "head_dim": 16,
            "norm_topk_prob": True,
        },
        "qwen3moe",
    ),
    "olmoe": ("OlmoeConfig", {"num_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 32}, "olmoe"),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 64}, "llama"),
    "granitemoe": (
        "GraniteMoeConfig",
        {"num_local_experts": 6, "num_experts_per_tok": 2, "intermediate_size": 32} | _GRANITE,
        "granitemoe",
    ),
    "granitemoeshared": (
        "GraniteMoeSharedConfig",
        {"num_local_experts": 6, "num_experts_per_tok": 2, "intermediate_size": 32, "shared_intermediate_size": 64}
        | _GRANITE,
        "granitemoe",
    ),
}
FAMILIES = list(SPECS)
# Dense layers among sparse ones: every second layer sparse (decoder_sparse_step), the last dense (mlp_only_layers);
# llama.cpp's qwen2moe / qwen3moe have no dense ffn tensors, so this one is a folder only.
SPECS["qwen2_moe_dense"] = (
    "Qwen2MoeConfig",
    SPECS["qwen2_moe"][1] | {"num_hidden_layers": 4, "decoder_sparse_step": 2, "mlp_only_layers": [3]},
    "qwen2moe",
)
PERMUTED = {"llama", "granitemoe"}  # GGUF archs whose Q/K rows the converter permutes


def make_moe(family: str, folder: str) -> torch.nn.Module:
    """A tiny random `family` checkpoint saved by `save_pretrained` in `folder` (with a tokenizer); the model."""
    import transformers
    from transformers import AutoModelForCausalLM

    cls_name, extra, _ = SPECS[family]
    cfg = getattr(transformers, cls_name)(**(_COMMON | extra))
    cfg.architectures = [cls_name.replace("Config", "ForCausalLM")]
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    _randomize(hf, family)
    hf.save_pretrained(folder, safe_serialization=True)
    save_tokenizer(folder)
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 1, "eos_token_id": [2, 3]}, f)
    return hf


def save_fused(hf: torch.nn.Module, folder: str, src: str) -> None:
    """The same checkpoint in transformers 5's own names and 3-D expert tensors (its state dict), beside the
    config and tokenizer of `src`."""
    import shutil

    from safetensors.torch import save_file

    shutil.copytree(src, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    tensors = {k: v.contiguous() for k, v in hf.state_dict().items()}
    save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})


_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
# transformers 5's names (under model.layers.N.) of the sparse blocks' tensors -> llama.cpp's, several when the
# converter splits one (gate and up stacked)
_MOE_NAMES = {
    "mlp.gate.weight": ("ffn_gate_inp",),
    "block_sparse_moe.router.weight": ("ffn_gate_inp",),
    "mlp.experts.gate_up_proj": ("ffn_gate_exps", "ffn_up_exps"),
    "block_sparse_moe.experts.gate_up_proj": ("ffn_gate_exps", "ffn_up_exps"),
    "mlp.experts.down_proj": ("ffn_down_exps",),
    "block_sparse_moe.experts.down_proj": ("ffn_down_exps",),
    "mlp.shared_expert.gate_proj.weight": ("ffn_gate_shexp",),
    "mlp.shared_expert.up_proj.weight": ("ffn_up_shexp",),
    "mlp.shared_expert.down_proj.weight": ("ffn_down_shexp",),
    "mlp.shared_expert_gate.weight": ("ffn_gate_inp_shexp",),
    "shared_mlp.input_linear.weight": ("ffn_gate_shexp", "ffn_up_shexp"),
    "shared_mlp.output_linear.weight": ("ffn_down_shexp",),
}
_F32 = ("ffn_gate_inp", "ffn_gate_inp_shexp")  # the converter keeps the routers in F32


def _gguf_names(name: str, tmap: Any) -> tuple[list[str], int]:
    """llama.cpp's names for one of transformers' tensors, and the dim its pieces are split along."""
    m = _LAYER.fullmatch(name)
    if m and m.group(2) in _MOE_NAMES:
        pieces = _MOE_NAMES[m.group(2)]
        return [f"blk.{m.group(1)}.{p}.weight" for p in pieces], (1 if "experts" in m.group(2) else 0)
    new = tmap.get_name(name, try_suffixes=(".weight", ".bias"))
    assert new is not None, name
    return [new], 0


def _metadata_moe(w: Any, family: str, cfg: dict[str, Any], arch: str, written: set[str]) -> None:
    _metadata(w, "granite" if family.startswith("granite") else family, cfg)
    if f"{arch}.expert_count" not in written:
        w.add_expert_count(cfg.get("num_experts") or cfg["num_local_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    if cfg.get("moe_intermediate_size"):
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    shared = cfg.get("shared_expert_intermediate_size") or cfg.get("shared_intermediate_size")
    if shared:
        w.add_expert_shared_feed_forward_length(shared)


def write_gguf(
    hf: torch.nn.Module, folder: str, family: str, fmt: str, path: str, extra: dict[str, Any] | None = None
) -> dict[str, torch.Tensor]:
    """The model `hf` (saved in `folder`) as a GGUF at `path` (fmt: f32, q8_0, q4_0; norms, 1-D tensors and
    routers in F32); `extra`: metadata (key -> int) to write first, in place of the converter's. Returns the state
    dict the file stands for."""
    import gguf

    with open(os.path.join(folder, "config.json")) as f:
        cfg = json.load(f)
    arch = SPECS[family][2]
    archs = {name: key for key, name in gguf.MODEL_ARCH_NAMES.items()}
    tmap = gguf.get_tensor_name_map(archs[arch], cfg["num_hidden_layers"])
    target = gguf.GGMLQuantizationType[fmt.upper()]
    w = gguf.GGUFWriter(path, arch)
    w.add_name(f"tiny-{family}")
    for key, value in (extra or {}).items():
        w.add_uint32(key, value)
    _metadata_moe(w, family, cfg, arch, set(extra or {}))
    _tokenizer_metadata(w, [])
    ref: dict[str, torch.Tensor] = {}
    for name, param in hf.state_dict().items():
        t = param.float().numpy()
        heads = 0
        if arch in PERMUTED and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg["num_attention_heads"] if "q_proj" in name else cfg["num_key_value_heads"]
            t = _permute(t, heads)
        names, dim = _gguf_names(name, tmap)
        back = []
        for new, piece in zip(names, np.split(t, len(names), axis=dim)):
            f32 = piece.ndim == 1 or new.endswith("_norm.weight") or new.split(".")[-2] in _F32
            qtype = gguf.GGMLQuantizationType.F32 if f32 else target
            data = _encode(np.ascontiguousarray(piece), qtype)
            w.add_tensor(new, data, raw_dtype=qtype)
            back.append(_decode(data, qtype, piece.shape))
        whole = np.concatenate(back, axis=dim)
        if heads:
            whole = _unpermute(whole, heads)
        ref[name] = torch.from_numpy(np.ascontiguousarray(whole))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return ref
