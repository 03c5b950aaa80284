"""Reading checkpoint tensors under their Hugging Face names, from safetensors shards or a GGUF file.

Both sources yield (hf_name, float tensor) pairs, so one function (`assign_weights`) fills the model, merging
q/k/v and gate/up as it goes. GGUF weights are dequantized with `gguf.quants.dequantize` (what transformers
uses), or, for `--quantization gguf`, kept as stored (`QuantParts`, see quant.py); the Q/K rows are
un-permuted: llama.cpp's converter reorders them for its interleaved RoPE, and we use the rotate-half layout of
transformers.

Memory while loading: the weights end up resident once, so whatever loading needs besides them is bounded by
one tensor, never the model: a quantized weight is packed for the kernels as soon as its pieces (q/k/v,
gate/up) are in, and a matrix loaded dense is dequantized a chunk of rows at a time straight into its
parameter (`DenseRows`; a 128k x 4096 head is 2 GiB in float32).
"""

from __future__ import annotations

import glob
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from pagedllm.errors import ModelLoadError
from pagedllm.model.config import ModelConfig
from pagedllm.model.llama import MERGED, LlamaForCausalLM, install_quant
from pagedllm.model.quant import GGML_TYPES, QuantParts, from_gguf_blocks, log_once, merge, pack, quantize_rtn

CHUNK_BYTES = 64 << 20  # float32 bytes of a dense GGUF matrix dequantized at a time


