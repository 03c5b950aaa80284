"""The hybrid families from GGUF files written as llama.cpp's converter writes them (devkit/hybrid_gguf.py: its
qwen35, qwen35moe, qwen3next, granitehybrid, lfm2moe, nemotron_h and nemotron_h_moe layouts (the latter's grouped
router, ungated experts and latent projections too), norms stored as 1 + w, A as -exp(A_log),
Qwen3.5's value heads tiled, Qwen3-Next's in_proj_qkvz split, Granite's Q/K permuted and Mamba2 norm grouped,
LFM2-MoE's expert bias as exp_probs_b) against transformers on the HF checkpoint each came from: the config read
from the file is the folder's, logits over 100 tokens in chunks and decodes within float32 accuracy, 32 greedy
tokens through the engine with a prefix-cache hit, chunked prefill and forced preemption; Q8_0 and Q4_0 files,
kept quantized, against transformers on the values the file holds."""

from __future__ import annotations

import os
import random
import shutil

import pytest
import torch
from engine_helpers import greedy_cached_chunked_preempted, hybrid_engine, shared_prefix_prompts

from devkit.hybrid_gguf import CONFIGS, make_hybrid, write_hybrid_gguf
from pagedllm.model import ModelRunner, SeqChunk, load_model, load_model_config
from pagedllm.model.fused_step import unfused_reason

pytestmark = pytest.mark.usefixtures("one_thread", "private_tokenizer_cache")  # tests/conftest.py

TOL = 1e-4  # of the largest logit
FAMILIES = list(CONFIGS)
_CONFIG_KEYS = [
    "layer_types",
    "num_kv_heads",
    "head_dim",
    "partial_rotary_factor",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
    "recurrent_mixer",
    "mamba_num_heads",
    "mamba_head_dim",
    "mamba_state_size",
    "mamba_num_groups",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "intermediate_size",
    "no_rope_layers",
    "embedding_multiplier",
    "residual_multiplier",
    "logits_divisor",
    "moe_router",
    "e_score_correction_bias",
    "routed_scaling_factor",
    "num_expert_group",
    "topk_group",
    "moe_latent_size",
    "mlp_only_layers",
    "single_block_layers",
    "mlp_gated",
    "hidden_act",
    "mamba_dt_limit",
]


class Checkpoint:
    def __init__(self, family: str, root: str) -> None:
        self.family, self.folder = family, os.path.join(root, "hf")
        self.hf = make_hybrid(family, self.folder)
        self.path = os.path.join(root, f"tiny-{family}.f32.gguf")
        write_hybrid_gguf(self.folder, family, "f32", self.path)
        self.loaded = load_model(self.path, dtype="float32", verbose=False, quantized_activations="none")


@pytest.fixture(scope="module", params=FAMILIES)
def ckpt(request, tmp_path_factory) -> Checkpoint:
    return Checkpoint(request.param, str(tmp_path_factory.mktemp(request.param)))


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(6, 256) for _ in range(n)]


def _logits(loaded, ids: list[int], fused: bool = False) -> torch.Tensor:
    """100 tokens in chunks of 41 and 57 (the state crosses chunk ends) over shuffled blocks, then two decodes;
    on the fused C step where `fused` (it must run there), else on the path the runner takes."""
    runner = ModelRunner(loaded, num_blocks=16, block_size=8, num_state_slots=2)
    assert not fused or runner.fused is not None, unfused_reason(runner.model, runner.kv_caches, runner.states)
    table = random.Random(3).sample(range(16), 13)
    got = [
        runner.execute([SeqChunk(ids[:41], 0, table, True, state_slot=1)]),
        runner.execute([SeqChunk(ids[41:98], 41, table, True, state_slot=1)]),
    ]
    got += [runner.execute([SeqChunk(ids[p : p + 1], p, table, state_slot=1)]) for p in (98, 99)]
    return torch.cat(got)


@torch.inference_mode()
def _hf_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0].float()


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    return (got - want).abs().max().item() / want.abs().max().item()


