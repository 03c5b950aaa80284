"""The default KV budget on a CPU (kv/sizing.py's rule, the free memory read by engine/memory.py): a share of
the memory free after the weights, with a cap, never what the weights would have taken dense. The free memory
is a fake here, never the machine's."""

from __future__ import annotations

import logging

import pytest

import pagedllm.engine.memory as memory
from pagedllm.engine import EngineConfig, LLMEngine
from pagedllm.engine.memory import available_memory, kv_budget, num_kv_blocks
from pagedllm.errors import UserError
from pagedllm.kv.sizing import CPU_KV_SHARE, DEFAULT_CPU_KV_CACHE_MEMORY
from pagedllm.model.runner import bytes_per_block

GiB = 2**30


def budget(loaded, available: int, **kw) -> int:
    cfg = EngineConfig(log_stats_interval=0, **kw)
    return kv_budget(cfg, loaded, 2048, "float32", lambda: available)


@pytest.mark.parametrize("free", [GiB // 3, 2 * GiB, 3 * GiB + 12345])
def test_a_share_of_the_free_memory_below_the_cap(model_fp32, free):
    assert budget(model_fp32, free) == int(CPU_KV_SHARE * free) < DEFAULT_CPU_KV_CACHE_MEMORY


@pytest.mark.parametrize("free", [64 * GiB, 1024 * GiB])
def test_never_more_than_the_cap(model_fp32, free):
    assert budget(model_fp32, free) == DEFAULT_CPU_KV_CACHE_MEMORY


def test_a_hybrid_models_states_come_on_top_of_the_cap(model_fp32, monkeypatch, caplog):
    """A recurrent state per request of --max-num-seqs is added to the cap (not to the share): the blocks keep the
    cap's room, and every request gets its slot (kv_blocks_and_state_slots gives slots at most half the budget)."""
    state = 16 * 2**20
    monkeypatch.setattr(memory, "state_bytes", lambda cfg, dtype: state)
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        assert budget(model_fp32, 100 * GiB, max_num_seqs=64) == DEFAULT_CPU_KV_CACHE_MEMORY + 64 * state
    assert "for the recurrent states of --max-num-seqs requests" in caplog.text
    assert budget(model_fp32, 3 * GiB, max_num_seqs=64) == int(CPU_KV_SHARE * 3 * GiB)  # the share still bounds it
    cfg = EngineConfig(log_stats_interval=0, max_num_seqs=64, enable_prefix_caching=False)
    blocks, slots, _ = memory.kv_blocks_and_state_slots(cfg, model_fp32, 2048, "float32", lambda: 100 * GiB)
    per_block = bytes_per_block(model_fp32.config, cfg.block_size, "float32")
    assert slots == 64 and blocks == DEFAULT_CPU_KV_CACHE_MEMORY // per_block  # the blocks keep the cap's room


def test_not_what_the_weights_would_take_dense(model_fp32, model_fp32_dense):
    """Quantized weights leave the machine more free memory; they add nothing to the budget by themselves (the
    old rule gave the cache the difference to dense on top of a fixed 2 GiB)."""
    assert model_fp32.weight_bytes < model_fp32.dense_weight_bytes
    for free in (GiB, 100 * GiB):
        assert budget(model_fp32, free) == budget(model_fp32_dense, free)


def test_the_flag_wins_over_the_free_memory(model_fp32):
    assert budget(model_fp32, 10**6, kv_cache_memory=123 * 2**20) == 123 * 2**20


def test_the_log_says_the_budget_and_why(model_fp32, caplog):
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        budget(model_fp32, 100 * GiB)
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("KV budget"))
    assert "2.00 GiB" in line and "100.00 GiB free after loading" in line and "capped at 2 GiB" in line
    assert "--kv-cache-memory" in line


def test_no_memory_free_is_a_clear_error_naming_the_flag(model_fp32):
    with pytest.raises(UserError, match="--kv-cache-memory"):
        num_kv_blocks(EngineConfig(log_stats_interval=0), model_fp32, 2048, "float32", lambda: 0)


def test_the_engine_sizes_its_cache_from_the_free_memory(model_fp32, monkeypatch):
    """The engine asks after loading; its cache holds the budget's blocks."""
    monkeypatch.setattr(memory, "available_memory", lambda: 64 * 2**20)
    engine = LLMEngine(EngineConfig(log_stats_interval=0, max_model_len=1024), model_fp32)
    assert engine.kv.num_blocks == int(CPU_KV_SHARE * 64 * 2**20) // engine.runner.bytes_per_block


def test_a_cgroup_limit_below_the_machine_counts(tmp_path):
    (tmp_path / "memory.max").write_text(f"{3 * 2**20}\n")
    (tmp_path / "memory.current").write_text(f"{2**20}\n")
    assert available_memory(str(tmp_path)) == 2 * 2**20
    (tmp_path / "memory.max").write_text("max\n")
    assert available_memory(str(tmp_path)) > 2 * 2**20  # the machine's MemAvailable


def test_a_file_larger_than_the_free_memory_is_refused_by_size_before_loading(monkeypatch):
    """The check runs before the loader: both sizes named, nothing loaded."""
    import pagedllm.engine.llm_engine as llm_engine
    from pagedllm.model.config import resolve_model_path

    size = memory.weights_file_bytes(resolve_model_path(None))
    monkeypatch.setattr(memory, "available_memory", lambda: size // 2)
    monkeypatch.setattr(llm_engine, "load_model", lambda *a, **k: pytest.fail("loaded a file that does not fit"))
    with pytest.raises(UserError, match=rf"{size / GiB:.2f} GiB as stored, more than the {size // 2 / GiB:.2f} GiB"):
        LLMEngine(EngineConfig(log_stats_interval=0))


def test_a_file_that_fits_loads_and_its_cache_takes_a_share_of_what_is_left(model_fp32, monkeypatch):
    """A file a little smaller than the free memory starts (a 17 GB file on a 24 GiB machine): the loader runs,
    and the KV cache is sized from the memory free after it (faked here: what was free less the file)."""
    import pagedllm.engine.llm_engine as llm_engine
    from pagedllm.model.config import resolve_model_path

    size = memory.weights_file_bytes(resolve_model_path(None))
    free = [size + 64 * 2**20]
    loads = []

    def load(*a, **k):
        loads.append(a)
        free[0] -= size
        return model_fp32

    monkeypatch.setattr(memory, "available_memory", lambda: free[0])
    monkeypatch.setattr(llm_engine, "load_model", load)
    engine = LLMEngine(EngineConfig(log_stats_interval=0, max_model_len=1024))
    assert len(loads) == 1
    assert engine.kv.num_blocks == int(CPU_KV_SHARE * 64 * 2**20) // engine.runner.bytes_per_block
