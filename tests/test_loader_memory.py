"""What loading a GGUF holds besides the weights (issue 27, item 4): each quantized weight is packed as soon as
its pieces are in, a dense matrix is dequantized a chunk of rows at a time, and the file's pages a tensor was
copied out of leave the process. Memory is counted (tracemalloc, the mapping's resident pages), never timed."""

from __future__ import annotations

import os
import tracemalloc

import numpy as np
import pytest
import torch

import pagedllm.model.weights as weights
from pagedllm.model.config import load_model_config
from pagedllm.model.formats.gguf_file import GGUFFile
from pagedllm.model.layers.decoder import CausalLM
from pagedllm.model.weights import DenseRows, assign_weights, iter_gguf

HIDDEN, LAYERS, HEADS, KV_HEADS, FFN, VOCAB = 64, 3, 4, 2, 128, 16001


def write_tiny_gguf(path: str, matrix_type: str = "Q8_0") -> None:
    """A 3-layer llama GGUF: matrices in `matrix_type`, the embedding table F32 (so it loads dense: F16 and BF16
    tables are kept as stored), no tokenizer (these tests load weights only)."""
    import gguf

    rng = np.random.default_rng(0)
    qtype = gguf.GGMLQuantizationType[matrix_type]
    w = gguf.GGUFWriter(path, "llama")
    for key, value in (("block_count", LAYERS), ("context_length", 256), ("embedding_length", HIDDEN)):
        w.add_uint32(f"llama.{key}", value)
    w.add_uint32("llama.feed_forward_length", FFN)
    w.add_uint32("llama.attention.head_count", HEADS)
    w.add_uint32("llama.attention.head_count_kv", KV_HEADS)
    w.add_uint32("llama.vocab_size", VOCAB)
    w.add_tensor("token_embd.weight", rng.standard_normal((VOCAB, HIDDEN), dtype=np.float32))
    kv = HIDDEN // HEADS * KV_HEADS
    shapes = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (kv, HIDDEN), "attn_v": (kv, HIDDEN)}
    shapes |= {"attn_output": (HIDDEN, HIDDEN), "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN)}
    shapes |= {"ffn_down": (HIDDEN, FFN)}
    for i in range(LAYERS):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(HIDDEN, np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(HIDDEN, np.float32))
        for name, shape in shapes.items():
            m = gguf.quants.quantize(rng.standard_normal(shape, dtype=np.float32), qtype)
            w.add_tensor(f"blk.{i}.{name}.weight", m, raw_dtype=qtype)
    w.add_tensor("output_norm.weight", np.ones(HIDDEN, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("gguf") / "tiny.gguf")
    write_tiny_gguf(path)
    return path


def test_each_weight_is_packed_as_soon_as_its_pieces_are_in(tiny_gguf):
    """While the file is read, the weights already read are packed (their plain form let go): at the last
    tensor every quantized weight but the one it belongs to is in. Packing them all at the end held the whole
    model's plain form (2x a Q4 file) at once."""
    cfg = load_model_config(tiny_gguf)
    net = CausalLM(cfg, torch.float32, "cpu")
    installed = []
    with GGUFFile(tiny_gguf) as gf:

        def spy():
            for item in iter_gguf(gf, net, keep_quantized=True):
                installed.append(len(net.quant_weights()))
                yield item

        assign_weights(net, spy(), tiny_gguf)
    total = len(net.quant_weights())
    assert total == 4 * LAYERS
    assert installed[-1] >= total - 1 and installed == sorted(installed)


def test_a_dense_matrix_is_filled_a_chunk_of_rows_at_a_time(tiny_gguf, monkeypatch):
    """The F32 table, read in chunks that do not divide its rows, equals the whole-tensor dequantization;
    numpy never holds more than a chunk of it in float32."""
    full_bytes = VOCAB * HIDDEN * 4
    monkeypatch.setattr(weights, "CHUNK_BYTES", 37 * HIDDEN * 4)  # 37 rows: 16001 = 432 x 37 + 17
    with GGUFFile(tiny_gguf) as gf:
        want = torch.from_numpy(gf.load_array("token_embd.weight").copy())
        param = torch.empty(VOCAB, HIDDEN)
        tracemalloc.start()
        try:
            DenseRows(gf, "token_embd.weight", (VOCAB, HIDDEN)).copy_to(param)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert torch.equal(param, want)
    assert peak < full_bytes / 4


def test_a_bf16_model_loads_the_table_through_the_chunks(tiny_gguf, monkeypatch):
    """End to end through iter_gguf: the dense table arrives as DenseRows and lands rounded to the parameter's
    dtype, row for row."""
    monkeypatch.setattr(weights, "CHUNK_BYTES", 100 * HIDDEN * 4)
    cfg = load_model_config(tiny_gguf)
    net = CausalLM(cfg, torch.bfloat16, "cpu")
    with GGUFFile(tiny_gguf) as gf:
        kinds = {name: type(v).__name__ for name, v in iter_gguf(gf, net, keep_quantized=True)}
        assign_weights(net, iter_gguf(gf, net, keep_quantized=True), tiny_gguf)
        want = torch.from_numpy(gf.load_array("token_embd.weight").copy()).to(torch.bfloat16)
    assert kinds["model.embed_tokens.weight"] == "DenseRows"
    assert torch.equal(net.embed.weight, want)


def mapped_kib(path: str) -> int:
    """Resident KiB of this process's mappings of `path` (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps", encoding="utf-8") as f:
        for line in f:
            first = line.split()[0]
            if "-" in first and not first.endswith(":"):
                inside = line.rstrip().endswith(path)
            elif inside and first == "Rss:":
                total += int(line.split()[1])
    return total


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs Linux's /proc/self/smaps")
def test_the_pages_a_tensor_was_copied_from_leave_the_process(tmp_path):
    """After every tensor is read out, the file's mapping holds (almost) nothing resident: the pages stay in
    the page cache, not in the process as a second copy of the weights."""
    path = str(tmp_path / "tiny.gguf")
    write_tiny_gguf(path)
    size_kib = os.path.getsize(path) // 1024
    with GGUFFile(path) as gf:
        for name, info in gf.tensors.items():
            if len(info.shape) == 2 and info.ggml_type != 1:
                gf.load_raw(name)
            else:
                gf.load_array(name).copy()
        touched = mapped_kib(path)
    assert size_kib > 2000 and touched < size_kib / 10
