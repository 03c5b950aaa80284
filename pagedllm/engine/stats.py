"""A snapshot of what the engine is doing: the numbers its log lines, /metrics and benchmarks report."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_blocks: int
    num_free_blocks: int
    num_cached_blocks: int  # free blocks that still hold a cached prefix (reused on a hit, evicted when needed)
    block_size: int
    kv_usage: float  # share of blocks held by requests
    num_stored_tokens: int  # tokens the running requests keep in the cache
    prefix_cache_queries: int  # prompt tokens looked up (cumulative)
    prefix_cache_hits: int  # prompt tokens found in the cache (cumulative)
    num_preemptions: int  # cumulative
    prompt_tokens: int  # prompt tokens computed (cumulative; cached ones excluded)
    generation_tokens: int  # tokens generated (cumulative)
    peak_running: int  # most requests running at once so far
    num_steps: int
    prefix_cache_disk_hits: int = 0  # of those, tokens read back from the disk tier (--kv-offload-dir)
    # Speculative decoding (cumulative, vLLM's spec_decode counters): a draft is one request's drafts in one step.
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = field(default_factory=list)  # [i]: i-th drafts accepted

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def slots_allocated(self) -> int:
        """Token slots in held blocks: the chapter's 'allocated' (stored / allocated is its 'used share')."""
        return self.num_used_blocks * self.block_size

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    @property
    def spec_decode_acceptance_rate(self) -> float:
        return (self.spec_decode_num_accepted_tokens / self.spec_decode_num_draft_tokens
                if self.spec_decode_num_draft_tokens else 0.0)
