"""Request and response bodies of the OpenAI-compatible API (pydantic 2), with OpenAI's and vLLM's names.

Each request model checks what it can alone (types, ranges: a 400 that names the field) and turns itself into
`SamplingParams` with `to_sampling_params()`; checks that need the engine (the prompt's length against
max_model_len, token ids against the vocabulary, the model name) are the serving functions'. A field the engine
does not honour is refused with a 400 naming it, never accepted and ignored (`UNHONOURED`: vLLM's and OpenAI's
fields this server does not serve, unless sent with the value that asks for nothing); a field nobody defines is
ignored with one log line, as vLLM's server does. The response models are what the server sends, and what
/openapi.json says.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, field_validator, model_validator

from pagedllm.engine.stats import EngineStats
from pagedllm.sampling_params import MAX_LOGPROBS, SamplingParams, SamplingParamsError, StructuredOutputsParams

logger = logging.getLogger("pagedllm.server")

TokenId = Annotated[StrictInt, Field(ge=0, le=2**31 - 1)]  # StrictInt: `true` is not token 1
Role = Literal["system", "user", "assistant", "tool", "developer"]


def _lone_surrogate(value: Any) -> bool:
    """Whether the parsed JSON holds a lone UTF-16 surrogate (`"\\ud800"` is valid JSON but no text: the tokenizer
    and every UTF-8 encoder refuse it). Iterative: deep nesting must not cost recursion."""
    todo = [value]
    while todo:
        item = todo.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(item, dict):
            todo.extend(item.keys())
            todo.extend(item.values())
        elif isinstance(item, list):
            todo.extend(item)
    return False


def json_preview(value: Any) -> str:
    """A sent value, short, for an error message."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


# ------------------------------------------------------------------------------------------------ tools
NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolMode:
    """How the answer is made into tool calls: "named" (`name`), "required" or "auto" (tool_parsers/)."""

    kind: Literal["named", "required", "auto"]
    name: str | None = None


