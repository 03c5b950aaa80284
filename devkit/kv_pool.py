"""A busy engine's KV pool without a model: what the /kv page's 100,000-block test renders and what
benchmarks/kv/page_cost.py times (one definition for both)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from types import SimpleNamespace

from pagedllm.engine.request import RequestStatus
from pagedllm.kv.manager import PagedKVCacheManager, TokenRequest


@dataclass
class _Req(TokenRequest):
    """What take_snapshot reads of an engine request."""

    status: RequestStatus = RequestStatus.RUNNING
    num_cached_tokens: int = 0
    num_preemptions: int = 0

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.all_token_ids

    num_output_tokens = 0


def busy_engine(num_blocks: int, blocks_per_request: int = 300, held: float = 0.6) -> SimpleNamespace:
    """An engine-shaped object whose manager holds `held` of the pool, half of the requests sharing a prefix."""
    kv = PagedKVCacheManager(num_blocks, 16, True)
    prefix = list(range(1, 1001))
    running, n = [], 0
    while kv.num_used_blocks + blocks_per_request < held * num_blocks:
        body = [1000 + (n * 7919 + k) % 40000 for k in range(blocks_per_request * 16 - 5)]
        req = _Req(f"r{n}", (prefix + body)[: len(body)] if n % 2 else body)
        hits, num_cached = kv.get_computed_blocks(req)
        req.num_computed_tokens = 0
        assert kv.allocate_slots(req, len(req.all_token_ids) - num_cached, hits)
        req.num_computed_tokens, req.num_cached_tokens = len(req.all_token_ids), num_cached
        running.append(req)
        n += 1
    for req in running[::5]:  # finished: their blocks stay cached in the free queue
        kv.free(req)
    running = [r for i, r in enumerate(running) if i % 5]
    return SimpleNamespace(
        kv=kv,
        scheduler=SimpleNamespace(running=running, waiting=deque(), num_preemptions=0),
        config=SimpleNamespace(kv_allocation="paged"),
        kv_dtype="bfloat16",
        num_steps=0,
        prompt_tokens=0,
        generation_tokens=0,
        requests={r.request_id: r for r in running},
    )
