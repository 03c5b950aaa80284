"""What a request asks of sampling (shared by the engine and the sampler).

Checked before anything is queued, so a bad value never reaches a step: every value `validate` accepts must
sample without inf or nan, which is why integers have ranges and floats must be finite, and why temperatures
in (0, 1e-2) are raised to 1e-2 as vLLM does (dividing logits by 1e-300 overflows float32).
"""

from __future__ import annotations

import dataclasses
import functools
import json as jsonlib
import logging
import math
from dataclasses import dataclass, field
from typing import Any, NoReturn

from pagedllm.errors import UserError

MAX_N = 64
MAX_LOGPROBS = 20
MIN_TEMPERATURE = 1e-2  # vLLM's _MAX_TEMP: smaller positive temperatures are raised to it
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for logit_bias values
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed accepts
INT32_MAX = 2**31 - 1

logger = logging.getLogger("pagedllm")


class SamplingParamsError(UserError):
    """A bad sampling parameter; `param` names it (the server reports it in the OpenAI error body)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


@dataclass
class StructuredOutputsParams:
    """vLLM's `StructuredOutputsParams`: exactly one constraint on what the output may be. `json` is a JSON schema
    (dict or text), `regex` a regular expression the whole output matches, `choice` the allowed outputs, `grammar`
    a Lark or GBNF grammar, `json_object` any JSON object. JSON is compact unless `whitespace_pattern` says which
    whitespace may go between tokens (a small model given free whitespace can spend its whole budget on it)."""

    json: str | dict[str, Any] | bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    whitespace_pattern: str | None = None
    # The constraint starts once this text is in the output (the end of a reasoning section, "</think>": the
    # thinking before it is free, as vLLM's reasoning parsers have it); None: from the first token.
    reasoning_end: str | None = None

    def kind(self) -> str:
        """The one constraint set (its field name); SamplingParamsError if none or several are."""
        given = [
            k for k in ("json", "regex", "choice", "grammar", "json_object") if getattr(self, k) not in (None, False)
        ]
        if len(given) != 1:
            _fail(
                "structured_outputs",
                f"exactly one of json, regex, choice, grammar, json_object must be set, "
                f"got {', '.join(given) or 'none'}",
            )
        return given[0]

    @functools.cached_property
    def grammar_text(self) -> str:
        """The constraint as llguidance's grammar text: the key of the compiled-grammar cache (computed once)."""
        from llguidance import LLMatcher  # the grammar engine loads on first use
        from llguidance.gbnf_to_lark import gbnf_to_lark

        kind = self.kind()
        if kind == "regex":
            return LLMatcher.grammar_from_regex(_typed(self.regex, str, "regex"))
        if kind == "choice":
            choices = _typed(self.choice, list, "choice")
            if not choices or not all(isinstance(c, str) and c for c in choices):
                _fail("structured_outputs.choice", "must be a non-empty list of non-empty strings")
            return LLMatcher.grammar_from_lark("start: " + " | ".join(jsonlib.dumps(c) for c in choices))
        if kind == "grammar":
            text = _typed(self.grammar, str, "grammar")
            try:
                return LLMatcher.grammar_from_lark(gbnf_to_lark(text) if "::=" in text else text)
            except Exception as e:  # noqa: BLE001 - the GBNF converter's parse errors
                _fail("structured_outputs.grammar", f"not a valid GBNF grammar: {e}")
        schema = {"type": "object"} if kind == "json_object" else self.json
        if isinstance(schema, str):
            try:
                schema = jsonlib.loads(schema)
            except ValueError as e:
                _fail("structured_outputs.json", f"not valid JSON: {e}")
        if not isinstance(schema, (dict, bool)):
            _fail(f"structured_outputs.{kind}", f"a JSON schema must be an object, got {type(schema).__name__}")
        options: Any = {"whitespace_flexible": False, "whitespace_pattern": self.whitespace_pattern}
        try:
            return LLMatcher.grammar_from_json_schema(schema, overrides=options)  # type: ignore[arg-type]
        except ValueError as e:
            _fail(f"structured_outputs.{kind}", str(e))


