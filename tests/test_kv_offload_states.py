"""A hybrid model's recurrent-state checkpoints in the disk tier (--kv-offload-dir): a checkpoint evicted from its
RAM row is written like a KV block (its own kind of file, keyed by its prefix: hashing.state_key) and read back
into a row when a lookup's KV hit ends where it lies, so a shared prefix still hits after its state left RAM, and
after a restart; a state file that fails a check (torn, flipped, a block's file under a state's name, another
size) is never served; answers equal caching off and transformers'."""

from __future__ import annotations

import os
import random
import zlib

import pytest
import torch
from test_model_hybrid import make_hybrid

from pagedllm import SamplingParams
from pagedllm.engine import EngineConfig, LLMEngine
from pagedllm.engine.memory import state_bytes
from pagedllm.kv.hashing import hash_full_blocks, state_key
from pagedllm.kv.manager import PagedKVCacheManager, TokenRequest
from pagedllm.kv.offload import HEADER, MAGIC, STATE, DiskKVTier
from pagedllm.kv.state_slots import StateCheckpoints, StateSlotPool
from pagedllm.model import load_model
from pagedllm.model.runner import bytes_per_block

pytestmark = pytest.mark.usefixtures("one_thread", "private_tokenizer_cache")  # tests/conftest.py

FP = bytes(32)
BS, BLOCK_BYTES, STATE_BYTES = 4, 256, 1000


class RowIO:
    """A model runner's block and state bytes, in dicts (BlockIO and StateIO)."""

    def __init__(self) -> None:
        self.blocks: dict[int, bytes] = {}
        self.rows: dict[int, bytes] = {}

    def read_block(self, block_id: int) -> bytes:
        return self.blocks.get(block_id, bytes(BLOCK_BYTES))

    def write_block(self, block_id: int, data: bytes) -> None:
        self.blocks[block_id] = data

    def read_state(self, row: int) -> bytes:
        return self.rows[row]

    def write_state(self, row: int, data: bytes) -> None:
        if len(data) != STATE_BYTES:
            raise ValueError("wrong size")
        self.rows[row] = data


def _state(tag: int) -> bytes:
    return bytes([tag]) * STATE_BYTES


