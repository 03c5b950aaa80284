"""Speculative decoding with n-gram prompt lookup (vLLM's `--speculative-config '{"method": "ngram", ...}'`).

A RAG answer copies phrases from its prompt. When the last few tokens appeared earlier in the context, the tokens
that followed them there are a cheap guess (a draft) of what comes next. The scheduler puts the drafts after the
request's real token in one chunk, the model computes logits at every position of it, and the sampler keeps the
drafts up to the first one the model would not have produced, plus the model's own token at that position. So a
step yields 1 to k + 1 tokens, and the output is the one without speculation (see `LLMEngine._accept`).

The drafts' K/V slots are allocated as lookahead slots that the prefix cache never registers; the slots of
rejected drafts are given back after the step (`KVCacheManager.trim`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from pagedllm.engine.request import Request
from pagedllm.errors import UserError

MAX_SPECULATIVE_TOKENS = 128  # vLLM's rejection sampler's MAX_SPEC_LEN


# What `--speculative-config auto` (the default of every command) turns on on a CPU. Measured there
# (docs/benchmarks.md, "Speculative decoding"): prompt lookup paid (1.15-2.4x) or broke even (64 requests) at every
# concurrency tried, on RAG answers and on the random workload; off elsewhere (nothing measured on a GPU).
CPU_DEFAULT = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


def _bad(message: str) -> UserError:
    return UserError(f"--speculative-config: {message}")


@dataclass
class SpeculativeConfig:
    """vLLM's SpeculativeConfig fields for the n-gram method. Unset lookup bounds follow vLLM: each defaults to
    the other, and both to 5. `disable_by_batch_size`: no drafts in a step while at least that many requests are
    running or waiting (several sequences per step already use the CPU that verification would need)."""

    method: str = "ngram"
    num_speculative_tokens: int | None = None
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.method != "ngram":
            raise _bad(f"method {self.method!r} is not supported: only \"ngram\" (prompt lookup)")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "disable_by_batch_size"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise _bad(f"{name} must be a positive integer, got {value!r}")
        if self.num_speculative_tokens is None:
            raise _bad("num_speculative_tokens is required for the ngram method")
        if self.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
            raise _bad(f"num_speculative_tokens must be at most {MAX_SPECULATIVE_TOKENS}, "
                       f"got {self.num_speculative_tokens}")
        if self.prompt_lookup_max is None:
            self.prompt_lookup_max = self.prompt_lookup_min or 5
        if self.prompt_lookup_min is None:
            self.prompt_lookup_min = self.prompt_lookup_max
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise _bad(f"prompt_lookup_min ({self.prompt_lookup_min}) must be <= prompt_lookup_max "
                       f"({self.prompt_lookup_max})")

    @classmethod
    def parse(cls, value: Any, on_cpu: bool = True) -> SpeculativeConfig | None:
        """From the flag's JSON text, a dict (`LLM(speculative_config={...})`) or a config; None, "", "none" or
        "off" mean off; "auto" (the CLI's default) means CPU_DEFAULT on a CPU and off elsewhere."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            if value.strip().lower() in ("", "none", "off", "null"):
                return None
            if value.strip().lower() == "auto":
                return cls(**CPU_DEFAULT) if on_cpu else None
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise _bad(f"not valid JSON ({e.msg} at character {e.pos}): {value!r}") from None
        if not isinstance(value, dict):
            raise _bad(f"must be a JSON object like {{\"method\": \"ngram\", \"num_speculative_tokens\": 4}}, "
                       f"got {value!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise _bad(f"unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**value)


def ngram_draft(tokens: list[int], num_drafts: int, min_n: int, max_n: int) -> list[int]:
    """Prompt lookup: find the longest n-gram (min_n <= n <= max_n) that ends the sequence and also occurs earlier,
    the most recent such occurrence, and return up to `num_drafts` tokens that followed it there.

    The most recent occurrence, as vLLM's proposer: an answer that quotes a passage is following the passage it
    is in now. Vectorised over the occurrences of the last token, so a 2,000-token context costs tens of µs.
    """
    arr = np.asarray(tokens)
    size = len(arr)
    if num_drafts < 1 or size <= min_n:
        return []
    ends = np.flatnonzero(arr[:-1] == arr[-1])  # earlier positions holding the last token
    if ends.size == 0:
        return []
    matched = np.ones(ends.size, dtype=np.int64)  # length of the match ending at each position so far
    for j in range(1, min(max_n, size - 1)):
        still = (matched == j) & (ends >= j)
        still[still] = arr[ends[still] - j] == arr[size - 1 - j]
        matched += still
    best = int(matched.max())
    if best < min_n:
        return []
    end = int(ends[np.flatnonzero(matched == best)[-1]])
    return arr[end + 1:end + 1 + num_drafts].tolist()


class NgramDrafter:
    """Drafts for the scheduler: as many as the budget, the model length and the request's max_tokens leave room
    for (a step yields up to drafts + 1 tokens, so drafting past max_tokens - 1 would only waste compute)."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len

    def active(self, num_requests: int) -> bool:
        limit = self.config.disable_by_batch_size
        return limit is None or num_requests < limit

    def propose(self, request: Request, room: int) -> list[int]:
        """Drafts to verify after the request's last token (every token but that one is computed); at most
        `room`."""
        cfg = self.config
        k = min(cfg.num_speculative_tokens, room, self.max_model_len - len(request.all_token_ids))
        if request.params.max_tokens is not None:
            k = min(k, request.params.max_tokens - request.num_output_tokens - 1)
        drafts = ngram_draft(request.all_token_ids, k, cfg.prompt_lookup_min, cfg.prompt_lookup_max)
        if request.grammar is not None:  # drafts the grammar refuses could never be accepted: not worth verifying
            drafts = drafts[:request.grammar.valid_prefix(drafts)]
        return drafts


def num_accepted(drafts: list[int], targets: list[int]) -> int:
    """How many drafts the model confirmed: the leading drafts equal to the token sampled at their position."""
    count = 0
    for draft, target in zip(drafts, targets):
        if draft != target:
            break
        count += 1
    return count


@dataclass
class SpecDecodeStats:
    """Cumulative, as vLLM's spec_decode counters: a draft is one request's drafts in one step."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [i]: drafts whose i-th token was accepted

    def record(self, num_draft_tokens: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += accepted
        if len(self.accepted_per_pos) < num_draft_tokens:
            self.accepted_per_pos.extend([0] * (num_draft_tokens - len(self.accepted_per_pos)))
        for i in range(accepted):
            self.accepted_per_pos[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0
