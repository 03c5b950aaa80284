"""What every API's bodies share (pydantic 2): the request and response bases, usage and prompt logprobs.

A request model checks what it can alone (types, ranges: a 400 that names the field); checks that need the engine
(the prompt's length against max_model_len, token ids against the vocabulary, the model name) are the serving
functions'. A field the engine does not honour is refused with a 400 naming it, never accepted and ignored
(`UNHONOURED`: vLLM's and OpenAI's fields this server does not serve, unless sent with the value that asks for
nothing); a field nobody defines is ignored with one log line, as vLLM's server does. The response models are
what the server sends, and what /openapi.json says. Each API's own models are in its module: protocol_completion,
protocol_chat, protocol_tokenization, protocol_responses, protocol_messages, protocol_embedding, protocol_rag,
protocol_info; the sampling fields completions and chat share in protocol_sampling.
"""

from __future__ import annotations

import logging
import math
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt, model_validator

logger = logging.getLogger("pagedllm.server")

TokenId = Annotated[StrictInt, Field(ge=0, le=2**31 - 1)]  # StrictInt: `true` is not token 1


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


class ResponseModel(BaseModel):
    """A body the server sends. Every answer is built from these, so /openapi.json is what goes out; a field
    they do not declare is a bug, refused when the answer is built."""

    model_config = ConfigDict(extra="forbid")

    def body(self) -> dict[str, Any]:
        """The JSON-ready body: the fields given (an optional field left out stays out, as OpenAI's)."""
        return self.model_dump(mode="json", exclude_unset=True)


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


class PromptLogprob(ResponseModel):
    logprob: float
    decoded_token: str


PromptLogprobs = list[dict[str, PromptLogprob] | None]


def finite_logprob(value: float) -> float:
    """-inf (a token the model rules out) as vLLM sends it: JSON has no infinity."""
    return value if math.isfinite(value) else -9999.0
