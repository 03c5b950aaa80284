"""Dense LFM2 (short-conv and attention layers) as a tiny random HF checkpoint and as the GGUF llama.cpp's
converter writes from it (LFM2Model: arch lfm2), for tests/test_model_ssm.py and
benchmarks/serving/family_parity_llamacpp.py.

The converter's changes: the conv layers' `head_count_kv` 0 (one number per layer), `shortconv.l_cache`, the conv
weight squeezed to [C, K], the tied lm_head left out; norms, the conv and 1-D tensors stay F32, the rest in `fmt`
(f32, f16, q8_0, q4_0)."""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from devkit.family_helpers import _decode, _encode, _metadata, _tokenizer_metadata
from devkit.hybrid_gguf import _COMMON
from devkit.tiny_tokenizer import save_tiny_tokenizer

VOCAB = _COMMON["vocab_size"]
# short-conv, attention, short-conv, short-conv; intermediate_size 144 becomes 96 (LFM2's 2/3 and multiple of 16)
CONFIG: dict[str, Any] = _COMMON | dict(
    intermediate_size=144,
    layer_types=["conv", "full_attention", "conv", "conv"],
    conv_L_cache=3,
    norm_eps=1e-5,
    block_multiple_of=16,
)


def make_lfm2(folder: str) -> Any:
    """A tiny random LFM2 checkpoint in `folder` (float32, a word-level tokenizer); its transformers model. Norms
    drawn in [0.5, 1.5] and every other tensor N(0, 0.3^2) (wider than the 0.02 init: the conv state counts)."""
    import torch
    from transformers import AutoModelForCausalLM, Lfm2Config

    cfg = Lfm2Config(**CONFIG)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(("norm.weight", "layernorm.weight")):
                p.uniform_(0.5, 1.5)
            elif name.endswith(("A_log", "dt_bias", "D", "conv1d.bias")):
                p.uniform_(-1, 1)
            else:
                p.normal_(0, 0.3)
    hf.save_pretrained(folder, safe_serialization=True)
    save_tiny_tokenizer(folder, VOCAB)
    return hf


def write_lfm2_gguf(hf: Any, folder: str, fmt: str, path: str, merges: list[str] | None = None) -> dict[str, Any]:
    """The LFM2 model `hf` (saved in `folder`) as llama.cpp's converter writes it (arch lfm2: the conv layers'
    `head_count_kv` 0, `shortconv.l_cache`, the conv weight squeezed to [C, K]; norms, the conv and 1-D tensors in
    F32, the rest in `fmt`); `merges`: BPE merges for the file's tokenizer (llama.cpp needs one). Returns the state
    dict the file stands for."""
    import gguf
    import torch

    from pagedllm.model import load_model_config

    cfg = json.load(open(os.path.join(folder, "config.json")))
    tmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LFM2, cfg["num_hidden_layers"])
    w = gguf.GGUFWriter(path, "lfm2")
    w.add_name("tiny-lfm2")
    loaded = load_model_config(folder)
    _metadata(w, "lfm2", cfg | {"intermediate_size": loaded.intermediate_size, "rms_norm_eps": cfg["norm_eps"]})
    kv = [cfg["num_key_value_heads"] if t == "full_attention" else 0 for t in cfg["layer_types"]]
    w.add_array("lfm2.attention.head_count_kv", kv)  # in place of _metadata's one number
    w.add_uint32("lfm2.shortconv.l_cache", cfg["conv_L_cache"])
    _tokenizer_metadata(w, merges or [])
    target = gguf.GGMLQuantizationType[fmt.upper()]
    ref: dict[str, torch.Tensor] = {}
    for name, param in hf.state_dict().items():
        if name == "lm_head.weight":  # tied: the converter writes the embedding table only
            continue
        t = param.float().numpy()
        t = t[:, 0] if name.endswith("conv.conv.weight") else t
        new = tmap.get_name(name, try_suffixes=(".weight", ".bias"))
        assert new is not None, name
        f32 = t.ndim == 1 or "norm" in new or "shortconv.conv" in new
        qtype = gguf.GGMLQuantizationType.F32 if f32 else target
        data = _encode(np.ascontiguousarray(t), qtype)
        w.add_tensor(new, data, raw_dtype=qtype)
        ref[name] = torch.from_numpy(np.ascontiguousarray(_decode(data, qtype, t.shape))).reshape(param.shape)
    ref["lm_head.weight"] = ref["model.embed_tokens.weight"]
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return ref
