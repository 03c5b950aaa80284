"""benchmarks/serving/real_sizes.py's phi-4-mini (phi3) and smollm3-3b shapes (issue 36's per-family rows): the
random file names every tensor as llama.cpp's own table does for the architecture (`gguf.MODEL_TENSORS`, which its
loader looks up), with the sizes its loader asks for (phi3: q, k, v in one attn_qkv, gate and up in one ffn_up),
and pagedllm reads it back as the shape: Phi-4-mini's 3/4 rotary head and longrope, SmolLM3's NoPE layers."""

from __future__ import annotations

import dataclasses

import gguf
import pytest

from benchmarks.serving import real_sizes
from pagedllm.model import load_model_config

pytestmark = pytest.mark.usefixtures("one_thread", "private_tokenizer_cache")  # tests/conftest.py


def _tiny(name: str) -> real_sizes.Shape:
    """The shape at a test's size: four layers, SmolLM2's vocabulary (the file's tokenizer), heads of 64."""
    s = real_sizes.SHAPES[name]
    rotary = 48 if s.rotary_dim else 0  # Phi-4-mini's 3/4 of the head
    return dataclasses.replace(
        s, hidden=256, layers=4, heads=4, kv_heads=2, ffn=512, vocab=49152, head_dim=64, rotary_dim=rotary
    )


def _llamacpp_names(arch: str, layers: int) -> set[str]:
    """Every tensor name llama.cpp knows for the architecture, per layer."""
    kinds = gguf.MODEL_TENSORS[next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)]
    names = {gguf.TENSOR_NAMES[k] for k in kinds}
    return {n.format(bid=i) + ".weight" for n in names for i in range(layers)}


@pytest.fixture(scope="module", params=["phi-4-mini", "smollm3-3b"])
def written(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    shape = _tiny(request.param)
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(real_sizes.SHAPES, "tiny", shape)
        path = str(root / "random.gguf")
        real_sizes.write_random("tiny", path, "F16", folder=str(root))
    return path, shape


def test_every_tensor_is_one_llamacpp_names_for_the_architecture(written):
    path, shape = written
    tensors = {t.name: tuple(int(d) for d in reversed(t.shape)) for t in gguf.GGUFReader(path).tensors}
    assert set(tensors) <= _llamacpp_names(shape.arch, shape.layers)
    if shape.arch == "phi3":  # llama.cpp's phi3 loader: {n_embd, n_embd + 2 n_embd_gqa} and {n_embd, 2 n_ff}
        assert tensors["blk.0.attn_qkv.weight"] == ((4 + 2 * 2) * 64, 256)
        assert tensors["blk.0.ffn_up.weight"] == (2 * 512, 256)
        assert tensors["rope_factors_long.weight"] == (24,)
    assert "output.weight" not in tensors  # both tie the head to the embedding


def test_pagedllm_reads_the_file_back_as_the_shape(written):
    path, shape = written
    cfg = load_model_config(path)
    assert (cfg.family, cfg.num_layers, cfg.hidden_size, cfg.intermediate_size) == (
        shape.arch,
        shape.layers,
        shape.hidden,
        shape.ffn,
    )
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.tie_word_embeddings) == (4, 2, 64, True)
    if shape.arch == "phi3":
        assert cfg.partial_rotary_factor == 0.75
        assert cfg.rope_scaling is not None and cfg.rope_scaling["rope_type"] == "longrope"
        assert cfg.rope_scaling["short_factor"] == [1.0] * 24
    else:
        assert cfg.no_rope_layers == [1, 1, 1, 0]


def test_use_more_bits_names_the_layers_llamacpp_keeps_in_q6_k():
    """The layers of a 32-layer model whose ffn_down and attn_qkv llama.cpp 0.3.36's quantizer wrote in Q6_K
    (read from its log quantizing the phi-4-mini file to Q4_K_M, 2026-12-02)."""
    q6 = {0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31}
    assert {i for i in range(32) if real_sizes._use_more_bits(i, 32)} == q6


def test_a_mix_source_holds_each_matrix_in_the_mix_type_as_blocks_that_decode(tmp_path, monkeypatch):
    """`Q4_K_M-mix` (no llama.cpp file in the folder to copy blocks from): every matrix in llama.cpp's type for it,
    its synthesized K-quant blocks laid out as ggml's (the gguf package dequantizes them to small finite values)."""
    shape = dataclasses.replace(
        real_sizes.SHAPES["llama-3.1-8b"], hidden=256, layers=8, heads=4, kv_heads=2, ffn=512, vocab=49152
    )
    monkeypatch.setitem(real_sizes.SHAPES, "tiny", shape)
    path = str(tmp_path / "mix.gguf")
    real_sizes.write_random("tiny", path, "Q4_K_M-mix", folder=str(tmp_path))
    types = {}
    for t in gguf.GGUFReader(path).tensors:
        if len(t.shape) < 2:
            continue
        types[t.name] = t.tensor_type.name
        values = gguf.quants.dequantize(t.data, t.tensor_type)
        assert values.size and abs(values).max() < 1 and bool((values == values).all())
    assert types["output.weight"] == "Q6_K" and types["token_embd.weight"] == "Q4_K"
    assert {i for i in range(8) if types[f"blk.{i}.ffn_down.weight"] == "Q6_K"} == {0, 3, 6, 7}
    assert {i for i in range(8) if types[f"blk.{i}.attn_v.weight"] == "Q6_K"} == {0, 3, 6, 7}
    assert {types[f"blk.{i}.{m}.weight"] for i in range(8) for m in ("attn_q", "ffn_gate", "ffn_up")} == {"Q4_K"}
