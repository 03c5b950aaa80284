"""The tokenizer the benchmark counts tokens with: pagedllm's own when it is there, else transformers'.

Everything the benchmark needs is `encode(text) -> list[int]` (no special tokens added), `decode(ids) -> str`,
`vocab_size` and `special_ids` (ids never sampled when building random prompts).
"""
from __future__ import annotations

import functools
import os
from typing import Any, Protocol

from pagedllm.errors import UserError


class BenchTokenizer(Protocol):
    vocab_size: int
    special_ids: frozenset[int]

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class _Adapter:
    """Wraps a pagedllm Tokenizer or a transformers tokenizer behind the small interface above."""

    def __init__(self, tok: Any, hf: bool):
        self._tok = tok
        self._hf = hf
        inner = getattr(tok, "hf", None) or getattr(tok, "hf_tokenizer", None) or tok
        size = None
        for obj in (tok, inner):
            for name in ("vocab_size",):
                v = getattr(obj, name, None)
                if isinstance(v, int) and v > 0:
                    size = v if size is None else max(size, v)
            try:
                size = max(size or 0, len(obj))  # transformers: len() includes added tokens
            except TypeError:
                pass
        if not size:
            raise UserError("the tokenizer does not say its vocabulary size")
        self.vocab_size = int(size)
        specials: set[int] = set()
        for obj in (tok, inner):
            for name in ("all_special_ids", "special_ids", "special_token_ids"):
                v = getattr(obj, name, None)
                if v:
                    specials.update(int(i) for i in v)
            for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
                v = getattr(obj, name, None)
                if isinstance(v, int):
                    specials.add(v)
                elif isinstance(v, (list, tuple, set)):
                    specials.update(int(i) for i in v)
        added = getattr(inner, "added_tokens_decoder", None)
        if isinstance(added, dict):
            specials.update(int(i) for i, t in added.items() if getattr(t, "special", True))
        self.special_ids = frozenset(specials)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))  # both tokenizers take the flag

    def decode(self, ids: list[int]) -> str:
        if self._hf:
            return self._tok.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)
        return self._tok.decode(list(ids))


def _load_hf(path: str | None) -> Any:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer
    if path is None:
        from pagedllm.model import default_model_path

        path = default_model_path()
    try:
        if os.path.isfile(path) and path.endswith(".gguf"):
            return AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(path)), gguf_file=os.path.basename(path))
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - any load failure is a bad --tokenizer
        raise UserError(f"--tokenizer: cannot load a tokenizer from {path!r}: {e}") from e


@functools.lru_cache(maxsize=4)
def load_bench_tokenizer(path: str | None = None) -> BenchTokenizer:
    """`path`: a GGUF file, an HF folder or hub name; None = the default model's tokenizer."""
    from pagedllm.model import load_tokenizer  # the project's own (fast) tokenizer

    try:
        return _Adapter(load_tokenizer(path), hf=False)
    except UserError:  # a path it does not read (a hub name, a folder without tokenizer.json): transformers'
        return _Adapter(_load_hf(path), hf=True)
