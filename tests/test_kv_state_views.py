"""What /v1/kv, the /kv page's data and `kv-calc --model` say of a hybrid model's recurrent state, beside its
KV-cache groups: the state bytes per request (the slot the engine reserves), slots used and free, checkpoint rows
and the checkpoints held, each read against the engine's own structures."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from server_helpers import running_server
from test_model_hybrid import make_hybrid

from pagedllm import SamplingParams
from pagedllm.engine import EngineConfig, LLMEngine
from pagedllm.engine.async_engine import AsyncLLMEngine
from pagedllm.engine.block_map import block_map
from pagedllm.engine.kv_snapshot import take_snapshot
from pagedllm.engine.memory import state_bytes
from pagedllm.engine.stats import recurrent_state_stats
from pagedllm.kv.hashing import hash_full_blocks
from pagedllm.kv.manager import PagedKVCacheManager, TokenRequest
from pagedllm.kv.state_slots import StateCheckpoints, StateSlotPool
from pagedllm.model import load_model
from pagedllm.model.runner import bytes_per_block
from pagedllm.server.kv_page import kv_blocks_json

pytestmark = pytest.mark.usefixtures("one_thread", "private_tokenizer_cache")  # tests/conftest.py


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("qwen3_5"))
    make_hybrid("qwen3_5", folder)
    return folder, load_model(folder, "float32", "cpu")


def _engine(loaded, seqs: int = 2) -> LLMEngine:
    per_block = bytes_per_block(loaded.config, 16, "float32", loaded.config.kv_layout(hybrid=True))
    budget = 32 * per_block + 2 * seqs * state_bytes(loaded.config, torch.float32)
    config = EngineConfig(
        max_model_len=256, log_stats_interval=0, max_num_seqs=seqs, kv_cache_memory=budget, max_num_batched_tokens=64
    )
    return LLMEngine(config, loaded)


def test_stats_and_the_kv_page_data_show_slots_checkpoints_and_groups(qwen35):
    """A 100-token request after one step (64 tokens): one slot used, the state at 64 checkpointed, its blocks in
    the one full-attention group; at the end every slot free, the checkpoints kept."""
    _, loaded = qwen35
    engine = _engine(loaded)
    per_request = state_bytes(loaded.config, torch.float32)
    engine.add_request("r", list(range(3, 103)), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    engine.step()
    st = engine.stats()
    rs = st.recurrent_state
    assert rs is not None and (rs.layers, rs.bytes_per_request) == ([0, 1, 2], per_request)
    each = rs.checkpoint_blocks_each
    assert each > 0 and (rs.slots, rs.slots_used, rs.checkpoints, rs.checkpoint_blocks, rs.checkpoints_held) == (
        2,
        1,
        1,
        each,
        0,
    )
    assert [(g.window, g.layers, g.blocks) for g in st.kv_groups] == [(None, [3], engine.kv.num_used_blocks)]
    data = json.loads(kv_blocks_json(block_map(take_snapshot(engine))))  # as GET /v1/kv/blocks answers
    assert data["recurrent_state"] == {
        "mixer": "gated_deltanet",
        "layers": [0, 1, 2],
        "bytes_per_request": per_request,
        "slots": 2,
        "slots_used": 1,
        "slots_free": 1,
        "checkpoint_blocks_each": each,
        "checkpoints": 1,
        "checkpoint_blocks": each,
        "checkpoints_held": 0,
        "checkpoint_disk_loads": 0,
    }
    while engine.has_unfinished_requests():
        engine.step()
    rs = engine.stats().recurrent_state
    assert rs is not None and (rs.slots_used, rs.checkpoints) == (0, 2)  # at 64, and at the last boundary (96)


def test_v1_kv_names_the_state_and_the_groups(qwen35):
    _, loaded = qwen35
    engine = AsyncLLMEngine(_engine(loaded))
    with running_server(engine) as s:
        r = s.http.post("/v1/completions", json={"prompt": list(range(3, 60)), "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200, r.text
        body = s.http.get("/v1/kv").json()
    assert body["kv_groups"] == [{"window": None, "layers": [3], "frees_blocks": False, "blocks": 0}]
    state = body["recurrent_state"]
    assert (
        state["bytes_per_request"] == state_bytes(loaded.config, torch.float32) and state["mixer"] == "gated_deltanet"
    )
    assert (state["slots"], state["slots_used"], state["slots_free"]) == (2, 0, 2) and state["checkpoint_blocks_each"]
    assert state["checkpoints"] == 1  # the prompt's last block boundary (48)


def test_a_held_checkpoint_is_counted_until_copied():
    kv = PagedKVCacheManager(8, 4)
    io = SimpleNamespace(state_to_blocks=lambda row, ids: None, blocks_to_state=lambda ids, row: None)
    kv.attach_state_slots(StateSlotPool(2, 100), StateCheckpoints(kv.pool, io, 1, 4))
    first = TokenRequest("a", list(range(13)))
    assert kv.allocate_slots(first, 13) and kv.recurrent.checkpoint(first, 8)
    kv.commit_step()
    kv.free(first)
    again = TokenRequest("b", list(range(13)))
    blocks, _ = kv.get_computed_blocks(again)
    assert kv.allocate_slots(again, 5, blocks)
    rs = recurrent_state_stats(kv)
    assert rs is not None and (rs.slots_used, rs.checkpoints, rs.checkpoints_held) == (1, 1, 1)
    assert kv.recurrent.checkpoints.find(hash_full_blocks(list(range(8)), 4)[1])
    kv.recurrent.restore("b")
    rs = recurrent_state_stats(kv)
    assert rs is not None and rs.checkpoints_held == 0


def test_kv_calc_prints_the_state_per_layer_and_per_request(qwen35, capsys):
    from pagedllm.entrypoints.cli import main

    folder, loaded = qwen35
    cfg = loaded.config
    assert main(["kv-calc", "--model", folder, "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    per = state_bytes(cfg, torch.float32)
    conv_dim, heads, key_dim, value_dim = cfg.recurrent_state_dims()
    conv = conv_dim * (cfg.linear_conv_kernel_dim - 1) * 4
    assert per == 3 * (conv + heads * key_dim * value_dim * 4)
    assert "recurrent state (gated_deltanet, layers 0, 1, 2: no KV, no blocks):" in out
    assert f"per layer: conv state {conv:,} bytes (float32), recurrent state {heads * key_dim * value_dim * 4:,}" in out
    assert f"recurrent state: {per:,} bytes per request (3 layers)" in out and "pool blocks of their own kind" in out
    assert out.count("recurrent state:") == 1
