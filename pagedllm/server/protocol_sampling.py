"""The sampling fields /v1/completions and /v1/chat/completions share, and their conversion to `SamplingParams`:
one structured-output constraint at most (response_format, structured_outputs or vLLM's older guided_*), whose
compile error names the field the client sent; pagedllm's `kv_blend` extension.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field, StrictBool, StrictFloat, StrictInt, field_validator, model_validator

from pagedllm.sampling_params import MAX_LOGPROBS, SamplingParams, SamplingParamsError, StructuredOutputsParams
from pagedllm.server.protocol import OpenAIModel, RequestModel, TokenId


class StreamOptions(OpenAIModel):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False


class JsonSchemaFormat(OpenAIModel):
    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] | bool = Field({}, alias="schema")  # `schema` would shadow pydantic's
    strict: StrictBool | None = None


class ResponseFormat(OpenAIModel):
    """OpenAI's: plain text, any JSON object, or JSON that follows a schema (held to it while decoding)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError('response_format: type json_schema needs a json_schema {"name", "schema"}')
        return self


class StructuredOutputsBody(OpenAIModel):
    """vLLM's `structured_outputs` field (its StructuredOutputsParams): exactly one constraint."""

    json_: str | dict[str, Any] | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: StrictBool | None = None
    whitespace_pattern: str | None = None
    structural_tag: Any = Field(None, description="not supported")

    def params(self) -> StructuredOutputsParams:
        if self.structural_tag is not None:
            raise ValueError("structured_outputs: structural_tag is not supported")
        return StructuredOutputsParams(
            json=self.json_,
            regex=self.regex,
            choice=self.choice,
            grammar=self.grammar,
            json_object=self.json_object,
            whitespace_pattern=self.whitespace_pattern,
        )


