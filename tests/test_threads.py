"""The fused C step on two threads computes what it computes on one, bit for bit.

`make test` runs the suite in one worker per core, each on one thread (tests/conftest.py), so that the workers do
not spin-wait against each other; the C kernels split a step's work by the thread count they are given (columns of
each matmul, attention and recurrence items, experts), so this module is where their split runs: the default
model (real sizes: 135M, every matmul split) and a tiny Qwen3.5-MoE GGUF kept as Q8_0 (Gated DeltaNet recurrence,
the routed experts, full attention), each prefilled in two chunks and decoded on 1 and on 2 threads.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import torch

from devkit.hybrid_gguf import make_hybrid, write_hybrid_gguf
from pagedllm.model import ModelRunner, SeqChunk, load_model

pytestmark = pytest.mark.usefixtures("private_tokenizer_cache")


@pytest.fixture
def threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _logits(loaded, ids: list[int], n_threads: int) -> torch.Tensor:
    """Every new token's logits: `ids` in two chunks over shuffled blocks, then four decode steps, on `n_threads`."""
    torch.set_num_threads(n_threads)
    runner = ModelRunner(loaded, num_blocks=16, block_size=16, num_state_slots=2)
    assert runner.fused is not None, "the C step must run this model"
    table = random.Random(5).sample(range(16), 16)
    cut, rows = len(ids) // 2, []
    for start, chunk in ((0, ids[:cut]), (cut, ids[cut:])):
        rows.append(runner.execute([SeqChunk(chunk, start, table, True, state_slot=1)]))
    for _ in range(4):
        token = int(rows[-1][-1].argmax())
        ids = ids + [token]
        rows.append(runner.execute([SeqChunk([token], len(ids) - 1, table, state_slot=1)]))
    return torch.cat(rows)


def _two_against_one(loaded, ids: list[int]) -> None:
    one, two = _logits(loaded, ids, 1), _logits(loaded, ids, 2)
    assert torch.equal(one, two), (one - two).abs().max().item()


@pytest.mark.slow
def test_the_default_model_on_two_threads_is_bit_identical(model_fp32, threads):
    ids = random.Random(1).sample(range(100, 40000), 90)
    _two_against_one(model_fp32, ids)


def test_a_hybrid_moe_file_on_two_threads_is_bit_identical(tmp_path, threads):
    folder, path = str(tmp_path / "hf"), str(tmp_path / "tiny.q8_0.gguf")
    make_hybrid("qwen3_5_moe", folder)
    write_hybrid_gguf(folder, "qwen3_5_moe", "q8_0", path)
    loaded = load_model(path, dtype="float32", verbose=False)
    ids = random.Random(2).sample(range(6, 256), 100)
    _two_against_one(loaded, ids)
