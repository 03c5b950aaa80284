"""LFM2-MoE against transformers in float32, on a tiny random checkpoint `save_pretrained` writes: short-conv and
attention layers, a dense first layer, then sparse blocks routed by sigmoid scores whose top k are chosen with a
learned bias per expert (drawn so that it changes the choice) and scaled. Logits over 100 tokens in chunks (the
conv state crosses chunk ends) and decodes; 32 greedy tokens through the engine with a prefix-cache hit, chunked
prefill and forced preemption."""

from __future__ import annotations

import random

import pytest
import torch
from engine_helpers import greedy_cached_chunked_preempted, hybrid_engine, shared_prefix_prompts

from devkit.tiny_tokenizer import save_tiny_tokenizer
from pagedllm.model import ModelRunner, SeqChunk, load_model

pytestmark = pytest.mark.usefixtures("one_thread", "private_tokenizer_cache")  # tests/conftest.py

TOL = 1e-4  # of the largest logit


def make_lfm2_moe(folder: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, Lfm2MoeConfig

    cfg = Lfm2MoeConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        layer_types=["conv", "full_attention", "conv", "conv"],
        num_dense_layers=1,
        num_experts=4,
        num_experts_per_tok=2,
        routed_scaling_factor=1.5,
        conv_L_cache=3,
        norm_eps=1e-5,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    cfg.architectures = ["Lfm2MoeForCausalLM"]
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.uniform_(0.7, 1.3) if name.endswith("norm.weight") else p.normal_(0, 0.2)
        for name, b in hf.named_buffers():
            if name.endswith("expert_bias"):
                b.uniform_(-0.3, 0.3)
    hf.save_pretrained(folder, safe_serialization=True)
    save_tiny_tokenizer(folder, 256)
    return hf


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("lfm2_moe"))
    hf = make_lfm2_moe(folder)
    return hf, load_model(folder, dtype="float32", verbose=False, quantized_activations="none")


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(6, 256) for _ in range(n)]


@torch.inference_mode()
def _hf_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0].float()


def test_config_and_logits_match_transformers(ckpt):
    hf, loaded = ckpt
    cfg = loaded.config
    assert cfg.linear_layers == [0, 2, 3] and cfg.recurrent_mixer == "short_conv"
    assert cfg.moe_router == "sigmoid" and cfg.mlp_only_layers == [0] and cfg.routed_scaling_factor == 1.5
    ids = _tokens(100, 1)
    want = _hf_logits(hf, ids)
    runner = ModelRunner(loaded, num_blocks=16, block_size=8, num_state_slots=2)
    table = random.Random(2).sample(range(16), 13)
    got = [
        runner.execute([SeqChunk(ids[:37], 0, table, True, state_slot=1)]),
        runner.execute([SeqChunk(ids[37:98], 37, table, True, state_slot=1)]),
    ]
    got += [runner.execute([SeqChunk(ids[p : p + 1], p, table, state_slot=1)]) for p in (98, 99)]
    err = (torch.cat(got) - want).abs().max().item() / want.abs().max().item()
    assert err < TOL, f"{err:.2e}"


def test_the_expert_bias_changes_the_choice(ckpt):
    """Without its learned bias the router picks other experts: transformers' logits move far past the tolerance,
    so the test above sees the bias."""
    import copy

    hf, _ = ckpt
    plain = copy.deepcopy(hf)
    for layer in plain.model.layers[1:]:
        layer.feed_forward.expert_bias.zero_()
    ids = _tokens(40, 3)
    a, b = _hf_logits(hf, ids), _hf_logits(plain, ids)
    assert (a - b).abs().max().item() > 100 * TOL * a.abs().max().item()


def test_greedy_tokens_with_caching_chunks_and_preemption_match_transformers(ckpt):
    """Three prompts at once, two sharing 256 tokens (the second starts from the first's conv-state checkpoint), 64
    tokens a step (the state crosses chunk ends), a cache that preempts (the state rebuilt from zeros): 32 greedy
    tokens each, transformers' own; every block and state slot back."""
    hf, loaded = ckpt
    prompts = shared_prefix_prompts(_tokens)
    tokens = greedy_cached_chunked_preempted(hybrid_engine(loaded, 16), prompts)
    for i, (p, t) in enumerate(zip(prompts, tokens)):
        assert t == _hf_logits(hf, p + t)[len(p) - 1 : -1].argmax(-1).tolist(), f"prompt {i}"


def test_the_fused_step_routes_by_sigmoid_scores_as_the_torch_path(tmp_path):
    """int8 weights on the fused C step (moe.c's experts, the router's sigmoid scores, the top k chosen with the
    bias, weights renormalised and scaled in C) against the torch path on the same weights: a prompt in two chunks
    then 8 greedy decodes, the same tokens, logits within the tolerance. The bias changes the choice on this
    checkpoint (test above), so a C router that ignored it would differ."""
    from model_helpers import fused_and_torch

    from pagedllm.model.fused_step import _model_blockers

    make_lfm2_moe(str(tmp_path))
    loaded = load_model(str(tmp_path), "float32", "cpu", False, "int8", quantized_activations="none")
    assert not _model_blockers(loaded.config)
    got = fused_and_torch(loaded, _tokens(70, 1), 29, 8)
    (fused, fused_tokens), (want, want_tokens) = got[True], got[False]
    assert fused_tokens == want_tokens
    assert (fused - want).abs().max().item() < TOL * want.abs().max().item()
