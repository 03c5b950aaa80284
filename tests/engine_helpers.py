"""What engine tests share: a small engine over the session's float32 model, a run-to-the-end loop, the
every-block-is-back check."""

from __future__ import annotations

from collections.abc import Callable

from pagedllm import SamplingParams
from pagedllm.engine import EngineConfig, LLMEngine
from pagedllm.kv import kv_bytes_per_token

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
# A KV block of the default model (SmolLM2-135M: 30 layers, 3 KV heads of 64) in float32, 16 tokens.
BLOCK_BYTES_FP32 = 16 * kv_bytes_per_token(30, 3, 64, 4)


def kv_budget(blocks: int) -> int:
    """--kv-cache-memory for exactly `blocks` blocks of the default model in float32 (tests that must preempt)."""
    return blocks * BLOCK_BYTES_FP32


def make_engine(model, **kw) -> LLMEngine:
    kw.setdefault("kv_cache_memory", 64 * 2**20)
    kw.setdefault("max_model_len", 1024)
    kw.setdefault("log_stats_interval", 0)
    return LLMEngine(EngineConfig(**kw), model)


def run_all(engine: LLMEngine, prompts: list[list[int]], params=GREEDY) -> list[list[int]]:
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[str(i)].outputs[0].token_ids for i in range(len(prompts))]


def assert_all_blocks_free(engine: LLMEngine) -> None:
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    assert not engine.kv.req_blocks and not engine.scheduler.running and not engine.scheduler.waiting


Run = Callable[[LLMEngine, list[list[int]]], tuple[list[list[int]], list[int]]]


def assert_disk_tier_round_trip(
    make: Callable[..., LLMEngine], run: Run, prompts: list[list[int]], cold: list[list[int]], folder: str
) -> None:
    """Four 100-token prompts through an engine whose RAM pool cannot hold them together (`make`): with the disk
    tier in `folder`, a second pass finds the first prompts' blocks on disk (evicted from RAM) and answers `cold`,
    the tokens of an engine without the tier; so does a new engine over the same folder, every hit from disk.
    `run` gives each prompt's greedy tokens and cached prompt tokens, one request after another."""
    engine = make(kv_offload_dir=folder)
    assert run(engine, prompts)[0] == cold
    tokens, cached = run(engine, prompts)
    assert tokens == cold and all(c >= 96 for c in cached)
    assert engine.stats().prefix_cache_disk_hits > 0
    engine.disk_tier.flush()
    restarted = make(kv_offload_dir=folder)
    tokens, cached = run(restarted, prompts)
    assert tokens == cold and cached == [96] * 4
    assert restarted.stats().prefix_cache_disk_hits == 4 * 96 == restarted.stats().prefix_cache_hits
