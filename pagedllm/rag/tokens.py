"""The LLM tokenizer RAG measures chunks in and builds prompts with (cached per model)."""

from __future__ import annotations

import functools


@functools.lru_cache(maxsize=4)
def get_tokenizer(model: str | None = None):
    from pagedllm.model import load_tokenizer

    return load_tokenizer(model)