def check_tools(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Function name -> its parameters schema; ValueError ("tools: ...") for a tool OpenAI would refuse."""
    found: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise ValueError(f'tools: tools[{i}] must be {{"type": "function", "function": {{...}}}}')
        name = fn.get("name")
        if not isinstance(name, str) or not NAME.match(name):
            raise ValueError(f"tools: tools[{i}].function.name must be 1-64 letters, digits, _ or -, got {name!r}")
        if name in found:
            raise ValueError(f"tools: function {name!r} is defined twice")
        params = fn.get("parameters", EMPTY_PARAMETERS)
        if not isinstance(params, dict):
            raise ValueError(f"tools: tools[{i}].function.parameters must be a JSON schema object")
        found[name] = params
    return found


def tool_mode(tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None) -> ToolMode | None:
    """The constrained mode a request asks for, or None (no tools, or tool_choice "none"); ValueError naming the
    field for what cannot be served. "auto" (also tool_choice left out with tools) needs a template that renders
    tools or a --tool-call-parser: the caller checks that (`tool_parsers.auto_parser`)."""
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if tool_choice.get("type") != "function" or not isinstance(name, str):
            raise ValueError('tool_choice: a named choice is {"type": "function", "function": {"name": ...}}')
        if name not in check_tools(tools or []):
            raise ValueError(f"tool_choice: function {name!r} is not one of the request's tools")
        return ToolMode("named", name)
    if tool_choice not in (None, "none", "auto", "required"):
        raise ValueError(f'tool_choice: must be "none", "auto", "required" or a named function, got {tool_choice!r}')
    if not tools or tool_choice == "none":
        if tool_choice == "required":
            raise ValueError('tool_choice: "required" needs tools')
        return None
    check_tools(tools)
    return ToolMode("required" if tool_choice == "required" else "auto")


def tool_schema(tools: list[dict[str, Any]], mode: ToolMode, parallel: bool = True) -> dict[str, Any]:
    """The JSON schema the output is held to; `parallel` False (OpenAI's parallel_tool_calls) allows one call.
    For "required" each tool's parameters sit inside the array's schema, so their `$defs` (where pydantic puts
    nested models) move to its root, where their `#/$defs/...` references point (vLLM's way)."""
    params = check_tools(tools)
    if mode.name:
        return params[mode.name]
    defs: dict[str, Any] = {}
    items = []
    for n, p in params.items():
        own = p.get("$defs")
        if isinstance(own, dict):
            for key, value in own.items():
                if defs.setdefault(key, value) != value:
                    raise ValueError(f"tools: $defs {key!r} differs between two tools' parameters")
            p = {k: v for k, v in p.items() if k != "$defs"}
        items.append(
            {
                "type": "object",
                "properties": {"name": {"type": "string", "enum": [n]}, "parameters": p},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": items}, **({} if parallel else {"maxItems": 1})}
    return {**schema, "$defs": defs} if defs else schema


class OpenAIModel(BaseModel):
    # Infinity, NaN (and 1e400, which JSON parsing makes infinite) are 400s, never sampling parameters.
    model_config = ConfigDict(extra="allow", protected_namespaces=(), allow_inf_nan=False)


# vLLM's and OpenAI's request fields that pagedllm does not serve -> the values that ask for nothing (the
# defaults a client may send all the same); any other value is a 400 naming the field.
UNHONOURED: dict[str, tuple[Any, ...]] = {
    "use_beam_search": (None, False),
    "length_penalty": (None, 1, 1.0),
    "include_stop_str_in_output": (None, False),
    "spaces_between_special_tokens": (None, True),
    "return_tokens_as_token_ids": (None, False),
    "return_token_ids": (None, False),
    "add_special_tokens": (None, False),
    "logits_processors": (None, []),
    "documents": (None, []),
    "mm_processor_kwargs": (None, {}),
    "kv_transfer_params": (None, {}),
    "vllm_xargs": (None, {}),
    "prompt_embeds": (None,),
    "structural_tag": (None,),
    "thinking_token_budget": (None,),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "reasoning_effort": (None,),
    "web_search_options": (None,),
    "verbosity": (None,),
    "function_call": (None,),
    "service_tier": (None, "auto", "default"),
    "store": (None, False),
    "metadata": (None, {}),
    "prompt_cache_key": (None,),
}


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


class RequestModel(OpenAIModel):
    """A top-level request body."""

    @model_validator(mode="after")
    def _extra_fields(self) -> RequestModel:
        """A field of vLLM's or OpenAI's this server does not serve is a 400 naming it; one nobody defines is
        ignored with one log line (vLLM's way: a client's typo is seen in the log, not answered)."""
        unknown = []
        for key, value in (self.model_extra or {}).items():
            allowed = UNHONOURED.get(key)
            if allowed is None:
                unknown.append(key)
            elif not any(type(value) is type(a) and value == a for a in allowed if a is not None) and value is not None:
                raise ValueError(f"{key}: not supported by this server (got {json_preview(value)})")
        if unknown:
            logger.info("%s: ignoring fields nobody defines: %s", type(self).__name__, ", ".join(sorted(unknown)))
        return self

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        for key, value in data.items() if isinstance(data, dict) else ():
            if _lone_surrogate(key) or _lone_surrogate(value):
                raise ValueError(f"{key}: strings must be valid Unicode, not a lone surrogate (\\ud800-\\udfff)")
        return data


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


class CompletionRequest(SamplingRequest):
    prompt: list[TokenId] | list[list[TokenId]] | str | list[str]
    max_tokens: StrictInt | None = Field(16, ge=0, description="0: score the prompt only (with echo/logprobs)")
    echo: StrictBool = False
    logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: Literal[""] | None = Field(None, description="not supported (no fill-in-the-middle)")

    @model_validator(mode="after")
    def _check(self) -> CompletionRequest:
        if isinstance(self.prompt, list) and (not self.prompt or any(p == [] for p in self.prompt)):
            raise ValueError("prompt: must not be empty")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens: ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        return self

    def to_sampling_params(self, max_tokens: int | None) -> SamplingParams:
        """`max_tokens`: the request's, or (when it gave none) what is left of the context."""
        kw = self.sampling_kwargs()
        if self.echo and self.logprobs is not None:  # echo + logprobs: the prompt's tokens get logprobs too
            kw["prompt_logprobs"] = max(self.logprobs, kw.get("prompt_logprobs", 0))
        return self.make_params(self.constraint(), max_tokens=max_tokens, logprobs=self.logprobs, **kw)


class ChatMessage(OpenAIModel):
    role: Role
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

    def text(self) -> str:
        """The content as one string; only text parts (images, audio, files need a model that reads them)."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type", "text") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"messages: only text content parts are supported, got {part.get('type')!r}")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: StrictInt | None = Field(None, ge=0)
    max_completion_tokens: StrictInt | None = Field(None, ge=0)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool = True
    functions: list[dict[str, Any]] | None = None
    echo: StrictBool = False
    chat_template: str | None = Field(
        None, description="a Jinja chat template for this request (needs --trust-request-chat-template)"
    )
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description='more variables for the chat template, e.g. {"enable_thinking": false}'
    )

    @model_validator(mode="after")
    def _check(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: logprobs must be true when top_logprobs is set")
        limit = self.effective_max_tokens
        if limit is not None and self.min_tokens > limit:
            raise ValueError(f"min_tokens: ({self.min_tokens}) must be <= max_tokens ({limit})")
        if self.functions:
            raise ValueError("functions: the deprecated functions field is not supported; send tools")
        mode, constraint = self.tool_mode, self.constraint()
        if mode is not None and mode.kind != "auto" and constraint is not None:
            raise ValueError(f"tool_choice: a tool choice and {constraint[0]} cannot be combined")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError(
                "continue_final_message: cannot be combined with add_generation_prompt true (set it to false)"
            )
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise ValueError("continue_final_message: the last message must be the assistant's, to continue")
        check_template_kwargs(self.chat_template_kwargs)
        if self.echo:
            raise ValueError("echo: not supported for chat completions")
        return self

    @property
    def effective_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def tool_mode(self) -> ToolMode | None:
        return tool_mode(self.tools, self.tool_choice)

    @property
    def constraint_field(self) -> str | None:
        """ "tools" when the tools' schema is the constraint (tool_choice "required" or a named function)."""
        mode = self.tool_mode
        if mode is not None and mode.kind != "auto":
            return "tools"
        return super().constraint_field

    @property
    def top_k_logprobs(self) -> int | None:
        """Logprobs per generated token: None when not asked for, else how many alternatives."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def to_sampling_params(self, max_tokens: int | None) -> SamplingParams:
        mode, constraint = self.tool_mode, self.constraint()
        if mode is not None and mode.kind != "auto":
            schema = tool_schema(self.tools or [], mode, self.parallel_tool_calls)
            constraint = ("tools", StructuredOutputsParams(json=schema))
        return self.make_params(
            constraint, max_tokens=max_tokens, logprobs=self.top_k_logprobs, **self.sampling_kwargs()
        )


# What the server sets itself when it renders a chat (and transformers' own keywords): not a request's to set.
RESERVED_TEMPLATE_NAMES = frozenset(
    {
        "messages",
        "conversation",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
        "processor_kwargs",
    }
)


def check_template_kwargs(kwargs: dict[str, Any] | None) -> None:
    """chat_template_kwargs: template variables, never what the server sets itself (ValueError naming it)."""
    for key in kwargs or {}:
        if not key.isidentifier() or key in RESERVED_TEMPLATE_NAMES:
            raise ValueError(f"chat_template_kwargs: {key!r} cannot be set (not a template variable name)")


class TokenizeRequest(RequestModel):
    """vLLM's two forms in one body: a `prompt`, or chat `messages` rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_generation_prompt: StrictBool = True
    add_special_tokens: StrictBool | None = Field(None, description="default: true for a prompt, false for chat")
    return_token_strs: StrictBool = False
    continue_final_message: StrictBool = False
    chat_template: str | None = Field(None, description="as in chat completions (--trust-request-chat-template)")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="as in chat completions")

    @model_validator(mode="after")
    def _one_form(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("prompt: send either 'prompt' or 'messages'")
        check_template_kwargs(self.chat_template_kwargs)
        return self


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[TokenId]


# ------------------------------------------------------------------------------------------------ responses
class ResponseModel(BaseModel):
    """A body the server sends. Every answer is built from these, so /openapi.json is what goes out; a field
    they do not declare is a bug, refused when the answer is built."""

    model_config = ConfigDict(extra="forbid")

    def body(self) -> dict[str, Any]:
        """The JSON-ready body: the fields given (an optional field left out stays out, as OpenAI's)."""
        return self.model_dump(mode="json", exclude_unset=True)


class ErrorInfo(ResponseModel):
    message: str
    type: str
    param: str | None
    code: int


class ErrorResponse(ResponseModel):
    error: ErrorInfo


class AnthropicError(ResponseModel):
    type: str = Field(description="invalid_request_error, authentication_error, not_found_error, api_error, ...")
    message: str


class AnthropicErrorResponse(ResponseModel):
    """Anthropic's error body, on /v1/messages."""

    type: Literal["error"]
    error: AnthropicError


class PromptTokensDetails(ResponseModel):
    cached_tokens: int


class CompletionTokensDetails(ResponseModel):
    reasoning_tokens: int


class Usage(ResponseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = Field(None, description="not on a stream's running usage")
    completion_tokens_details: CompletionTokensDetails | None = Field(
        None, description="with --reasoning-parser: how many completion tokens were the thinking"
    )


class CompletionLogprobs(ResponseModel):
    text_offset: list[int]
    token_logprobs: list[float | None]
    tokens: list[str]
    top_logprobs: list[dict[str, float] | None]


class PromptLogprob(ResponseModel):
    logprob: float
    decoded_token: str


PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(ResponseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None
    prompt_logprobs: PromptLogprobs | None


class CompletionResponse(ResponseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    system_fingerprint: str | None


class CompletionStreamChoice(ResponseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None
    prompt_logprobs: PromptLogprobs | None = Field(None, description="on a choice's first chunk, when asked for")


class CompletionStreamResponse(ResponseModel):
    """One server-sent event of a streamed completion."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionStreamChoice]
    usage: Usage | None = Field(None, description="with stream_options.include_usage: null but on the last chunk")


class TopLogprob(ResponseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatLogprob(ResponseModel):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatChoiceLogprobs(ResponseModel):
    content: list[ChatLogprob]


class FunctionCall(ResponseModel):
    name: str
    arguments: str = Field(description="the arguments as the model wrote them (JSON text; check it)")


class ToolCall(ResponseModel):
    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatCompletionMessage(ResponseModel):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCall]
    reasoning_content: str | None = Field(None, description="with --reasoning-parser: the thinking (vLLM's)")


class ChatChoice(ResponseModel):
    index: int
    message: ChatCompletionMessage
    logprobs: ChatChoiceLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None


class ChatCompletionResponse(ResponseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None
    prompt_logprobs: PromptLogprobs | None


class DeltaFunctionCall(ResponseModel):
    name: str | None = Field(None, description="on a call's first delta")
    arguments: str


class DeltaToolCall(ResponseModel):
    """A call's first delta has its id, type and name (arguments ""); later ones pieces of its arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(ResponseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(ResponseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None = Field(None, description="not on the role's chunk")


class ChatCompletionStreamResponse(ResponseModel):
    """One server-sent event of a streamed chat completion."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = Field(None, description="with stream_options.include_usage: null but on the last chunk")


class RagChunk(ResponseModel):
    chunk_id: str
    source: str
    position: int
    score: float
    rank: int
    title: str


class RagInfo(ResponseModel):
    layout: str
    chunks: list[RagChunk]


class RagChatCompletionResponse(ChatCompletionResponse):
    rag: RagInfo = Field(description="the retrieved chunks the answer used, in the prompt's layout")


class TokenizeResponse(ResponseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None


class DetokenizeResponse(ResponseModel):
    prompt: str


class HealthResponse(ResponseModel):
    status: Literal["ok"]


class ClusterHealthResponse(HealthResponse):
    replicas: dict[str, str] = Field(description='each replica\'s state: "ok", or why not')


class ModelCard(ResponseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    parent: str | None
    max_model_len: int


class ModelList(ResponseModel):
    object: Literal["list"]
    data: list[ModelCard]


class KVPool(ResponseModel):
    """A block pool and its queues: one mapping of the engine's stats, for the server's /v1/kv and the cluster's
    (its totals and each replica's)."""

    block_size: int
    total_blocks: int
    free_blocks: int
    used_blocks: int
    cached_blocks: int
    kv_cache_usage: float
    num_running: int
    num_waiting: int
    prefix_cache_queries: int
    prefix_cache_hits: int

    @staticmethod
    def fields_of(st: EngineStats) -> dict[str, Any]:
        return {
            "block_size": st.block_size,
            "total_blocks": st.num_blocks,
            "free_blocks": st.num_free_blocks,
            "used_blocks": st.num_used_blocks,
            "cached_blocks": st.num_cached_blocks,
            "kv_cache_usage": st.kv_usage,
            "num_running": st.num_running,
            "num_waiting": st.num_waiting,
            "prefix_cache_queries": st.prefix_cache_queries,
            "prefix_cache_hits": st.prefix_cache_hits,
        }


class KVState(KVPool):
    model_name: str
    num_aborted: int
    recent_aborted_request_ids: list[str]


class ReplicaKV(KVPool):
    router_index_blocks: int | None = Field(description="what the router believes the replica caches")


class ClusterKVState(KVPool):
    routing: str | None
    routing_decisions: dict[str, int]
    replicas: dict[str, ReplicaKV]


def finite_logprob(value: float) -> float:
    """-inf (a token the model rules out) as vLLM sends it: JSON has no infinity."""
    return value if math.isfinite(value) else -9999.0