def test_f32_file_reads_the_folders_config_and_matches_transformers(ckpt):
    a, b = load_model_config(ckpt.folder), load_model_config(ckpt.path)
    assert {k: getattr(a, k) for k in _CONFIG_KEYS} == {k: getattr(b, k) for k in _CONFIG_KEYS}
    ids = _tokens(100, 1)
    err = _err(_logits(ckpt.loaded, ids), _hf_logits(ckpt.hf, ids))
    assert err < TOL, f"{ckpt.family}: {err:.2e}"


def test_greedy_tokens_with_caching_chunks_and_preemption_match_transformers(ckpt):
    """Three prompts of 258 to 300 tokens together, two sharing 256 (a prefix-cache hit from the first's state
    checkpoint), 64 tokens a step (the state crosses chunk ends), a cache of 16 blocks of 32 (or the state slots'
    worth) that preempts (the state rebuilt from zeros): 32 greedy tokens each, transformers' own."""
    prompts = shared_prefix_prompts(_tokens)
    got = greedy_cached_chunked_preempted(hybrid_engine(ckpt.loaded, 16), prompts)
    for i, (p, tokens) in enumerate(zip(prompts, got)):
        want = _hf_logits(ckpt.hf, p + tokens)[len(p) - 1 : -1].argmax(-1).tolist()
        assert tokens == want, f"{ckpt.family} prompt {i}"


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
def test_quantized_file_runs_as_stored_and_matches_its_values(ckpt, fmt, tmp_path):
    """A Q8_0 / Q4_0 file, its matrices kept quantized, on the fused C step: transformers on the values the file
    holds (each tensor quantized in its HF layout: every converter change moves whole rows or blocks) gives the
    same logits."""
    from safetensors.numpy import save_file
    from transformers import AutoModelForCausalLM

    path = str(tmp_path / f"tiny-{ckpt.family}.{fmt}.gguf")
    ref_dir = str(tmp_path / "ref")
    shutil.copytree(ckpt.folder, ref_dir, ignore=shutil.ignore_patterns("*.safetensors"))
    save_file(write_hybrid_gguf(ckpt.folder, ckpt.family, fmt, path), os.path.join(ref_dir, "model.safetensors"))
    ref = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()
    loaded = load_model(path, dtype="float32", verbose=False, quantization="gguf", quantized_activations="none")
    assert any(lin.quant is not None for lin in loaded.model.linears())
    ids = _tokens(100, 2)
    err = _err(_logits(loaded, ids, fused=True), _hf_logits(ref, ids))
    assert err < TOL, f"{ckpt.family} {fmt}: {err:.2e}"


def test_a_missing_key_or_tensor_is_named(tmp_path, monkeypatch):
    """A qwen35 file without its ssm.time_step_rank key, and one without a layer's ssm_a: a ModelLoadError naming
    each, not a crash or a model of another shape."""
    import gguf

    from pagedllm.errors import ModelLoadError

    folder = str(tmp_path / "hf")
    make_hybrid("qwen3_5", folder)
    no_key = str(tmp_path / "no-key.gguf")
    with monkeypatch.context() as m:
        m.setattr(gguf.GGUFWriter, "add_ssm_time_step_rank", lambda self, value: None)
        write_hybrid_gguf(folder, "qwen3_5", "f32", no_key)
    with pytest.raises(ModelLoadError, match=r"qwen35\.ssm\.time_step_rank"):
        load_model_config(no_key)
    no_tensor = str(tmp_path / "no-tensor.gguf")
    add_tensor = gguf.GGUFWriter.add_tensor
    with monkeypatch.context() as m:
        m.setattr(
            gguf.GGUFWriter,
            "add_tensor",
            lambda self, name, *a, **kw: None if name == "blk.1.ssm_a" else add_tensor(self, name, *a, **kw),
        )
        write_hybrid_gguf(folder, "qwen3_5", "f32", no_tensor)
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.linear_attn\.A_log"):
        load_model(no_tensor, dtype="float32", verbose=False)
