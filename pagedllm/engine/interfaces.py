"""What the async engine and the server need of an engine, as types: `LLMEngine` fits `EngineCore`, and so does the
tests' fake engine; `AsyncLLMEngine` and the cluster's `ClusterEngine` fit `AsyncEngine`, so the server layer is
written against these, and the type checker (`make test` runs mypy) checks that the real engines fit them where
they are passed (`AsyncLLMEngine(LLMEngine(...))`, `build_app(engine, ...)`)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol

from pagedllm.engine.outputs import RequestOutput
from pagedllm.engine.stats import AbortLog, EngineStats
from pagedllm.lora_request import LoRARequest
from pagedllm.model.config import ModelConfig
from pagedllm.model.tokenizer import Tokenizer
from pagedllm.sampling_params import PoolingParams, SamplingParams


class EngineCore(Protocol):
    """A synchronous engine: requests go in with `add_request`, `step()` advances every one of them by a step."""

    tokenizer: Tokenizer
    model_config: ModelConfig
    max_model_len: int

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | PoolingParams,
        cache_salt: str | None = None,
        *,
        prompt_token_ids: list[int] | None = None,
        priority: int = 0,
        kv_segments: list[tuple[int, int]] | None = None,
        kv_blend_recompute: float | None = None,
        kv_blend_max_deviation: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Queue a request (all its `params.n` samples) or raise `UserError` leaving nothing behind."""

    def abort_request(self, request_id: str) -> None:
        """Finish a request now and free its blocks; a no-op for an unknown or finished id."""

    def step(self) -> list[RequestOutput]:
        """One scheduling and model step; the cumulative outputs of the requests that progressed."""

    def has_unfinished_requests(self) -> bool:
        """Whether a `step()` has anything to do."""

    def stats(self) -> EngineStats:
        """A snapshot of the queues, the block pool and the cumulative counters."""


class AsyncEngine(Protocol):
    """What the OpenAI server needs of an async engine. `AsyncLLMEngine` (one engine thread in this process) fits
    it, and so does the cluster's `ClusterEngine` (requests run on engine replicas on Ray Serve), so both serve the
    same routes, validation, streaming and error bodies. What only one engine in this process can answer (its
    Prometheus page, the /kv block map) is the single server's state routes' business, not this protocol's."""

    @property
    def tokenizer(self) -> Tokenizer: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def model_config(self) -> ModelConfig:
        """The model's config: its vocabulary (token ids are checked against it) and name."""

    max_waiting_requests: int | None  # samples waiting at once; a request over it is a 400, the limit a 503
    aborts: AbortLog  # the requests aborted so far (/v1/kv)

    @property
    def is_healthy(self) -> bool:
        """False once the engine can serve nothing more (/health answers 503)."""

    def start(self) -> None: ...

    def stop_accepting(self) -> None: ...

    def abort_all(self) -> None: ...

    def shutdown(self, timeout: float | None = 10.0) -> None: ...

    async def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | PoolingParams,
        *,
        cache_salt: str | None = None,
        priority: int = 0,
        kv_segments: list[tuple[int, int]] | None = None,
        kv_blend_recompute: float | None = None,
        kv_blend_max_deviation: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> Any:
        """Queue a request; returns its stream once the engine took it, or raises what the engine raised.
        `cache_salt` keeps its prefix blocks to requests of the same salt; `priority` orders admission;
        `kv_segments` are spans whose KV may be reused wherever they land (engine/blend.py); `lora_request`: the
        LoRA adapter it runs under."""

    def iterate(self, stream: Any) -> AsyncIterator[RequestOutput]:
        """The cumulative outputs of the request `add_request` returned `stream` for; leaving early aborts it."""

    def abort(self, request_id: str) -> None:
        """Stop a request and free its blocks (non-blocking)."""

    async def add_lora(self, lora: LoRARequest) -> None:
        """Load a LoRA adapter now (vLLM's /v1/load_lora_adapter): a bad one raises UserError naming it."""

    async def remove_lora(self, lora_int_id: int) -> None:
        """Unload a LoRA adapter (/v1/unload_lora_adapter); UserError while requests use it."""

    def stats(self) -> EngineStats: ...
