"""Incremental detokenization: text grows token by token without ever ending in half a UTF-8 character.

Decoding each new token alone is wrong (SentencePiece/BPE merge spaces and bytes across tokens) and decoding
the whole output every step is quadratic. As in TGI and vLLM, decode a small window twice: the text of
tokens[prefix:read] and of tokens[prefix:]; the difference is the new text, held back while it ends in the
replacement character of an incomplete byte sequence.
"""

from __future__ import annotations

from pagedllm.model.tokenizer import Tokenizer

WINDOW = 6  # tokens of context before the new ones, enough for merges at the boundary


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = list(prompt_ids[-WINDOW:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def add(self, token_id: int) -> str:
        """Append one token; return the text it completed (possibly empty while a character is unfinished)."""
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        prefix_text = decode(self.ids[self.prefix_offset : self.read_offset], skip_special_tokens=self.skip)
        new_text = decode(self.ids[self.prefix_offset :], skip_special_tokens=self.skip)
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        delta = new_text[len(prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        if self.prefix_offset > 4 * WINDOW:  # keep the window small
            drop = self.prefix_offset
            self.ids = self.ids[drop:]
            self.prefix_offset, self.read_offset = 0, self.read_offset - drop
        self.text += delta
        return delta
