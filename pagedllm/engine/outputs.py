"""What the engine hands back each step: cumulative text and tokens per sample, plus per-request timings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class RequestMetrics:
    """time.monotonic() stamps; None until the event happened."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: str | int | None = None  # the stop string or stop token that ended it
    logprobs: list[dict[int, float]] | None = None  # per token: {token id: logprob}, sampled token included
    error: str | None = None
    bad_request: bool = False  # the error is the request's fault (e.g. a grammar the vocabulary cannot write)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int
    metrics: RequestMetrics
    prompt_logprobs: list[dict[int, float] | None] | None = None  # per prompt token, when asked for (first: None)
    embedding: list[float] | None = None  # a pooling request's vector, once finished
    # add_request(logits_from=p): float32 log-softmax rows [n, vocab] of positions p.. (evaluation: rag bench)
    prompt_logits: Any = None
    num_blend_tokens: int = 0  # prompt tokens whose KV was copied from stored segments (kv_blend), not computed