class KVBlend(OpenAIModel):
    """pagedllm's `kv_blend` extension: prompt token spans whose KV may be reused wherever they land (retrieved
    passages), and the share of their tokens computed again, spent on those nearest the question (engine/blend.py).
    Off when absent."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    segments: list[tuple[StrictInt, StrictInt]] = Field(
        ..., max_length=4096, description="[start, end) token spans of the prompt, in order, not overlapping"
    )
    recompute: StrictFloat | None = Field(
        None,
        ge=0,
        le=1,
        description="share of the reused spans' tokens recomputed, nearest the question first "
        "(default: --kv-blend-recompute)",
    )
    max_deviation: StrictFloat | None = Field(
        None,
        ge=0,
        le=1,
        description="the bound mode, in place of recompute: the tokens whose copied KV deviates most are recomputed "
        "until the measured deviation left is at most this (0: full prefill; default: --kv-blend-max-deviation)",
    )


class SamplingRequest(RequestModel):
    """The sampling parameters shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    n: StrictInt = Field(1, ge=1)
    best_of: StrictInt | None = Field(None, description="only n (or null): one sample is one choice")
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    stop: str | list[str] | None = None
    seed: StrictInt | None = Field(None, ge=-(2**63), le=2**64 - 1)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: dict[str, float] | None = Field(None, description="token id (as a string) -> bias in [-100, 100]")
    user: str | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsBody | None = None
    guided_json: str | dict[str, Any] | None = None  # vLLM's older names for structured_outputs
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = Field(None, description="accepted and ignored: llguidance serves all")
    # vLLM extras
    top_k: StrictInt | None = Field(None, ge=-1, le=2**31 - 1)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    ignore_eos: StrictBool = False
    min_tokens: StrictInt = Field(0, ge=0)
    stop_token_ids: list[TokenId] | None = None
    skip_special_tokens: StrictBool = True
    prompt_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    request_id: str | None = None
    bad_words: list[str] | None = Field(None, description="words never generated", max_length=256)
    allowed_token_ids: list[TokenId] | None = Field(None, description="only these tokens may be sampled")
    truncate_prompt_tokens: StrictInt | None = Field(
        None, ge=-1, description="keep only the prompt's last k tokens (-1: as many as max_model_len allows)"
    )
    priority: StrictInt = Field(
        0, ge=-(2**31), le=2**31 - 1, description="lower first, with --scheduling-policy priority"
    )
    cache_salt: str | None = Field(
        None, min_length=1, description="prefix-cache blocks are shared only between requests of the same salt"
    )
    safety_identifier: str | None = Field(None, description="accepted, as user: nothing is done with it")
    kv_blend: KVBlend | None = Field(
        None, description="pagedllm extension: reuse the KV of these prompt spans wherever they land (RAG passages)"
    )

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for key in bias or {}:
            if not (key.isascii() and key.isdigit()) or len(key) > 10:  # isdigit() alone takes '²' and '١٢'
                raise ValueError(f"keys must be token ids (non-negative integers as strings), got {key!r}")
        return bias

    @model_validator(mode="after")
    def _check_common(self) -> SamplingRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: can only be set when stream is true")
        if isinstance(self.stop, list) and len(self.stop) > 16:
            raise ValueError("stop: at most 16 stop strings")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of: only best_of == n is supported (got best_of {self.best_of}, n {self.n})")
        if self.allowed_token_ids == []:
            raise ValueError("allowed_token_ids: must not be empty")
        if self.truncate_prompt_tokens == 0:
            raise ValueError("truncate_prompt_tokens: must be -1 or at least 1")
        self.constraint()  # one constraint at most, each well-formed
        return self

    def constraint(self) -> tuple[str, StructuredOutputsParams] | None:
        """The structured-output constraint asked for, and the field that asked (errors name it)."""
        found = []
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            found.append(("response_format", StructuredOutputsParams(json_object=True)))
        elif fmt is not None and fmt.type == "json_schema" and fmt.json_schema is not None:
            found.append(("response_format", StructuredOutputsParams(json=fmt.json_schema.json_schema)))
        if self.structured_outputs is not None:
            found.append(("structured_outputs", self.structured_outputs.params()))
        guided = {
            "json": self.guided_json,
            "regex": self.guided_regex,
            "choice": self.guided_choice,
            "grammar": self.guided_grammar,
        }
        for kind, value in guided.items():
            if value is not None:
                so = StructuredOutputsParams(whitespace_pattern=self.guided_whitespace_pattern)
                setattr(so, kind, value)
                found.append((f"guided_{kind}", so))
        if len(found) > 1:
            raise ValueError(
                f"{found[1][0]}: only one structured-output constraint per request, got "
                f"{' and '.join(name for name, _ in found)}"
            )
        return found[0] if found else None

    @property
    def constraint_field(self) -> str | None:
        """The request field the constraint came from: an error met while decoding under it names that field,
        as one met while compiling it does."""
        found = self.constraint()
        return found[0] if found else None

    def sampling_kwargs(self) -> dict[str, Any]:
        """The fields that map one to one onto SamplingParams; None means the engine's default."""
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        bias = {int(k): min(100.0, max(-100.0, v)) for k, v in self.logit_bias.items()} if self.logit_bias else None
        given = {
            "n": self.n,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
            "seed": self.seed,
            "stop": stop,
            "stop_token_ids": self.stop_token_ids,
            "logit_bias": bias,
            "prompt_logprobs": self.prompt_logprobs,
            "bad_words": self.bad_words,
            "allowed_token_ids": self.allowed_token_ids,
        }
        kw = {k: v for k, v in given.items() if v is not None}
        kw.update(
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            skip_special_tokens=self.skip_special_tokens,
        )
        return kw

    def make_params(self, constraint: tuple[str, StructuredOutputsParams] | None, **kw: Any) -> SamplingParams:
        """SamplingParams with the constraint; a schema, regex or grammar that does not compile is a 400 naming
        the field the client sent (response_format, structured_outputs, guided_json, tools)."""
        field_name, so = constraint or (None, None)
        try:
            return SamplingParams(structured_outputs=so, **kw)
        except SamplingParamsError as e:
            if field_name is None or not e.param.startswith("structured_outputs"):
                raise
            reason = str(e).split(": ", 1)[1]
            raise SamplingParamsError(field_name, f"{_FIELD_WHAT[field_name]} is not usable: {reason}") from None


_FIELD_WHAT = {
    "response_format": "the JSON schema",
    "structured_outputs": "the constraint",
    "tools": "the tools' parameters schema",
    "guided_json": "the JSON schema",
    "guided_regex": "the regex",
    "guided_choice": "the choices",
    "guided_grammar": "the grammar",
}
