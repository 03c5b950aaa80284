"""What model tests share: tiny random Hugging Face checkpoints of each supported architecture, saved with a
word-level tokenizer so that load_model reads them as it reads a real folder."""

from __future__ import annotations

import torch

from devkit.tiny_tokenizer import save_tiny_tokenizer

VOCAB = 256


def make_tiny_hf(kind: str, folder: str):
    from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
    )
    if kind == "llama_gqa_tied":
        cfg = LlamaConfig(**common, tie_word_embeddings=True, max_position_embeddings=256)
    elif kind == "qwen2_bias":
        cfg = Qwen2Config(**common, max_position_embeddings=256, rope_theta=1e6)
    elif kind == "llama3_rope":
        cfg = LlamaConfig(
            **common,
            max_position_embeddings=512,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        )
    elif kind == "llama_linear_rope":
        cfg = LlamaConfig(**common, max_position_embeddings=256, rope_scaling={"rope_type": "linear", "factor": 2.0})
    elif kind == "mistral":
        cfg = MistralConfig(**common, max_position_embeddings=256, sliding_window=None)
    else:
        raise ValueError(kind)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    if kind == "qwen2_bias":  # random init leaves biases at zero: make them matter
        with torch.no_grad():
            for layer in hf.model.layers:
                for p in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    p.bias.normal_(0, 0.5)
    hf.save_pretrained(folder, safe_serialization=True)
    save_tiny_tokenizer(folder, VOCAB)
    return hf


def all_logits(runner, chunks):
    """float32 logits for every new token of each chunk: one [len(token_ids), vocab] tensor per chunk."""
    from dataclasses import replace

    out = runner.execute([replace(c, all_logits=True) for c in chunks])
    return list(out.split([len(c.token_ids) for c in chunks]))
