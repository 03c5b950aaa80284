"""Tiny random checkpoints of every supported family, as Hugging Face folders and as GGUF files written the way
llama.cpp's converter (convert_hf_to_gguf.py) writes them: its tensor names (gguf's own name map), Q/K rows
permuted for the Llama-style archs, Gemma norms stored as 1 + w, Llama 3 scaling as the `rope_freqs` tensor
(with `original_max_position_embeddings` from the top level of config.json, 8192 if absent, as the converter
reads it), Phi-3's factors as tensors, in F32, F16, Q8_0 or Q4_0 (`gguf.quants.quantize`).

Weights are drawn larger than transformers' init (std 0.02 would make every feature's effect vanish in the
noise), norms around 1 (Gemma's around 0), so a family feature left out changes the logits by far more than
the tolerance. `write_gguf` also returns the state dict the file stands for (dequantized, in HF layout), the
reference a quantized file is compared with.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import numpy as np
import torch

VOCAB = 256
SPECIAL = {0: "<unk>", 1: "<s>", 2: "</s>", 3: "<|eot_id|>", 4: "<end_of_turn>", 5: "<|im_end|>"}
CHAT_TEMPLATE = "{% for m in messages %}<s> {{ m['content'] }} <|eot_id|> {% endfor %}"
ORIG_CTX = 64  # the original context of the scaled-RoPE configs: their tests run past it
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    max_position_embeddings=512,
)
_ROT = 12  # Phi's rotary width: 3/4 of a head of 16, as Phi-4-mini
# family -> (transformers config class, its arguments beyond _COMMON, GGUF architecture)
SPECS: dict[str, tuple[str, dict[str, Any], str]] = {
    "llama": ("LlamaConfig", {"tie_word_embeddings": True}, "llama"),
    "llama3": (
        "LlamaConfig",
        {
            "rope_theta": 500000.0,
            "original_max_position_embeddings": ORIG_CTX,
            "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
        },
        "llama",
    ),
    "mistral": ("MistralConfig", {"sliding_window": 256}, "llama"),
    "qwen2": ("Qwen2Config", {"rope_theta": 1e6}, "qwen2"),
    "qwen2-yarn": (
        "Qwen2Config",
        {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIG_CTX}},
        "qwen2",
    ),
    "qwen3": ("Qwen3Config", {"head_dim": 16}, "qwen3"),
    "gemma2": (
        "Gemma2Config",
        {
            "head_dim": 16,
            "query_pre_attn_scalar": 16,
            "sliding_window": 256,
            "attn_logit_softcapping": 3.0,
            "final_logit_softcapping": 4.0,
        },
        "gemma2",
    ),
    "gemma3": (
        "Gemma3TextConfig",
        {
            "head_dim": 16,
            "query_pre_attn_scalar": 16,
            "sliding_window": 256,
            "num_hidden_layers": 6,  # llama.cpp's pattern: five sliding layers, then a global one
            "rope_parameters": {
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        },
        "gemma3",
    ),
    "phi3": (
        "Phi3Config",
        {
            "partial_rotary_factor": _ROT / 16,
            "original_max_position_embeddings": ORIG_CTX,
            "rope_scaling": {
                "rope_type": "longrope",
                "short_factor": [1.0 + 0.1 * i for i in range(_ROT // 2)],
                "long_factor": [1.5 + 0.4 * i for i in range(_ROT // 2)],
            },
        },
        "phi3",
    ),
    "smollm3": ("SmolLM3Config", {"rope_theta": 2e6}, "smollm3"),
    "olmo2": ("Olmo2Config", {}, "olmo2"),
    "granite": (
        "GraniteConfig",
        {"embedding_multiplier": 3.0, "residual_multiplier": 0.5, "attention_multiplier": 0.2, "logits_scaling": 2.0},
        "granite",
    ),
}
# Dynamic NTK: transformers rescales with the sequence length, so it runs only from an HF folder, and llama.cpp
# has no such type (a GGUF cannot say it).
SPECS["llama-dynamic"] = (
    "LlamaConfig",
    {"max_position_embeddings": ORIG_CTX, "rope_scaling": {"rope_type": "dynamic", "factor": 4.0}},
    "llama",
)
FAMILIES = [f for f in SPECS if f != "llama-dynamic"]
SCALED = {"llama3", "qwen2-yarn", "phi3", "gemma3"}  # RoPE types whose tests must reach past ORIG_CTX
PERMUTED = {"llama", "granite", "smollm3"}  # GGUF archs whose Q/K rows the converter permutes
GEMMA = {"gemma2", "gemma3"}


def save_tokenizer(folder: str) -> None:
    """A word-level tokenizer ("t6".."t255" and the special tokens above) with a chat template."""
    from tokenizers import Tokenizer as HFTok
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(len(SPECIAL), VOCAB)} | {v: k for k, v in SPECIAL.items()}
    tok = HFTok(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        additional_special_tokens=list(SPECIAL.values())[3:],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)


@torch.no_grad()
def _randomize(model: torch.nn.Module, family: str) -> None:
    g = torch.Generator().manual_seed(0)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            centre = 0.0 if family in GEMMA else 1.0
            p.copy_(centre + 0.2 * torch.randn(p.shape, generator=g))
        else:
            p.copy_(0.25 * torch.randn(p.shape, generator=g))


def make_family(family: str, folder: str) -> torch.nn.Module:
    """A tiny random `family` checkpoint saved in `folder` (safetensors, config.json, tokenizer); the model."""
    import transformers
    from transformers import AutoModelForCausalLM

    cls_name, extra, _ = SPECS[family]
    cfg = getattr(transformers, cls_name)(**(_COMMON | extra))
    cfg.architectures = [cls_name.replace("TextConfig", "ForCausalLM").replace("Config", "ForCausalLM")]
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    _randomize(hf, family)
    hf.save_pretrained(folder, safe_serialization=True)
    save_tokenizer(folder)
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 1, "eos_token_id": [2, 3]}, f)
    return hf


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter's LlamaModel.permute (HF rotate-half rows -> its interleaved layout)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama3_factors(cfg: dict[str, Any], dim: int) -> list[float]:
    """The converter's rope_freqs for `rope_type: llama3` (old context from the top level of config.json)."""
    rp = cfg.get("rope_parameters") or cfg["rope_scaling"]
    base, factor = rp.get("rope_theta", cfg.get("rope_theta", 10000.0)), rp.get("factor", 8.0)
    low, high = rp.get("low_freq_factor", 1.0), rp.get("high_freq_factor", 4.0)
    old = cfg.get("original_max_position_embeddings", 8192)
    out = []
    for freq in (1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))).tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return out


