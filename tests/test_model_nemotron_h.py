"""Nemotron-H beyond what the hybrid families share (test_model_ssm.py runs its HF folder, test_model_hybrid_gguf.py
its GGUF files, the MoE variant's nemotron_h_moe among them): a Q8_0 file as llama.cpp's converter writes it, kept
quantized, on the fused C step through the engine (chunked prefill of 64, a KV cache small enough to preempt,
prefix caching): transformers' greedy tokens on the values the file holds, every block and state slot back; the
MoE variant's HF folder (Mamba2, MoE, attention and MLP layers; 8 ungated relu2 experts in 4 groups, the top 2
within the best 2 by score + correction bias, a shared expert; and with the experts' latent projections) against
transformers, and on the fused C step against the torch path; expert tensors that disagree with the config and
unknown pattern characters refused by name."""

from __future__ import annotations

import json
import os
import random
import shutil

import pytest
import torch
from engine_helpers import greedy_cached_chunked_preempted, hybrid_engine, run_all, shared_prefix_prompts
from model_helpers import chunked_logits_error, cpu_target, fused_and_torch

from devkit.hybrid_gguf import make_hybrid, write_hybrid_gguf
from pagedllm import SamplingParams
from pagedllm.engine import EngineConfig, LLMEngine
from pagedllm.engine.memory import state_bytes
from pagedllm.errors import ModelLoadError
from pagedllm.model import load_model, load_model_config
from pagedllm.model.kernels import cpu_kernel
from pagedllm.model.runner import bytes_per_block

pytestmark = pytest.mark.usefixtures("one_thread", "private_tokenizer_cache")  # tests/conftest.py

TOL = 1e-4  # of the largest logit
DOT_TOL = 2e-3  # the dot route's bound against the exact path (test_model_families.py's)
MOE_VARIANTS = {"grouped": "nemotron_h_moe", "latent": "nemotron_h_moe_latent"}  # devkit/hybrid_gguf.py's
TARGETS = [t for t in ("native", "x86-64-v3") if t in cpu_kernel.runnable_targets()]


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


@pytest.fixture(scope="module", params=list(MOE_VARIANTS))
def moe(request, tmp_path_factory) -> tuple[str, str, torch.nn.Module]:
    folder = str(tmp_path_factory.mktemp(request.param))
    return request.param, folder, make_hybrid(MOE_VARIANTS[request.param], folder)


@torch.inference_mode()
def _hf_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0].float()


def test_moe_folder_reads_its_sparse_blocks(moe):
    """The MoE layers are sparse single-block layers, the "-" layer the dense relu2 MLP, the router grouped."""
    variant, folder, _ = moe
    cfg = load_model_config(folder)
    assert cfg.layer_types == ["linear_attention", "mlp", "full_attention", "mlp", "mlp", "full_attention"]
    assert [i for i in range(cfg.num_layers) if cfg.is_moe_layer(i)] == [1, 4] and cfg.mlp_only_layers == [3]
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.num_expert_group, cfg.topk_group) == (8, 2, 4, 2)
    assert (cfg.moe_router, cfg.e_score_correction_bias, cfg.routed_scaling_factor) == ("sigmoid", True, 1.5)
    assert not cfg.mlp_gated and cfg.expert_activation == "relu2" and cfg.shared_expert_intermediate_size == 64
    assert cfg.moe_latent_size == (32 if variant == "latent" else 0)


def test_moe_folder_logits_match_transformers(moe):
    """110 tokens in chunks of 37 and 70 over shuffled blocks, then three decoded: every position's logits within
    float32 accuracy of transformers (a wrong group, bias, scale or latent moves them by most of the largest)."""
    variant, folder, hf = moe
    loaded = load_model(folder, dtype="float32", verbose=False, quantized_activations="none")
    ids = _tokens(110, 1)
    want = _hf_logits(hf, ids)
    err = chunked_logits_error(loaded, ids, want)
    assert err < TOL, f"{variant}: {err:.2e}"


def test_moe_folder_greedy_tokens_with_caching_chunks_and_preemption(moe):
    """Three prompts together, two sharing 256 tokens, 64 tokens a step, a cache that preempts: 32 greedy tokens
    each, transformers' own."""
    variant, folder, hf = moe
    loaded = load_model(folder, dtype="float32", verbose=False, quantized_activations="none")
    prompts = shared_prefix_prompts(_tokens)
    got = greedy_cached_chunked_preempted(hybrid_engine(loaded, 16), prompts)
    for i, (p, tokens) in enumerate(zip(prompts, got, strict=True)):
        assert tokens == _hf_logits(hf, p + tokens)[len(p) - 1 : -1].argmax(-1).tolist(), f"{variant} prompt {i}"


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("activations", ["none", "int16"])
def test_moe_on_the_fused_step_computes_what_the_torch_path_does(moe, activations, target):
    """int8 weights: the fused C step (moe.c's ungated relu2 experts, model_step.c's grouped router, the ungated
    shared expert; the latent variant's two projections around the routed experts) against the torch path, float32
    activations and the dot route's alike, on this CPU's build and the AVX2 one: a prompt in two chunks, 8 greedy
    decode tokens, the same tokens and logits within the bound of each."""
    variant, folder, _ = moe
    loaded = load_model(folder, "float32", "cpu", False, "int8", quantized_activations=activations)
    with cpu_target(target):
        got = fused_and_torch(loaded, _tokens(70, 1), 29, 8)
    (fused, fused_tokens), (want, want_tokens) = got[True], got[False]
    assert fused_tokens == want_tokens, f"{variant} {activations} {target}"
    err = (fused - want).abs().max().item() / want.abs().max().item()
    assert err < (TOL if activations == "none" else DOT_TOL), f"{variant} {activations} {target}: {err:.2e}"


def test_moe_expert_tensors_that_disagree_with_the_config_are_named(moe, tmp_path):
    """A config whose experts are wider than the checkpoint's: a ModelLoadError naming the expert's tensor."""
    _, folder, _ = moe
    bad = str(tmp_path / "bad")
    shutil.copytree(folder, bad)
    path = os.path.join(bad, "config.json")
    raw = json.load(open(path))
    json.dump(raw | {"moe_intermediate_size": 64}, open(path, "w"))
    with pytest.raises(ModelLoadError, match=r"mixer\.experts\.0\.(up|down)_proj\.weight has shape"):
        load_model(bad, dtype="float32", verbose=False)


def test_moe_config_without_dense_mlp_layers_needs_no_mlp_size(tmp_path):
    """Nemotron-3-Nano's pattern has no "-" layer: a config of Mamba2, MoE and attention layers without an
    intermediate_size reads (its Mamba2 and attention layers have no MLP to size), and one with an MLP layer and no
    size is named."""
    folder = str(tmp_path / "hf")
    make_hybrid("nemotron_h_moe", folder)
    path = os.path.join(folder, "config.json")
    raw = json.load(open(path))
    raw.pop("intermediate_size")
    json.dump(raw | {"layers_block_type": ["linear_attention", "moe", "full_attention", "moe"]}, open(path, "w"))
    cfg = load_model_config(folder)
    assert [i for i in range(4) if cfg.is_moe_layer(i)] == [1, 3] and not cfg.mlp_only_layers
    json.dump(raw | {"layers_block_type": ["linear_attention", "moe", "mlp", "moe"]}, open(path, "w"))
    with pytest.raises(ModelLoadError, match="dense layer 2 but no intermediate_size"):
        load_model_config(folder)
