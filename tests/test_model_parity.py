"""pagedllm's model vs transformers on tiny random checkpoints, in float32, through the paged KV cache.

Each checkpoint is saved with save_pretrained (safetensors) and loaded by both. Block ids are shuffled so that
block-table indexing bugs show; sequences are at different lengths; block sizes 16 and 8.
"""

from __future__ import annotations

import os
import random

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from model_helpers import VOCAB, make_tiny_hf

from pagedllm.model import ModelRunner, SeqChunk, load_model, load_model_config

TOL = 1e-4


KINDS = ["llama_gqa_tied", "qwen2_bias", "llama3_rope", "llama_linear_rope", "mistral"]


@pytest.fixture(scope="module", params=KINDS)
def pair(request, tmp_path_factory):
    folder = str(tmp_path_factory.mktemp(request.param))
    hf = make_tiny_hf(request.param, folder)
    ours = load_model(folder, dtype="float32", verbose=False)
    return request.param, hf, ours


@torch.inference_mode()
def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    return hf(torch.tensor([ids])).logits[0].float()


def _shuffled_blocks(n: int, seed: int) -> list[int]:
    ids = list(range(n))
    random.Random(seed).shuffle(ids)
    return ids


class _Alloc:
    """A trivial shuffled block allocator for the tests (the real one is pagedllm.kv's job)."""

    def __init__(self, num_blocks: int, seed: int = 0) -> None:
        self.free = _shuffled_blocks(num_blocks, seed)

    def take(self, n: int) -> list[int]:
        out, self.free = self.free[:n], self.free[n:]
        assert len(out) == n
        return out


def _blocks_for(n_tokens: int, bs: int) -> int:
    return -(-n_tokens // bs)


def test_config_is_read(pair):
    kind, hf, ours = pair
    cfg = ours.config
    assert cfg.num_kv_heads == 2 and cfg.num_heads == 4 and cfg.head_dim == 16
    assert cfg.tie_word_embeddings == (kind == "llama_gqa_tied")
    assert cfg.attention_bias == (kind == "qwen2_bias")
    if kind == "llama3_rope":
        assert cfg.rope_scaling and cfg.rope_scaling["rope_type"] == "llama3"
    assert ours.config == load_model_config(ours.path)


@pytest.mark.parametrize("block_size", [16, 8])
def test_batched_prefill_then_decode(pair, block_size):
    """3 prompts of different lengths prefilled together, then 16 decode steps, all vs full-sequence HF logits."""
    kind, hf, ours = pair
    rng = random.Random(1)
    lens = [5, 23, 40]
    n_dec = 16
    seqs = [[rng.randrange(3, VOCAB) for _ in range(n + n_dec)] for n in lens]
    refs = [_hf_logits(hf, s) for s in seqs]
    runner = ModelRunner(ours, num_blocks=64, block_size=block_size)
    alloc = _Alloc(64, seed=block_size)
    tables = [alloc.take(_blocks_for(n + n_dec, block_size)) for n in lens]
    out = runner.execute([SeqChunk(s[:n], 0, t) for s, n, t in zip(seqs, lens, tables)])
    assert out.shape == (3, VOCAB) and out.dtype == torch.float32
    for i, n in enumerate(lens):
        assert (out[i] - refs[i][n - 1]).abs().max().item() < TOL
    for step in range(n_dec):
        chunks = [SeqChunk([s[n + step]], n + step, t) for s, n, t in zip(seqs, lens, tables)]
        out = runner.execute(chunks)
        for i, n in enumerate(lens):
            err = (out[i] - refs[i][n + step]).abs().max().item()
            assert err < TOL, f"{kind} bs={block_size} step {step} seq {i}: {err}"


@pytest.mark.parametrize("block_size", [16, 8])
def test_prefix_cached_blocks(pair, block_size):
    """Request B reuses request A's first full blocks (filled earlier) and computes only the rest."""
    kind, hf, ours = pair
    rng = random.Random(2)
    shared = [rng.randrange(3, VOCAB) for _ in range(2 * block_size)]
    a = shared + [rng.randrange(3, VOCAB) for _ in range(7)]
    b = shared + [rng.randrange(3, VOCAB) for _ in range(11)]
    runner = ModelRunner(ours, num_blocks=32, block_size=block_size)
    alloc = _Alloc(32, seed=7)
    ta = alloc.take(_blocks_for(len(a), block_size))
    runner.execute([SeqChunk(a, 0, ta)])
    tb = ta[:2] + alloc.take(_blocks_for(len(b), block_size) - 2)
    got = runner.execute([SeqChunk(b[2 * block_size :], 2 * block_size, tb, all_logits=True)])
    ref = _hf_logits(hf, b)[2 * block_size :]
    assert (got - ref).abs().max().item() < TOL
    # and decode continues correctly on top of the shared blocks
    b2 = b + [5]
    got2 = runner.execute([SeqChunk([5], len(b), tb + alloc.take(1))])[0]
    assert (got2 - _hf_logits(hf, b2)[-1]).abs().max().item() < TOL


def test_chunked_prefill_mixed_with_decode(pair):
    """A prompt split across two steps, batched with another sequence's decode steps."""
    kind, hf, ours = pair
    bs = 8
    rng = random.Random(3)
    long = [rng.randrange(3, VOCAB) for _ in range(45)]
    other = [rng.randrange(3, VOCAB) for _ in range(12)]
    runner = ModelRunner(ours, num_blocks=40, block_size=bs)
    alloc = _Alloc(40, seed=3)
    tl = alloc.take(_blocks_for(len(long), bs))
    to = alloc.take(_blocks_for(len(other), bs))
    runner.execute([SeqChunk(other[:10], 0, to)])
    step1 = runner.execute([SeqChunk(long[:19], 0, tl, True), SeqChunk([other[10]], 10, to, True)]).split([19, 1])
    step2 = runner.execute([SeqChunk([other[11]], 11, to, True), SeqChunk(long[19:], 19, tl, True)]).split([1, 26])
    ref_l, ref_o = _hf_logits(hf, long), _hf_logits(hf, other)
    assert (torch.cat([step1[0], step2[1]]) - ref_l).abs().max().item() < TOL
    assert (step1[1][0] - ref_o[10]).abs().max().item() < TOL
    assert (step2[0][0] - ref_o[11]).abs().max().item() < TOL
    # execute returns the last row of each chunk
    last = runner.execute([SeqChunk([7], 45, tl)])
    assert (last[0] - _hf_logits(hf, long + [7])[-1]).abs().max().item() < TOL


def test_kv_cache_sizes(pair):
    kind, hf, ours = pair
    runner = ModelRunner(ours, num_blocks=10, block_size=16)
    cfg = ours.config
    expect = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4 * 16
    assert runner.bytes_per_block == expect
    assert runner.kv_cache_bytes() == 10 * expect
    assert sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in runner.kv_caches) == 10 * expect
    assert runner.kv_caches[0][0].shape == (10, 16, cfg.num_kv_heads, cfg.head_dim)