def _metadata(w: Any, family: str, cfg: dict[str, Any]) -> None:
    """The hyperparameters the converter writes for this family."""
    import gguf

    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    rp = cfg.get("rope_parameters") or {}
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_vocab_size(cfg["vocab_size"])
    w.add_rope_dimension_count(int(head_dim * cfg.get("partial_rotary_factor", 1.0)))
    global_rp = rp.get("full_attention", rp)
    w.add_rope_freq_base(global_rp.get("rope_theta", 10000.0))
    kind = global_rp.get("rope_type", "default")
    if kind == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(global_rp["factor"])
    if kind == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(global_rp["factor"])
        w.add_rope_scaling_orig_ctx_len(global_rp["original_max_position_embeddings"])
    if cfg.get("sliding_window") and family != "mistral":
        w.add_sliding_window(cfg["sliding_window"])
    if family == "gemma2":
        w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    if family == "phi3":
        orig = cfg["original_max_position_embeddings"]
        scale = cfg["max_position_embeddings"] / orig
        w.add_rope_scaling_orig_ctx_len(orig)
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1 else 1.0)
    if family == "granite":
        w.add_embedding_scale(cfg["embedding_multiplier"])
        w.add_residual_scale(cfg["residual_multiplier"])
        w.add_logit_scale(cfg["logits_scaling"])
        w.add_attention_scale(cfg["attention_multiplier"])


