"""Reading checkpoint tensors under their Hugging Face names, from safetensors shards or a GGUF file.

Both sources yield (hf_name, float tensor) pairs, so one function (`assign_weights`) fills the model, merging
q/k/v and gate/up as it goes. GGUF weights are dequantized with `gguf.quants.dequantize` (what transformers
uses) and the Q/K rows are un-permuted: llama.cpp's converter reorders them for its interleaved RoPE, and we
use the rotate-half layout of transformers.
"""

from __future__ import annotations

import glob
import json
import os
import re
from collections.abc import Callable, Iterator

import numpy as np
import torch

from pagedllm.errors import ModelLoadError
from pagedllm.model.config import ModelConfig
from pagedllm.model.llama import LlamaForCausalLM

_GGUF_LAYER_MAP = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GGUF_TOP_MAP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def safetensors_files(folder: str) -> list[str]:
    """The shards of a HF folder (from model.safetensors.index.json if present); error if there are none."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError) as e:
            raise ModelLoadError(f"cannot read {index}: {e}") from e
        files = sorted({os.path.join(folder, v) for v in weight_map.values()})
    else:
        files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise ModelLoadError(f"no *.safetensors weights in {folder} (only safetensors checkpoints are supported)")
    for f in files:
        if not os.path.isfile(f):
            raise ModelLoadError(f"weight shard missing: {f}")
    return files


def iter_safetensors(folder: str) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for path in safetensors_files(folder):
        try:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except ModelLoadError:
            raise
        except Exception as e:  # safetensors raises its own error types for corrupt headers / data
            raise ModelLoadError(f"corrupt or unreadable weight file {path}: {e}") from e


def unpermute_gguf(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (HF rotate-half layout <- GGUF interleaved layout)."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def iter_gguf(gf: "object", cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Dequantized GGUF tensors renamed to HF names; Q/K un-permuted for the llama architecture."""
    permuted = gf.metadata.get("general.architecture") in ("llama", "mistral")  # type: ignore[attr-defined]
    for name in gf.tensors:  # type: ignore[attr-defined]
        if name in _GGUF_TOP_MAP:
            hf = _GGUF_TOP_MAP[name]
        else:
            m = re.match(r"blk\.(\d+)\.(.+)$", name)
            if not m or m.group(2) not in _GGUF_LAYER_MAP:
                continue  # e.g. rope_freqs: not needed (RoPE is recomputed from the config)
            hf = f"model.layers.{m.group(1)}.{_GGUF_LAYER_MAP[m.group(2)]}"
        arr = gf.load_array(name)  # type: ignore[attr-defined]
        if permuted and (".q_proj." in hf or ".k_proj." in hf):
            arr = unpermute_gguf(arr, cfg.num_heads if ".q_proj." in hf else cfg.num_kv_heads)
        if not arr.flags.writeable:
            arr = arr.copy()
        yield hf, torch.from_numpy(np.ascontiguousarray(arr))


def assign_weights(model: LlamaForCausalLM, tensors: Iterator[tuple[str, torch.Tensor]], where: str) -> None:
    """Copy HF-named tensors into the model (merging q/k/v and gate/up); error on anything missing."""
    cfg = model.config
    pending: dict[str, torch.Tensor] = {}
    filled: set[str] = set()

    def put(param: torch.Tensor, value: torch.Tensor, key: str, shape: tuple[int, ...] | None = None) -> None:
        if tuple(value.shape) != tuple(shape or param.shape):
            raise ModelLoadError(f"{where}: tensor {key} has shape {tuple(value.shape)}, expected {tuple(shape or param.shape)}")
        with torch.no_grad():
            param.copy_(value)
        filled.add(key)

    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    inter = cfg.intermediate_size
    for name, t in tensors:
        name = name.removeprefix("model.") if not name.startswith("lm_head") else name
        if name == "embed_tokens.weight":
            put(model.embed_tokens, t, name)
        elif name == "norm.weight":
            put(model.norm.weight, t, name)
        elif name == "lm_head.weight":
            if model.lm_head is not None:
                put(model.lm_head, t, name)
        else:
            m = re.match(r"layers\.(\d+)\.(.+)$", name)
            if not m or int(m.group(1)) >= cfg.num_layers:
                continue  # rotary_emb.inv_freq and the like
            layer = model.layers[int(m.group(1))]
            sub = m.group(2)
            slices: dict[str, tuple[torch.Tensor, int, int]] = {
                "self_attn.q_proj.weight": (layer.qkv_weight, 0, q),
                "self_attn.k_proj.weight": (layer.qkv_weight, q, q + kv),
                "self_attn.v_proj.weight": (layer.qkv_weight, q + kv, q + 2 * kv),
                "mlp.gate_proj.weight": (layer.mlp.gate_up_weight, 0, inter),
                "mlp.up_proj.weight": (layer.mlp.gate_up_weight, inter, 2 * inter),
            }
            if layer.qkv_bias is not None:
                slices.update({
                    "self_attn.q_proj.bias": (layer.qkv_bias, 0, q),
                    "self_attn.k_proj.bias": (layer.qkv_bias, q, q + kv),
                    "self_attn.v_proj.bias": (layer.qkv_bias, q + kv, q + 2 * kv),
                })
            if sub in slices:
                p, a, b = slices[sub]
                put(p[a:b], t, name)
            elif sub == "self_attn.o_proj.weight":
                put(layer.o_weight, t, name)
            elif sub == "mlp.down_proj.weight":
                put(layer.mlp.down_weight, t, name)
            elif sub == "input_layernorm.weight":
                put(layer.input_layernorm.weight, t, name)
            elif sub == "post_attention_layernorm.weight":
                put(layer.post_attention_layernorm.weight, t, name)
    del pending
    required = ["embed_tokens.weight", "norm.weight"] + (["lm_head.weight"] if model.lm_head is not None else [])
    per_layer = ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                 "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
                 "input_layernorm.weight", "post_attention_layernorm.weight"]
    if cfg.attention_bias:
        per_layer += ["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"]
    required += [f"layers.{i}.{s}" for i in range(cfg.num_layers) for s in per_layer]
    missing = [r for r in required if r not in filled]
    if missing:
        raise ModelLoadError(f"{where}: checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")


TensorSource = Callable[[], Iterator[tuple[str, torch.Tensor]]]