@dataclass
class DenseRows:
    """A GGUF matrix to load dense, read from the open file a chunk of rows at a time by `copy_to`."""

    gf: Any  # GGUFFile
    name: str
    shape: tuple[int, int]

    def copy_to(self, param: torch.Tensor) -> None:
        step = max(1, CHUNK_BYTES // (4 * self.shape[1]))
        for a in range(0, self.shape[0], step):
            rows = self.gf.load_array(self.name, slice(a, a + step))
            if not rows.flags.writeable:
                rows = rows.copy()
            with torch.no_grad():
                param[a : a + rows.shape[0]].copy_(torch.from_numpy(rows))


Value = torch.Tensor | QuantParts | DenseRows

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
    for shard in files:
        if not os.path.isfile(shard):
            raise ModelLoadError(f"weight shard missing: {shard}")
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


def _gguf_hf_name(name: str) -> str | None:
    if name in _GGUF_TOP_MAP:
        return _GGUF_TOP_MAP[name]
    m = re.match(r"blk\.(\d+)\.(.+)$", name)
    if not m or m.group(2) not in _GGUF_LAYER_MAP:
        return None  # e.g. rope_freqs: not needed (RoPE is recomputed from the config)
    return f"model.layers.{m.group(1)}.{_GGUF_LAYER_MAP[m.group(2)]}"


def iter_gguf(gf: object, cfg: ModelConfig, keep_quantized: bool = False) -> Iterator[tuple[str, Value]]:
    """GGUF tensors renamed to HF names, Q/K un-permuted for the llama architecture: dequantized to float32, or,
    with `keep_quantized`, matrices in a type the kernels run (Q4_0, Q4_1, Q8_0) as QuantParts."""
    permuted = gf.metadata.get("general.architecture") in ("llama", "mistral")  # type: ignore[attr-defined]
    for name, info in gf.tensors.items():  # type: ignore[attr-defined]
        hf = _gguf_hf_name(name)
        if hf is None:
            continue
        heads = cfg.num_heads if ".q_proj." in hf else cfg.num_kv_heads
        unpermute = permuted and (".q_proj." in hf or ".k_proj." in hf)
        parts = (
            from_gguf_blocks(gf.load_raw(name), info.ggml_type)  # type: ignore[attr-defined]
            if keep_quantized and info.ggml_type in GGML_TYPES and len(info.shape) == 2
            else None
        )
        if parts is not None:
            yield hf, parts.rows(unpermute_gguf(np.arange(info.shape[0]), heads)) if unpermute else parts
            continue
        if len(info.shape) == 2 and not unpermute:
            yield hf, DenseRows(gf, name, (info.shape[0], info.shape[1]))
            continue
        arr = gf.load_array(name)  # type: ignore[attr-defined]
        if unpermute:
            arr = unpermute_gguf(arr, heads)
        if not arr.flags.writeable:
            arr = arr.copy()
        yield hf, torch.from_numpy(np.ascontiguousarray(arr))


def _destination(model: LlamaForCausalLM, name: str) -> tuple[torch.Tensor, tuple[nn.Module, str], int] | None:
    """Where an HF-named tensor goes: (the parameter or its row slice, the (module, attribute) of the whole,
    possibly merged, weight, and the piece's index in it); None for tensors the model does not use."""
    cfg = model.config
    if name in ("embed_tokens.weight", "norm.weight"):
        return (
            (model.embed_tokens, (model, "embed_tokens"), 0)
            if name == "embed_tokens.weight"
            else (model.norm.weight, (model.norm, "weight"), 0)
        )
    if name == "lm_head.weight":
        return None if model.lm_head is None else (model.lm_head, (model, "lm_head"), 0)
    m = re.match(r"layers\.(\d+)\.(.+)$", name)
    if not m or int(m.group(1)) >= cfg.num_layers:
        return None  # rotary_emb.inv_freq and the like
    layer = model.layers[int(m.group(1))]
    q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    merged = {  # piece -> (module, attribute, index, first row, end row)
        "self_attn.q_proj": (layer, "qkv", 0, 0, q),
        "self_attn.k_proj": (layer, "qkv", 1, q, q + kv),
        "self_attn.v_proj": (layer, "qkv", 2, q + kv, q + 2 * kv),
        "mlp.gate_proj": (layer.mlp, "gate_up", 0, 0, inter),
        "mlp.up_proj": (layer.mlp, "gate_up", 1, inter, 2 * inter),
        "self_attn.o_proj": (layer, "o", 0, 0, None),
        "mlp.down_proj": (layer.mlp, "down", 0, 0, None),
    }
    sub, _, kind = m.group(2).rpartition(".")
    if sub in merged:
        mod, attr, idx, a, b = merged[sub]
        if kind == "bias":
            return (
                (layer.qkv_bias[a:b], (layer, "qkv_bias"), idx)
                if attr == "qkv" and layer.qkv_bias is not None
                else None
            )
        param = getattr(mod, f"{attr}_weight")
        return (param if b is None else param[a:b]), (mod, f"{attr}_weight"), idx
    norms = {"input_layernorm": layer.input_layernorm, "post_attention_layernorm": layer.post_attention_layernorm}
    if sub in norms and kind == "weight":
        return norms[sub].weight, (norms[sub], "weight"), 0
    return None


def _put(param: torch.Tensor, value: Value, key: str, where: str) -> None:
    shape = tuple(value.shape)
    if shape != tuple(param.shape):
        raise ModelLoadError(f"{where}: tensor {key} has shape {shape}, expected {tuple(param.shape)}")
    if isinstance(value, DenseRows):
        value.copy_to(param)
    elif not isinstance(value, QuantParts):
        with torch.no_grad():
            param.copy_(value)


def assign_weights(model: LlamaForCausalLM, tensors: Iterator[tuple[str, Value]], where: str) -> None:
    """Copy HF-named tensors into the model (merging q/k/v and gate/up); error on anything missing. QuantParts
    are kept quantized where every piece of their merged weight is, and packed as soon as the last piece is in
    (so loading holds one weight's plain form at a time, not the model's); else dequantized into place."""
    filled: set[str] = set()
    pieces: dict[tuple[nn.Module, str], dict[int, tuple[QuantParts, torch.Tensor]]] = {}
    for name, t in tensors:
        name = name.removeprefix("model.") if not name.startswith("lm_head") else name
        dest = _destination(model, name)
        if dest is None:
            continue
        target, whole, idx = dest
        _put(target, t, name, where)
        filled.add(name)
        if not isinstance(t, QuantParts):
            continue
        got = pieces.setdefault(whole, {})
        got[idx] = (t, target)
        parts = merge([got[i][0] for i in sorted(got)]) if len(got) == MERGED.get(whole[1], 1) else None
        if parts is not None:
            install_quant(*whole, pack(parts))
            del pieces[whole]
    for (_, attr), got in pieces.items():
        log_once(f"{where}: {attr} mixes quantized types, or quantized and dense pieces; it runs dense")
        for p, target in got.values():
            with torch.no_grad():
                target.copy_(p.dequantize())
    _check_complete(model, filled, where)


def _check_complete(model: LlamaForCausalLM, filled: set[str], where: str) -> None:
    cfg = model.config
    required = ["embed_tokens.weight", "norm.weight"] + (["lm_head.weight"] if model.lm_head is not None else [])
    per_layer = [
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
        "self_attn.o_proj.weight",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
    ]
    if cfg.attention_bias:
        per_layer += ["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"]
    required += [f"layers.{i}.{s}" for i in range(cfg.num_layers) for s in per_layer]
    missing = [r for r in required if r not in filled]
    if missing:
        raise ModelLoadError(f"{where}: checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")


def quantize_rtn_model(model: LlamaForCausalLM, bits: int) -> None:
    """--quantization int8|int4 on dense weights: every linear weight rounded to `bits` in groups of 32 (the
    embedding / LM head table to 8 bits either way: it is read one row per token, and 4 bits cost accuracy)."""
    for module, attr in model.linear_weights():
        param = getattr(module, attr)
        if param.shape[-1] % 32:
            log_once(f"{attr}: input size {param.shape[-1]} is not a multiple of 32; it runs dense")
            continue
        install_quant(module, attr, pack(quantize_rtn(param, 8 if attr in ("embed_tokens", "lm_head") else bits)))