def _tokenizer_metadata(w: Any, merges: list[str]) -> None:
    tokens = [SPECIAL.get(i, f"t{i}") for i in range(VOCAB)]
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3 if i in SPECIAL else 1 for i in range(VOCAB)])
    w.add_token_scores([0.0] * VOCAB)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)


def _encode(arr: np.ndarray, qtype: Any) -> np.ndarray:
    import gguf

    if qtype == gguf.GGMLQuantizationType.F32:
        return arr.astype(np.float32)
    if qtype == gguf.GGMLQuantizationType.F16:
        return arr.astype(np.float16)
    return gguf.quants.quantize(arr.astype(np.float32), qtype)


def _decode(data: np.ndarray, qtype: Any, shape: tuple[int, ...]) -> np.ndarray:
    import gguf

    if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
        return data.astype(np.float32)
    return np.asarray(gguf.quants.dequantize(data, qtype), dtype=np.float32).reshape(shape)


def _gguf_tensor(name: str, t: np.ndarray, family: str, cfg: dict[str, Any]) -> tuple[np.ndarray, int]:
    """The converter's changes to one HF tensor: Q/K permuted (Llama-style archs: by how many heads, else 0),
    Gemma norms + 1."""
    heads = 0
    if SPECS[family][2] in PERMUTED and name.endswith(("q_proj.weight", "k_proj.weight")):
        heads = cfg["num_attention_heads"] if "q_proj" in name else cfg["num_key_value_heads"]
        t = _permute(t, heads)
    if family in GEMMA and name.endswith("norm.weight"):
        t = t + 1
    return t, heads


def write_gguf(
    folder: str, family: str, fmt: str, path: str, merges: list[str] | None = None
) -> dict[str, torch.Tensor]:
    """The HF checkpoint in `folder` as a GGUF at `path` (fmt: f32, f16, q8_0, q4_0; norms and 1-D tensors in F32,
    as the converter keeps them); returns the HF-named state dict the file's values stand for. `merges`: BPE
    merges for the file's tokenizer (llama.cpp refuses a BPE vocabulary without any; transformers refuses merges
    of tokens this word-level vocabulary lacks, so the tests write none)."""
    import gguf
    from safetensors import safe_open

    with open(os.path.join(folder, "config.json")) as f:
        cfg = json.load(f)
    arch = SPECS[family][2]
    archs = {name: key for key, name in gguf.MODEL_ARCH_NAMES.items()}
    tmap = gguf.get_tensor_name_map(archs[arch], cfg["num_hidden_layers"])
    target = gguf.GGMLQuantizationType[fmt.upper()]
    w = gguf.GGUFWriter(path, arch)
    w.add_name(f"tiny-{family}")
    _metadata(w, family, cfg)
    _tokenizer_metadata(w, merges or [])
    ref: dict[str, torch.Tensor] = {}
    with safe_open(os.path.join(folder, "model.safetensors"), framework="pt") as st:
        for name in st.keys():
            raw = st.get_tensor(name).float().numpy()
            t, heads = _gguf_tensor(name, raw, family, cfg)
            new = tmap.get_name(name, try_suffixes=(".weight", ".bias"))
            assert new is not None, name
            qtype = gguf.GGMLQuantizationType.F32 if t.ndim == 1 or new.endswith("_norm.weight") else target
            data = _encode(t, qtype)
            w.add_tensor(new, data, raw_dtype=qtype)
            back = _decode(data, qtype, t.shape)
            if family in GEMMA and name.endswith("norm.weight"):
                back = back - 1
            if heads:
                back = _unpermute(back, heads)
            ref[name] = torch.from_numpy(back.copy())
    _extra_tensors(w, family, cfg)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return ref


def _extra_tensors(w: Any, family: str, cfg: dict[str, Any]) -> None:
    """The converter's generated tensors: Llama 3's rope_freqs, Phi-3's long / short factors."""
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    rp = cfg.get("rope_parameters") or {}
    if rp.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", np.array(_llama3_factors(cfg, head_dim), dtype=np.float32))
    if rp.get("rope_type") == "longrope":
        w.add_tensor("rope_factors_long.weight", np.array(rp["long_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(rp["short_factor"], dtype=np.float32))
