"""A request's lifecycle and state: one Request per sample (n > 1 makes n of them, sharing the prompt's blocks)."""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.engine.outputs import CompletionOutput, RequestMetrics
from pagedllm.lora_request import LoRARequest, lora_id
from pagedllm.model.tokenizer import Tokenizer
from pagedllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedllm.engine.blend import BlendState
    from pagedllm.engine.pooling import PoolingState
    from pagedllm.engine.structured_output import RequestGrammar


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again, its KV dropped: it will be recomputed
    FINISHED = "finished"


class Request:
    def __init__(
        self,
        request_id: str,
        parent_id: str,
        index: int,
        prompt_token_ids: list[int],
        params: SamplingParams,
        tokenizer: Tokenizer,
        metrics: RequestMetrics,
        cache_salt: str | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> None:
        self.request_id = request_id
        self.parent_id = parent_id
        self.index = index
        self.prompt_token_ids = prompt_token_ids
        self.all_token_ids = list(prompt_token_ids)
        self.params = params
        self.cache_salt = cache_salt
        self.lora_request = lora_request
        self.lora_int_id = lora_id(lora_request)  # its adapter (0: the base model): part of its blocks' keys
        self.priority = priority  # lower first, under the priority scheduling policy
        self.arrival = 0  # the scheduler's count of requests added before it: ties of priority go in arrival order
        self.metrics = metrics
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache when first scheduled
        self.num_preemptions = 0
        self.prompt_tokens_counted = 0  # prompt positions counted in the engine's prompt_tokens (recompute: once)
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.error: str | None = None
        self.bad_request = False  # the error is the request's own (it asked for what the model cannot do)
        self.logprobs: list[dict[int, float]] | None = [] if params.logprobs is not None else None
        # Position i holds the logprobs of prompt token i given the ones before it (None for the first token).
        self.prompt_logprobs: list[dict[int, float] | None] | None = (
            [None] * len(prompt_token_ids) if params.prompt_logprobs is not None else None
        )
        self.detok = IncrementalDetokenizer(tokenizer, prompt_token_ids, params.skip_special_tokens)
        self.text = ""  # detokenized output, stop strings cut off
        # Speculative drafts scheduled this step after the last token (set by the scheduler, cleared once verified).
        self.spec_token_ids: list[int] = []
        self.grammar: RequestGrammar | None = None  # structured outputs: its matcher (set by the engine)
        self.pooling: PoolingState | None = None  # an embedding request: its pool (set by the engine)
        self.blend: BlendState | None = None  # kv_blend: its reusable segments (set by the engine; blend.py)
        # Log-softmax rows of every position from this one on (an evaluation hook: rag bench's KL), kept here.
        self.logits_from: int | None = None
        self.kept_logits: list = []

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids) :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def num_tokens_to_compute(self) -> int:
        return len(self.all_token_ids) - self.num_computed_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def wants_prompt_logits(self) -> bool:
        """Whether this step's chunk needs logits for every token: prompt logprobs of a prompt still computing."""
        return self.prompt_logprobs is not None and self.num_computed_tokens < self.num_prompt_tokens

    @property
    def reads_prefix_cache(self) -> bool:
        """Whether admission may skip cached prompt blocks: not when every prompt position must be computed
        (prompt logprobs, or pooling, which needs the hidden states of the positions it pools)."""
        return self.prompt_logprobs is None and self.pooling is None

    @property
    def grammar_ready(self) -> bool:
        """Whether the scheduler may admit it: unconstrained, or its grammar compiled."""
        return self.grammar is None or self.grammar.ready

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def finish(
        self, reason: str, stop_reason: str | int | None = None, error: str | None = None, bad_request: bool = False
    ) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.error = error
        self.bad_request = bad_request

    def completion_output(self, holdback: int = 0) -> CompletionOutput:
        """The sample so far; `holdback` characters stay unsent while they might still start a stop string."""
        text = self.text if self.finished or holdback == 0 else self.text[: max(0, len(self.text) - holdback)]
        return CompletionOutput(
            self.index,
            text,
            self.output_token_ids,
            self.finish_reason,
            self.stop_reason,
            self.logprobs,
            self.error,
            self.bad_request,
        )