# ---- the tier alone --------------------------------------------------------------------------------------------
def test_state_files_reopen_and_a_bad_one_is_never_served(tmp_path):
    tier = DiskKVTier(str(tmp_path), 2**20, FP, BLOCK_BYTES, STATE_BYTES)
    keys = [state_key(bytes([i]) * 32) for i in range(5)]
    for i, k in enumerate(keys):
        assert tier.put(k, lambda i=i: _state(i), STATE)
    tier.flush()
    assert tier.stats.state_writes == 5
    assert tier.load(keys[0]) is None  # asked for as a KV block: not served (and gone: it failed a check)
    files = [tier._path(k) for k in keys]
    with open(files[1], "r+b") as f:  # one payload byte flipped
        f.seek(HEADER.size + 7)
        f.write(b"\xff")
    block = bytes(BLOCK_BYTES)
    with open(files[2], "wb") as f:  # a KV block's file under a state's name
        f.write(HEADER.pack(MAGIC, FP, keys[2], len(block), zlib.crc32(block)) + block)
    with open(files[3], "r+b") as f:  # torn
        f.truncate(HEADER.size + STATE_BYTES // 2)
    reopened = DiskKVTier(str(tmp_path), 2**20, FP, BLOCK_BYTES, STATE_BYTES)
    assert [reopened.load(k, STATE) for k in keys[1:]] == [None, None, None, _state(4)]
    assert reopened.stats.bad_files == 3 and reopened.stats.state_loads == 1
    assert sorted(os.listdir(reopened.dir)) == [os.path.basename(files[4])]
    other_size = DiskKVTier(str(tmp_path), 2**20, FP, BLOCK_BYTES, STATE_BYTES + 8)
    assert other_size.load(keys[4], STATE) is None and other_size.stats.bad_files == 1


def test_a_state_larger_than_the_tier_stops_the_states_not_the_blocks(tmp_path):
    tier = DiskKVTier(str(tmp_path), 3 * (HEADER.size + BLOCK_BYTES), FP, BLOCK_BYTES, STATE_BYTES)
    assert tier.put(state_key(bytes(32)), lambda: _state(1), STATE)
    tier.flush()
    assert tier.writable and not tier.write_states and tier.stats.writes == 0
    assert not tier.put(state_key(bytes([1]) * 32), lambda: _state(2), STATE)
    assert tier.put(bytes(32), lambda: bytes(BLOCK_BYTES))
    tier.flush()
    assert tier.stats.writes == 1


# ---- in the KV manager, without a model ------------------------------------------------------------------------
def test_an_evicted_checkpoint_is_read_back_from_disk_when_its_prefix_hits(tmp_path):
    """One checkpoint row: b's checkpoint evicts a's (to disk); a request sharing a's prefix finds a's KV blocks in
    RAM and its state on disk, read back into the row (evicting b's, which goes to disk in turn)."""
    kv = PagedKVCacheManager(16, BS)
    checkpoints = StateCheckpoints(first_row=1, num_rows=1, block_size=BS)
    kv.attach_state_slots(StateSlotPool(1), checkpoints)
    io, tier = RowIO(), DiskKVTier(str(tmp_path), 2**20, FP, BLOCK_BYTES, STATE_BYTES)
    kv.attach_disk_tier(tier, io, io)
    a, b = list(range(13)), list(range(100, 113))
    for rid, tokens, tag in (("a", a, 1), ("b", b, 2)):
        req = TokenRequest(rid, tokens)
        assert kv.allocate_slots(req, 13)
        row = kv.recurrent.checkpoint_row(req, 8)
        assert row == 1
        io.rows[row] = _state(tag)
        kv.commit_step()
        kv.free(req)
    tier.flush()
    key_a, key_b = (hash_full_blocks(t, BS)[1] for t in (a, b))
    assert checkpoints.find(key_a) is None and tier.contains(state_key(key_a))
    again = TokenRequest("c", a)
    blocks, n = kv.get_computed_blocks(again)
    assert n == 8 and checkpoints.find(key_a) == 1 and io.rows[1] == _state(1)
    assert kv.recurrent.disk_loads == 1 and tier.stats.state_loads == 1
    tier.flush()
    assert tier.contains(state_key(key_b))  # evicted from the row in turn
    assert kv.allocate_slots(again, 5, blocks) and kv.recurrent.take_restore("c") == 1
    kv.free(again)
    assert kv.num_free_blocks == 16 and not checkpoints.refs


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
    """One request at a time, so one state checkpoint row; 64 blocks of 16; 64 tokens a step."""
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


def test_a_shared_prefix_hits_from_a_state_on_disk_and_after_a_restart(qwen35, tmp_path):
    """The first prompt keeps its states at 64 and 80 tokens in one row: the one at 64 goes to disk. The second
    shares 64 tokens: RAM alone has their KV but no state there (no hit); with the disk tier it hits 64. A
    restarted engine serves the first prompt's 80 tokens from disk (KV blocks and state). Every answer equals
    caching off and transformers'."""
    hf, loaded = qwen35
    shared = _tokens(64, 1)
    prompts = [shared + _tokens(30, 2), shared + _tokens(20, 3)]
    with torch.no_grad():
        want = [
            hf.generate(torch.tensor([p]), max_new_tokens=6, min_new_tokens=6, do_sample=False)[0, len(p) :].tolist()
            for p in prompts
        ]
    assert _run(_engine(loaded, enable_prefix_caching=False), prompts)[0] == want
    assert _run(_engine(loaded), prompts) == (want, [0, 0])  # RAM alone: the state at 64 was evicted
    engine = _engine(loaded, kv_offload_dir=str(tmp_path))
    assert _run(engine, prompts) == (want, [0, 64])
    assert engine.kv.recurrent.disk_loads == 1
    engine.disk_tier.flush()
    restarted = _engine(loaded, kv_offload_dir=str(tmp_path))
    assert _run(restarted, prompts[:1]) == (want[:1], [80])
    assert restarted.disk_tier.stats.state_loads == 1 and restarted.stats().prefix_cache_disk_hits == 80