@dataclass
class SamplingParams:
    """vLLM's names and defaults. temperature 0 is greedy; max_tokens None means 'up to max_model_len'; max_tokens 0
    computes the prompt only (scoring: pair it with prompt_logprobs)."""

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
    prompt_logprobs: int | None = None  # top-k logprobs per prompt token (0: only the token's own)
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before sampling
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None  # constrain the output (a grammar, in the sampler)
    bad_words: list[str] = field(default_factory=list)  # words never generated (vLLM's: each as its tokens)
    allowed_token_ids: list[int] | None = None  # only these tokens may be sampled
    # bad_words as token sequences, both with and without a leading space (the engine fills it from its tokenizer)
    bad_words_token_ids: list[list[int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.bad_words = list(self.bad_words or [])
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        self.validate()
        if 0 < self.temperature < MIN_TEMPERATURE:
            logger.warning(
                "temperature %g is below %g, which overflows float32 logits: using %g",
                self.temperature,
                MIN_TEMPERATURE,
                MIN_TEMPERATURE,
            )
            self.temperature = MIN_TEMPERATURE

    def validate(self) -> None:
        _check_numbers(self)
        _check_integers(self)
        _check_lists(self)
        if self.structured_outputs is not None:
            _check_structured(self.structured_outputs)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def for_sample(self, index: int) -> SamplingParams:
        """The params of the index-th of n parallel samples: one sample each, seeds kept distinct (and in range)."""
        seed = None if self.seed is None else (self.seed + index - SEED_RANGE[0]) % 2**64 + SEED_RANGE[0]
        return dataclasses.replace(self, n=1, seed=seed)


def _fail(param: str, message: str) -> NoReturn:
    raise SamplingParamsError(param, message)


def _number(p: SamplingParams, name: str, low: float, high: float | None, low_open: bool = False) -> None:
    value = getattr(p, name)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        _fail(name, f"must be a finite number, got {value!r}")
    if value < low or (low_open and value == low) or (high is not None and value > high):
        bounds = (
            f"{'>' if low_open else '>='} {low:g}"
            if high is None
            else (f"in {'(' if low_open else '['}{low:g}, {high:g}]")
        )
        _fail(name, f"must be {bounds}, got {value}")


def _integer(p: object, name: str, low: int, high: int, what: str = "") -> None:
    value = getattr(p, name)
    if not isinstance(value, int) or isinstance(value, bool):
        _fail(name, f"must be an integer, got {value!r}")
    if not low <= value <= high:
        _fail(name, what or f"must be between {low} and {high}, got {value}")


def _check_numbers(p: SamplingParams) -> None:
    _number(p, "temperature", 0, None)
    _number(p, "top_p", 0, 1, low_open=True)
    _number(p, "min_p", 0, 1)
    _number(p, "repetition_penalty", 0, None, low_open=True)
    _number(p, "presence_penalty", -2, 2)
    _number(p, "frequency_penalty", -2, 2)


def _check_integers(p: SamplingParams) -> None:
    _integer(p, "n", 1, MAX_N)
    _integer(p, "top_k", 0, INT32_MAX, f"must be -1 (off), 0 (off) or a positive integer below 2**31, got {p.top_k}")
    if p.seed is not None:
        _integer(p, "seed", *SEED_RANGE)
    if p.max_tokens is not None:
        _integer(p, "max_tokens", 0, INT32_MAX)
    _integer(p, "min_tokens", 0, INT32_MAX)
    if p.max_tokens is not None and p.min_tokens > p.max_tokens:
        _fail("min_tokens", f"must be <= max_tokens ({p.max_tokens}), got {p.min_tokens}")
    for name in ("logprobs", "prompt_logprobs"):
        if getattr(p, name) is not None:
            _integer(p, name, 0, MAX_LOGPROBS)


def _check_lists(p: SamplingParams) -> None:
    if not all(isinstance(s, str) and s for s in p.stop):
        _fail("stop", "must be non-empty strings")
    if not all(_token_id(t) for t in p.stop_token_ids):
        _fail("stop_token_ids", "must be non-negative integers below 2**31")
    if not all(isinstance(w, str) and w.strip() for w in p.bad_words):
        _fail("bad_words", "must be strings with something other than whitespace")
    if p.allowed_token_ids is not None and (
        not isinstance(p.allowed_token_ids, list)
        or not p.allowed_token_ids
        or not all(map(_token_id, p.allowed_token_ids))
    ):
        _fail("allowed_token_ids", "must be a non-empty list of non-negative integers below 2**31")
    if p.logit_bias is None:
        return
    if not isinstance(p.logit_bias, dict):
        _fail("logit_bias", f"must map token ids to numbers, got {type(p.logit_bias).__name__}")
    for token, bias in p.logit_bias.items():
        if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token <= INT32_MAX:
            _fail("logit_bias", f"keys must be token ids (non-negative integers), got {token!r}")
        if (
            not isinstance(bias, (int, float))
            or isinstance(bias, bool)
            or not math.isfinite(bias)
            or abs(bias) > MAX_LOGIT_BIAS
        ):
            _fail("logit_bias", f"values must be numbers in [-100, 100], got {bias!r} for token {token}")


def _token_id(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= INT32_MAX


def _typed(value: Any, kind: type, name: str) -> Any:
    if not isinstance(value, kind):
        _fail(f"structured_outputs.{name}", f"must be a {kind.__name__}, got {type(value).__name__}")
    return value


@functools.lru_cache(maxsize=256)
def grammar_error(grammar: str) -> str:
    """llguidance's reason a grammar does not compile ("" when it does); cached, so that the engine's second
    look at a request's params, and the same schema sent again, cost a lookup."""
    from llguidance import LLMatcher

    return LLMatcher.validate_grammar(grammar)


def _check_structured(so: StructuredOutputsParams) -> None:
    """The grammar compiles: a bad schema, regex or grammar is refused before anything is queued."""
    if not isinstance(so, StructuredOutputsParams):
        _fail("structured_outputs", f"must be a StructuredOutputsParams or a dict, got {type(so).__name__}")
    error = grammar_error(so.grammar_text)
    if error:
        _fail(f"structured_outputs.{so.kind()}", error.removeprefix("WARNING: "))


POOLING_TYPES = ("LAST", "MEAN", "CLS")


@dataclass
class PoolingParams:
    """vLLM's `PoolingParams` for an embedding request: the engine computes the prompt only (no sampling) and
    hands back one vector, the final hidden states pooled by `pooling_type` (LAST token, MEAN of all, or the
    first: CLS), cut to its first `dimensions` (Matryoshka) and then L2-normalized when `normalize`. Passed to
    `add_request` where a generation passes SamplingParams; the model's own rule is what the caller fills in
    (`engine/pooling.py` reads it from the checkpoint)."""

    pooling_type: str = "LAST"
    normalize: bool = True
    dimensions: int | None = None

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            _fail("pooling_type", f"must be one of {', '.join(POOLING_TYPES)}, got {self.pooling_type!r}")
        if self.dimensions is not None:
            _integer(self, "dimensions", 1, INT32_MAX)

    @property
    def n(self) -> int:
        """One output per request, as a SamplingParams of n=1 (what the async engine counts)."""
        return 1
