"""A hybrid model's recurrent-state checkpoints are blocks of the KV pool (kv/state_slots.py), so the disk tier
(--kv-offload-dir) keeps them as any evicted block (each under its own key: hashing.checkpoint_key) and a lookup
whose KV hit ends where one lies reads its blocks back, so a shared prefix still hits after its state left RAM,
and after a restart; the state's bytes go through the blocks' memory unchanged whatever the cache's dtype (int8
and fp8 rows with their scales); answers equal caching off and transformers'."""

from __future__ import annotations

import random

import pytest
import torch
from model_helpers import assert_state_round_trip
from test_model_hybrid import make_hybrid

from pagedllm import SamplingParams
from pagedllm.engine import EngineConfig, LLMEngine
from pagedllm.engine.memory import state_bytes
from pagedllm.kv.connector import DiskTierConnector
from pagedllm.kv.hashing import hash_full_blocks
from pagedllm.kv.manager import PagedKVCacheManager, TokenRequest
from pagedllm.kv.offload import DiskKVTier
from pagedllm.kv.state_slots import StateCheckpoints, StateSlotPool
from pagedllm.model import load_model
from pagedllm.model.runner import bytes_per_block

pytestmark = pytest.mark.usefixtures("one_thread", "private_tokenizer_cache")  # tests/conftest.py

FP = bytes(32)
BS, BLOCK_BYTES, STATE_BYTES = 4, 256, 300


class PoolIO:
    """A model runner's block memory and state rows, in dicts (BlockIO, and the checkpoints' StateIO): a state of
    STATE_BYTES laid across blocks of BLOCK_BYTES."""

    def __init__(self) -> None:
        self.blocks: dict[int, bytes] = {}
        self.rows: dict[int, bytes] = {}

    def read_block(self, block_id: int) -> bytes:
        return self.blocks.get(block_id, bytes(BLOCK_BYTES))

    def write_block(self, block_id: int, data: bytes) -> None:
        self.blocks[block_id] = data

    def state_to_blocks(self, row: int, block_ids) -> None:
        data = self.rows[row].ljust(len(block_ids) * BLOCK_BYTES, b"\0")
        for i, b in enumerate(block_ids):
            self.blocks[b] = data[i * BLOCK_BYTES : (i + 1) * BLOCK_BYTES]

    def blocks_to_state(self, block_ids, row: int) -> None:
        self.rows[row] = b"".join(self.read_block(b) for b in block_ids)[:STATE_BYTES]


def _state(tag: int) -> bytes:
    return bytes([tag]) * STATE_BYTES


# ---- in the KV manager, without a model ------------------------------------------------------------------------
def test_an_evicted_checkpoint_is_read_back_from_disk_when_its_prefix_hits(tmp_path):
    """A checkpoint takes 2 of the 8 blocks: b's blocks evict a's checkpoint (to disk) but not a's first KV
    blocks; a request sharing a's prefix finds those in RAM and the state's blocks on disk, read back into free
    blocks, and starts from a's state."""
    kv = PagedKVCacheManager(8, BS)
    io = PoolIO()
    checkpoints = StateCheckpoints(kv.pool, io, 2, BS)
    kv.attach_state_slots(StateSlotPool(1), checkpoints)
    tier = DiskKVTier(str(tmp_path), 2**20, FP, BLOCK_BYTES)
    kv.add_connector(DiskTierConnector(tier, io, kv.pool))
    a = list(range(13))
    first = TokenRequest("a", a)
    assert kv.allocate_slots(first, 13)
    io.rows[0] = _state(1)
    assert kv.recurrent.checkpoint(first, 8)
    kv.commit_step()
    kv.free(first)
    other = TokenRequest("b", list(range(100, 116)))
    assert kv.allocate_slots(other, 16)  # 4 blocks: the 2 never used, then the checkpoint's 2
    key = hash_full_blocks(a, BS)[1]
    assert not checkpoints.find(key) and all(tier.contains(k) for k in checkpoints.part_keys(key))
    kv.free(other)
    again = TokenRequest("c", a)
    blocks, n = kv.get_computed_blocks(again)
    assert n == 8 and checkpoints.find(key) and kv.recurrent.disk_loads == 1 and tier.stats.loads == 2
    assert kv.allocate_slots(again, 5, blocks) and kv.recurrent.restore("c") and io.rows[0] == _state(1)
    kv.free(again)
    assert kv.num_free_blocks == 8 and not checkpoints.holds


# ---- in the engine -----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def qwen35(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("qwen3_5"))
    hf = make_hybrid("qwen3_5", folder)
    return hf, load_model(folder, "float32", "cpu")


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 256) for _ in range(n)]


def _engine(loaded, **kw) -> LLMEngine:
    """One request at a time; 64 blocks of 16 (and a state's worth more); 64 tokens a step."""
    per_block = bytes_per_block(loaded.config, 16, "float32", loaded.config.kv_layout(hybrid=True))
    budget = 64 * per_block + 2 * state_bytes(loaded.config, torch.float32)
    kw = dict(max_model_len=256, log_stats_interval=0, max_num_seqs=1, max_num_batched_tokens=64) | kw
    return LLMEngine(EngineConfig(kv_cache_memory=budget, **kw), loaded)


def _run(engine: LLMEngine, prompts: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """Greedy tokens and cached prompt tokens per prompt, one after another."""
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    tokens, cached = [], []
    for i, p in enumerate(prompts):
        engine.add_request(f"{engine.num_steps}-{i}", p, params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    tokens.append(out.outputs[0].token_ids)
                    cached.append(out.num_cached_tokens)
    assert engine.kv.num_free_blocks == engine.kv.num_blocks and not engine.scheduler.running
    return tokens, cached


def test_a_shared_prefix_hits_from_a_state_on_disk_after_a_restart(qwen35, tmp_path):
    """The first prompt keeps its states at 64 and 80 tokens in pool blocks; the second shares 64 tokens and
    hits them. The engine going idle writes every cached block to disk, the checkpoints' too: a restarted engine
    serves the first prompt's 80 tokens from disk (KV blocks and the state's). Every answer equals caching off
    and transformers'."""
    hf, loaded = qwen35
    shared = _tokens(64, 1)
    prompts = [shared + _tokens(30, 2), shared + _tokens(20, 3)]
    with torch.no_grad():
        want = [
            hf.generate(torch.tensor([p]), max_new_tokens=6, min_new_tokens=6, do_sample=False)[0, len(p) :].tolist()
            for p in prompts
        ]
    assert _run(_engine(loaded, enable_prefix_caching=False), prompts)[0] == want
    engine = _engine(loaded, kv_offload_dir=str(tmp_path))
    assert _run(engine, prompts) == (want, [0, 64]) and engine.kv.recurrent.disk_loads == 0
    engine.disk_tier.flush()
    restarted = _engine(loaded, kv_offload_dir=str(tmp_path))
    assert _run(restarted, prompts[:1]) == (want[:1], [80])
    assert restarted.kv.recurrent.disk_loads == 1 and restarted.stats().prefix_cache_disk_hits == 80


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16", "int8", "fp8"])
def test_a_state_goes_through_the_blocks_bytes_unchanged_whatever_the_cache_dtype(qwen35, kv_dtype):
    _, loaded = qwen35
    assert_state_round_trip(_engine(loaded, kv_cache_dtype=kv_dtype, max_num_seqs=2).runner)  # two slots
