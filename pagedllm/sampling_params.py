"""What a request asks of sampling (shared by the engine and the sampler); checked before anything is queued, so a bad value never reaches a step."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from pagedllm.errors import UserError

MAX_N = 64
MAX_LOGPROBS = 20


class SamplingParamsError(UserError):
    """A bad sampling parameter; `param` names it (the server reports it in the OpenAI error body)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


@dataclass
class SamplingParams:
    """vLLM's names and defaults. temperature 0 is greedy; max_tokens None means 'up to max_model_len'."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-k logprobs per generated token (0: only the sampled token's)
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    def validate(self) -> None:
        def check(ok: bool, param: str, message: str) -> None:
            if not ok:
                raise SamplingParamsError(param, message)

        def number(name: str) -> float:
            value = getattr(self, name)
            check(isinstance(value, (int, float)) and not isinstance(value, bool), name,
                  f"must be a number, got {value!r}")
            return value

        def integer(name: str) -> int:
            value = getattr(self, name)
            check(isinstance(value, int) and not isinstance(value, bool), name, f"must be an integer, got {value!r}")
            return value

        check(1 <= integer("n") <= MAX_N, "n", f"must be between 1 and {MAX_N}, got {self.n}")
        check(number("temperature") >= 0, "temperature", f"must be >= 0, got {self.temperature}")
        check(0 < number("top_p") <= 1, "top_p", f"must be in (0, 1], got {self.top_p}")
        check(integer("top_k") >= 0, "top_k", f"must be -1 (off), 0 (off) or a positive integer, got {self.top_k}")
        check(0 <= number("min_p") <= 1, "min_p", f"must be in [0, 1], got {self.min_p}")
        check(number("repetition_penalty") > 0, "repetition_penalty",
              f"must be > 0, got {self.repetition_penalty}")
        check(-2 <= number("presence_penalty") <= 2, "presence_penalty",
              f"must be in [-2, 2], got {self.presence_penalty}")
        check(-2 <= number("frequency_penalty") <= 2, "frequency_penalty",
              f"must be in [-2, 2], got {self.frequency_penalty}")
        if self.seed is not None:
            integer("seed")
        if self.max_tokens is not None:
            check(integer("max_tokens") >= 1, "max_tokens", f"must be at least 1, got {self.max_tokens}")
        check(integer("min_tokens") >= 0, "min_tokens", f"must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None:
            check(self.min_tokens <= self.max_tokens, "min_tokens",
                  f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        check(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        check(all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids),
              "stop_token_ids", "must be non-negative integers")
        if self.logprobs is not None:
            check(0 <= integer("logprobs") <= MAX_LOGPROBS, "logprobs",
                  f"must be between 0 and {MAX_LOGPROBS}, got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def for_sample(self, index: int) -> SamplingParams:
        """The params of the index-th of n parallel samples: one sample each, seeds kept distinct."""
        seed = None if self.seed is None else self.seed + index
        return dataclasses.replace(self, n=1, seed=seed)
