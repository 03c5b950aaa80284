"""Gemma 4 text as a tiny random HF checkpoint and as the GGUF llama.cpp's converter writes from it (Gemma4Model:
arch gemma4), for tests/test_model_gemma4.py and benchmarks/serving/family_parity_llamacpp.py.

The checkpoint: six layers, sliding (a window of 8) and full in Gemma's pattern, the last two reading the KV of
the last earlier layer of their kind (num_kv_shared_layers) with MLPs twice as wide, full layers with their own
head size and KV heads, keys equal to values there (attention_k_eq_v) and proportional RoPE, per-layer input
embeddings, a learned scalar per layer and the final logit soft-cap; MOE adds the sparse block beside every MLP."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from devkit.family_helpers import _decode, _encode, _tokenizer_metadata, save_tokenizer

WINDOW = 8
TYPES = ["sliding_attention", "sliding_attention", "full_attention"] * 2
CONFIG: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    global_head_dim=32,
    num_global_key_value_heads=2,
    attention_k_eq_v=True,
    num_kv_shared_layers=2,
    use_double_wide_mlp=True,
    hidden_size_per_layer_input=8,
    vocab_size_per_layer_input=256,
    sliding_window=WINDOW,
    final_logit_softcapping=30.0,
    layer_types=TYPES,
    max_position_embeddings=4096,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
# the 26B-A4B's sparse block in small: 4 experts, 2 routed, beside each layer's dense MLP
MOE: dict[str, Any] = dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32)


def make_gemma4(folder: str, int8_grid: bool = False, **overrides: Any) -> Any:
    """A tiny random Gemma 4 saved in `folder`; norms around 1 (Gemma 4's norms have no 1 + w), layer scalars
    drawn away from 1, so every piece changes the logits. `int8_grid`: every matrix --quantization int8 quantizes
    (all but the router's, which stays float) rounded as it rounds them (quantize_rtn), so that it holds them
    exactly and transformers runs the very weights the quantized model runs."""
    import torch
    from transformers import AutoModelForCausalLM, Gemma4TextConfig

    from pagedllm.model.kernels.quant_linear import quantize_rtn

    cfg = Gemma4TextConfig(**(CONFIG | overrides))
    cfg.architectures = ["Gemma4ForCausalLM"]
    with torch.no_grad():
        hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
        g = torch.Generator().manual_seed(0)
        for name, p in hf.named_parameters():
            centre = 1.0 if name.endswith(("norm.weight", "scale")) else 0.0  # router.scale, router.per_expert_scale
            p.copy_(centre + 0.25 * torch.randn(p.shape, generator=g))
            if int8_grid and p.dim() >= 2 and not name.endswith("router.proj.weight"):  # 3-D experts: rows of K
                p.copy_(quantize_rtn(p.reshape(-1, p.shape[-1]), 8).dequantize().reshape(p.shape))
        for layer in hf.model.layers:
            layer.layer_scalar.fill_(0.5 + torch.rand(1, generator=g).item())
        hf.save_pretrained(folder, safe_serialization=True)
    save_tokenizer(folder)
    return hf


def write_gemma4_gguf(
    folder: str, fmt: str, path: str, merges: list[str] | None = None, **overrides: Any
) -> dict[str, Any]:
    """The tiny checkpoint (made with `overrides`) as llama.cpp's converter writes a gemma4 GGUF (its
    Gemma4Model): per-layer sliding flags, KV heads and ffn sizes, the full layers' head size in key_length,
    rope_freqs factors for the proportional RoPE (1e30 where a frequency does not turn), layer_scalar as
    layer_output_scale.weight, norms as stored (no 1 + w to fold); the sparse block's 3-D experts as
    ffn_gate_up_exps / ffn_down_exps, the router's scale as ffn_gate_inp.scale and the per-expert scales as
    ffn_down_exps.scale, the router in F32; matrices in `fmt`, the rest F32; `merges`: BPE merges for the file's
    tokenizer (llama.cpp needs one). Returns the HF state dict of the file's values (torch tensors)."""
    import gguf
    import torch
    from safetensors import safe_open

    c = CONFIG | overrides
    layers, swa = c["num_hidden_layers"], [t == "sliding_attention" for t in c["layer_types"]]
    first_shared = layers - c["num_kv_shared_layers"]
    w = gguf.GGUFWriter(path, "gemma4")
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_block_count(layers)
    w.add_feed_forward_length([c["intermediate_size"] * (1 + (i >= first_shared)) for i in range(layers)])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv([c["num_key_value_heads"] if s else c["num_global_key_value_heads"] for s in swa])
    w.add_layer_norm_rms_eps(1e-6)
    w.add_key_length(c["global_head_dim"])
    w.add_value_length(c["global_head_dim"])
    w.add_key_length_swa(c["head_dim"])
    w.add_value_length_swa(c["head_dim"])
    w.add_rope_dimension_count(c["global_head_dim"])
    w.add_rope_dimension_count_swa(c["head_dim"])
    w.add_rope_freq_base(1_000_000.0)
    w.add_rope_freq_base_swa(10_000.0)
    w.add_sliding_window(WINDOW)
    w.add_final_logit_softcapping(c["final_logit_softcapping"])
    w.add_shared_kv_layers(c["num_kv_shared_layers"])
    w.add_embedding_length_per_layer_input(c["hidden_size_per_layer_input"])
    w.add_sliding_window_pattern(swa)
    if c.get("enable_moe_block"):
        w.add_expert_count(c["num_experts"])
        w.add_expert_used_count(c["top_k_experts"])
        w.add_expert_feed_forward_length(c["moe_intermediate_size"])
    _tokenizer_metadata(w, merges or [])
    turning = int(c["global_head_dim"] * 0.25 / 2)
    factors = [1.0] * turning + [1e30] * (c["global_head_dim"] // 2 - turning)
    w.add_tensor("rope_freqs.weight", np.array(factors, dtype=np.float32))
    tmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA4, layers)
    target = gguf.GGMLQuantizationType[fmt.upper()]
    out: dict[str, torch.Tensor] = {}
    with safe_open(os.path.join(folder, "model.safetensors"), framework="pt") as st:
        for hf_name in st.keys():
            t = st.get_tensor(hf_name).float()
            bid = hf_name.split(".")[2] if hf_name.startswith("model.layers.") else ""
            bare = hf_name.endswith("layer_scalar") or ".experts." in hf_name  # the converter adds `.weight`
            scales = {"router.scale": "ffn_gate_inp.scale", "router.per_expert_scale": "ffn_down_exps.scale"}
            scale = next((v for k, v in scales.items() if hf_name.endswith(k)), None)
            new = f"blk.{bid}.{scale}" if scale else tmap.get_name(hf_name + (".weight" if bare else ""), (".weight",))
            assert new is not None, hf_name
            whole_blocks = t.dim() >= 2 and t.shape[-1] % 32 == 0  # else llama.cpp's converter keeps it wider
            router = new.endswith("ffn_gate_inp.weight")  # forced F32 by the converter
            qtype = target if whole_blocks and not router else gguf.GGMLQuantizationType.F32
            data = _encode(t.numpy(), qtype)
            w.add_tensor(new, data, raw_dtype=qtype)
            out[hf_name] = torch.from_numpy(_decode(data, qtype, tuple(t.shape)).copy()).reshape(t.shape)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
