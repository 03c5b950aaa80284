"""benchmarks/serving/real_sizes.py's qwen35 shape (issue 35's speed file) names, shapes and describes its tensors
as devkit/hybrid_gguf.py (llama.cpp's converter) writes a Qwen3.5 checkpoint of the same config: the random file
is read by llama.cpp and pagedllm exactly as a converted one, and pagedllm reads its config back as the shape's."""

from __future__ import annotations

import dataclasses
import json
import os

import gguf
import pytest

from benchmarks.serving import real_sizes
from devkit.hybrid_gguf import make_hybrid, write_hybrid_gguf
from pagedllm.model import load_model_config

pytestmark = pytest.mark.usefixtures("one_thread", "private_tokenizer_cache")  # tests/conftest.py


def _tensors(path: str) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape, rows first (GGUF stores its dimensions innermost first)."""
    return {t.name: tuple(int(d) for d in reversed(t.shape)) for t in gguf.GGUFReader(path).tensors}


def _arch_keys(path: str, arch: str) -> dict[str, object]:
    out: dict[str, object] = {}
    for key, field in gguf.GGUFReader(path).fields.items():
        if key.startswith(arch + ".") and not key.endswith("context_length"):
            value = field.contents()
            out[key] = [round(float(v), 6) for v in value] if isinstance(value, list) else round(float(value), 6)
    return out


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """The tiny Qwen3.5 checkpoint converted by the devkit writer, and real_sizes' random file of its shape."""
    root = tmp_path_factory.mktemp("qwen35")
    folder = str(root / "hf")
    make_hybrid("qwen3_5", folder)
    converted = str(root / "converted.gguf")
    write_hybrid_gguf(folder, "qwen3_5", "f32", converted)
    with open(os.path.join(folder, "config.json")) as f:
        cfg = json.load(f)
    rp = cfg["rope_parameters"]
    shape = real_sizes.Shape(
        "qwen35",
        cfg["hidden_size"],
        cfg["num_hidden_layers"],
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
        cfg["intermediate_size"],
        cfg["vocab_size"],
        bool(cfg.get("tie_word_embeddings")),
        rp["rope_theta"],
        cfg["rms_norm_eps"],
        cfg["head_dim"],
        linear_key_heads=cfg["linear_num_key_heads"],
        linear_value_heads=cfg["linear_num_value_heads"],
        linear_head_dim=cfg["linear_key_head_dim"],
    )
    assert cfg["linear_value_head_dim"] == shape.linear_head_dim and rp["mrope_section"] != [11, 11, 10]
    return converted, shape, root


def test_the_random_file_has_the_converted_files_tensors(written):
    converted, shape, _ = written
    assert dict(real_sizes.tensor_shapes(shape)) == _tensors(converted)


def test_the_random_file_has_the_converted_files_keys_and_reads_back_as_its_shape(written, monkeypatch):
    converted, shape, root = written
    # the file's tokenizer is SmolLM2's, padded to the vocabulary: at least its 49,152 tokens
    monkeypatch.setitem(real_sizes.SHAPES, "tiny-qwen35", dataclasses.replace(shape, vocab=49152))
    path = str(root / "random.gguf")
    real_sizes.write_random("tiny-qwen35", path, "F16", folder=str(root))
    ours, theirs = _arch_keys(path, "qwen35"), _arch_keys(converted, "qwen35")
    assert (ours.pop("qwen35.vocab_size"), theirs.pop("qwen35.vocab_size")) == (49152, shape.vocab)
    # the tiny checkpoint's RoPE sections are its own (fitting 4 turning dims); the real shape's Qwen3.5's
    theirs.pop("qwen35.rope.dimension_sections")
    assert ours.pop("qwen35.rope.dimension_sections") == [11, 11, 10, 0]
    assert {k: v for k, v in ours.items() if k in theirs} == theirs
    cfg = load_model_config(path)
    assert cfg.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert (cfg.linear_num_key_heads, cfg.linear_num_value_heads) == (shape.linear_key_heads, shape.linear_value_heads)
