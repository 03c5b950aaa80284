"""Nemotron-H beyond what the hybrid families share (test_model_ssm.py runs its HF folder, test_model_hybrid_gguf.py
its GGUF files): a Q8_0 file as llama.cpp's converter writes it, kept quantized, on the fused C step through the
engine (chunked prefill of 64, a KV cache small enough to preempt, prefix caching): transformers' greedy tokens on
the values the file holds, every block and state slot back; and config.json's MoE blocks and unknown pattern
characters refused by name."""

from __future__ import annotations

import json
import os
import random
import shutil

import pytest
import torch
from engine_helpers import run_all

from devkit.hybrid_gguf import make_hybrid, write_hybrid_gguf
from pagedllm import SamplingParams
from pagedllm.engine import EngineConfig, LLMEngine
from pagedllm.engine.memory import state_bytes
from pagedllm.errors import ModelLoadError
from pagedllm.model import load_model, load_model_config
from pagedllm.model.runner import bytes_per_block

pytestmark = pytest.mark.usefixtures("one_thread", "private_tokenizer_cache")  # tests/conftest.py


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(6, 256) for _ in range(n)]


def test_q8_0_file_on_the_fused_step_gives_transformers_tokens(tmp_path):
    """Three ~100-token prompts sharing 64 tokens, 64 tokens a step, blocks for fewer than all three at once: the
    fused step runs (every matmul Q8_0, the MLP layers' relu2 and the single-block plan), requests are preempted
    and later ones hit the prefix cache; 32 greedy tokens each are transformers' on the file's values."""
    from safetensors.numpy import save_file
    from transformers import AutoModelForCausalLM

    folder, ref_dir, path = str(tmp_path / "hf"), str(tmp_path / "ref"), str(tmp_path / "tiny.q8_0.gguf")
    make_hybrid("nemotron_h", folder)
    shutil.copytree(folder, ref_dir, ignore=shutil.ignore_patterns("*.safetensors"))
    save_file(write_hybrid_gguf(folder, "nemotron_h", "q8_0", path), os.path.join(ref_dir, "model.safetensors"))
    ref = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()
    loaded = load_model(path, dtype="float32", verbose=False, quantization="gguf", quantized_activations="none")
    cfg = loaded.config
    seqs = 3
    slots = seqs * 2 * state_bytes(cfg, torch.float32)  # two states per request: 30 blocks' bytes
    assert slots // bytes_per_block(cfg, 8, "float32", cfg.kv_layout(hybrid=True)) == 30
    engine = LLMEngine(
        EngineConfig(
            block_size=8,
            max_num_batched_tokens=64,
            max_num_seqs=seqs,
            kv_cache_memory=slots + slots // 2,  # the 3 slots, and 30 blocks (checkpoints are pool blocks)
            max_model_len=256,
            enable_prefix_caching=True,
            log_stats_interval=0,
        ),
        loaded,
    )
    assert engine.runner.fused is not None
    shared = _tokens(64, 7)
    prompts = [shared + _tokens(40, 8), shared + _tokens(30, 9), shared + _tokens(36, 10)]
    outs = run_all(engine, prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    stats = engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits >= 64
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    assert engine.kv.recurrent.slots is not None and engine.kv.recurrent.slots.num_free == seqs
    for i, (p, out) in enumerate(zip(prompts, outs, strict=True)):
        tokens = list(out)
        with torch.inference_mode():
            want = ref(torch.tensor([p + tokens])).logits[0, len(p) - 1 : -1].argmax(-1).tolist()
        assert tokens == want, f"prompt {i}"


def test_unknown_pattern_characters_are_named(tmp_path):
    """A config whose pattern has a character that is no layer kind: a ModelLoadError naming it, not a model of
    another shape."""
    folder = str(tmp_path / "hf")
    make_hybrid("nemotron_h", folder)
    path = os.path.join(folder, "config.json")
    raw = json.load(open(path))
    raw.pop("layers_block_type")
    json.dump(raw | {"hybrid_override_pattern": "M*X-"}, open(path, "w"))
    with pytest.raises(ModelLoadError, match=r"hybrid_override_pattern has 'X'"):
        load_model_config(folder)
