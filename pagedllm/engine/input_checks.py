"""What only the engine can check about a request: prompt token ids against the vocabulary, lengths against the
model, sampling token ids against the vocabulary. A refused request raises UserError before anything is queued."""

from __future__ import annotations

from pagedllm.errors import UserError
from pagedllm.model.tokenizer import Tokenizer
from pagedllm.sampling_params import SamplingParams, SamplingParamsError


def encode_prompt(prompt: str | list[int], tokenizer: Tokenizer, vocab_size: int, max_model_len: int) -> list[int]:
    """Token ids of a text or id prompt, checked against the vocabulary and max_model_len."""
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt)
    else:
        ids = list(prompt)
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in ids):
            raise UserError(f"prompt: token ids must be integers in [0, {vocab_size})")
    if not ids:
        raise UserError("prompt: is empty")
    if len(ids) >= max_model_len:
        raise UserError(
            f"prompt: {len(ids)} tokens is too long: the maximum model length is "
            f"{max_model_len} tokens, prompt and output together"
        )
    return ids


def check_params(params: SamplingParams, num_prompt_tokens: int, vocab_size: int, max_model_len: int) -> None:
    """SamplingParams' own checks, then token ids against the vocabulary and min_tokens against the room left."""
    params.validate()
    room = max_model_len - num_prompt_tokens
    if params.min_tokens > room:
        raise SamplingParamsError(
            "min_tokens",
            f"{params.min_tokens} tokens do not fit after a prompt of "
            f"{num_prompt_tokens} tokens: the maximum model length is {max_model_len}",
        )
    if params.logit_bias and max(params.logit_bias) >= vocab_size:
        raise SamplingParamsError("logit_bias", f"token id {max(params.logit_bias)} is not in [0, {vocab_size})")
    if params.allowed_token_ids and max(params.allowed_token_ids) >= vocab_size:
        raise SamplingParamsError(
            "allowed_token_ids", f"token id {max(params.allowed_token_ids)} is not in [0, {vocab_size})"
        )
    if params.stop_token_ids and max(params.stop_token_ids) >= vocab_size:
        raise SamplingParamsError(
            "stop_token_ids", f"token id {max(params.stop_token_ids)} is not in [0, {vocab_size})"
        )


def bad_words_token_ids(bad_words: list[str], tokenizer: Tokenizer) -> list[list[int]]:
    """Each bad word as the token sequences that write it, at the start of a text and after a space (vLLM's
    rule: the spaced form counts when it is a different first token and as many tokens)."""
    found: list[list[int]] = []
    for word in bad_words:
        plain = tokenizer.encode(word.lstrip())
        found.append(plain)
        spaced = tokenizer.encode(" " + word.lstrip())
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            found.append(spaced)
    return found
