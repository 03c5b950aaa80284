"""What the async engine and the server need of an engine, as a type: `LLMEngine` fits it, and so does the
tests' fake engine, so the server layer is written (and checked) against this and never against `Any`."""
from __future__ import annotations

from typing import Protocol, runtime_checkable

from pagedllm.engine.outputs import RequestOutput
from pagedllm.engine.stats import EngineStats
from pagedllm.model.config import ModelConfig
from pagedllm.model.tokenizer import Tokenizer
from pagedllm.sampling_params import SamplingParams


@runtime_checkable
class EngineCore(Protocol):
    """A synchronous engine: requests go in with `add_request`, `step()` advances every one of them by a step."""

    tokenizer: Tokenizer
    model_config: ModelConfig
    max_model_len: int

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    cache_salt: str | None = None, *, prompt_token_ids: list[int] | None = None) -> None:
        """Queue a request (all its `params.n` samples) or raise `UserError` leaving nothing behind."""

    def abort_request(self, request_id: str) -> None:
        """Finish a request now and free its blocks; a no-op for an unknown or finished id."""

    def step(self) -> list[RequestOutput]:
        """One scheduling and model step; the cumulative outputs of the requests that progressed."""

    def has_unfinished_requests(self) -> bool:
        """Whether a `step()` has anything to do."""

    def stats(self) -> EngineStats:
        """A snapshot of the queues, the block pool and the cumulative counters."""
