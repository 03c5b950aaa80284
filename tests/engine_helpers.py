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


def hybrid_engine(loaded, blocks: int, block_size: int = 32, max_num_seqs: int = 3, **kw) -> LLMEngine:
    """An engine over `loaded` in float32 whose KV budget holds `blocks` blocks of `block_size` (a block spans one
    group's layers), or as many as `max_num_seqs` recurrent states' bytes where more (the engine gives the state
    slots at most half the budget), beside a state slot per request (none without recurrent layers) and, under
    --mamba-cache-mode all, a staging row each (align keeps its state checkpoints in blocks); 64 tokens a step,
    prefix caching on unless `kw` says otherwise."""
    import torch

    from pagedllm.engine.memory import state_bytes
    from pagedllm.model.runner import bytes_per_block

    cfg = loaded.config
    per_block = bytes_per_block(cfg, block_size, "float32", cfg.kv_layout(hybrid=True))
    state = state_bytes(cfg, torch.float32)
    blocks = max(blocks, -(-max_num_seqs * state // per_block))
    rows = 2 if kw.get("mamba_cache_mode") == "all" else 1
    kw = dict(max_num_batched_tokens=64, max_model_len=352, log_stats_interval=0) | kw
    budget = blocks * per_block + max_num_seqs * rows * state
    return LLMEngine(
        EngineConfig(block_size=block_size, max_num_seqs=max_num_seqs, kv_cache_memory=budget, **kw), loaded
    )


def shared_prefix_prompts(token) -> list[list[int]]:
    """Three prompts for hybrid_engine(loaded, 16), `token(n, seed)` drawing n token ids: two sharing their first
    256 tokens, the first's last block boundary in 32-token blocks (the second hits the state checkpoint the first
    left there, its newest), then 2 tokens each: so few that the first tokens' logits hang on the restored state
    (the tiny checkpoints' decays forget a state within tens of tokens, a short conv's after 2; with 8, LFM2's
    conv state restored for its first conv layer only gave transformers' tokens). One of 300 on its own, with
    which the three overflow the cache (it is preempted: the last admitted)."""
    shared = token(256, 3)
    return [shared + token(2, 4), shared + token(2, 5), token(300, 6)]


def greedy_cached_chunked_preempted(engine: LLMEngine, prompts: list[list[int]], n: int = 32) -> list[list[int]]:
    """`n` greedy tokens of each prompt, all added at once to `engine` (one with prefix caching, chunked prefill
    and a cache small enough to preempt, two of the prompts sharing a prefix): the tokens, after checking that the
    run did preempt and hit the prefix cache, and gave every block and state slot back."""
    tokens = run_all(engine, prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    stats = engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0, (stats.num_preemptions, stats.prefix_cache_hits)
    assert_all_blocks_free(engine)
    slots = engine.kv.recurrent.slots if engine.kv.recurrent is not None else None
    assert slots is None or (slots.num_free == slots.num_slots and not slots.req_to_slot)
    assert all(len(t) == n for t in tokens)
    return [list(t) for t in tokens]
