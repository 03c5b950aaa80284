"""Prompt layouts for retrieved chunks, and what each does to the prefix cache.

All layouts give the model the same chunks and the same instructions; only the order of the chunks and the place
of the question change:

- `naive`: the usual tutorial layout: the question first, then the chunks in retrieval-score order. Two prompts
  share only the system prompt.
- `canonical`: the system prompt and instructions, then the chunks sorted by their stable chunk id, all in the
  system message; the question alone in the user message, at the very end. Two questions that retrieve the same
  chunks share every token but the question's (the system message ends in a special token, so templating cannot
  merge the context's last token with the question's first).
- `popular`: like canonical, but the chunks ordered by how often they have been retrieved so far (most popular
  first, ties by chunk id), so that different questions whose retrieved sets overlap in the popular chunks share
  the longest possible prefix (the knowledge-tree idea of RAGCache).
"""

from __future__ import annotations

import json
import os
import threading
import typing
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from pagedllm.errors import UserError
from pagedllm.rag.index import Hit

Layout = Literal["naive", "canonical", "popular"]
LAYOUTS: tuple[str, ...] = typing.get_args(Layout)
LAYOUT_HELP = (
    "the prompt's layout: naive (the question, then the chunks by score: prompts share only the system prompt), "
    "canonical (the chunks by id, then the question last: questions that retrieve the same chunks share all but "
    "the question in the prefix cache) or popular (the most retrieved chunks first: overlapping retrievals share "
    "longer prefixes)"
)

SYSTEM_PROMPT = (
    "You are a helpful assistant that answers questions about the Python programming language. "
    "Use the numbered reference excerpts below from the Python documentation. Answer concisely and accurately; "
    "if the excerpts do not contain the answer, say so."
)


class Popularity:
    """How often each chunk has been retrieved: in memory (per session), or persisted as JSON at `path`."""

    def __init__(self, path: str | os.PathLike | None = None):
        self.path = Path(path) if path else None
        self.counts: Counter[str] = Counter()
        self._lock = threading.Lock()
        if self.path and self.path.exists():
            try:
                self.counts.update(json.loads(self.path.read_text()))
            except (ValueError, OSError):
                pass  # a broken counts file only costs cache hits

    def record(self, chunk_ids: Sequence[str]) -> None:
        with self._lock:
            self.counts.update(chunk_ids)

    def save(self) -> None:
        if self.path is None:
            return
        with self._lock:
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text(json.dumps(dict(self.counts)))
            os.replace(tmp, self.path)

    def order(self, hits: Sequence[Hit]) -> list[Hit]:
        with self._lock:
            return sorted(hits, key=lambda h: (-self.counts.get(h.chunk_id, 0), h.chunk_id))


def format_chunk(i: int, h: Hit) -> str:
    return f"[{i}] {passage_text(h)}"


def passage_text(h: Hit) -> str:
    """A chunk as the prompt shows it, without its number: the part that is the same wherever it lands, and so
    the reusable segment (kv_blend) of every prompt that holds it."""
    return f"(source: {h.source})\n{h.text.strip()}"


def segmented_prompt(tokenizer, messages: list[dict], hits: Sequence[Hit]) -> tuple[list[int], list[tuple[int, int]]]:
    """The prompt's token ids with each retrieved passage's [start, end) token span (the engine's kv_segments).

    The rendered chat text is tokenized piece by piece, each passage on its own, so a passage has the same
    tokens wherever it lands (a tokenizer merging across its first or last character would otherwise give it
    other tokens, and another segment key, in another order). `hits` in prompt order."""
    text = tokenizer.apply_chat_template_text(messages)
    ids: list[int] = []
    spans: list[tuple[int, int]] = []
    cursor = 0
    for h in hits:
        piece = passage_text(h)
        at = text.find(piece, cursor)
        if at < 0:
            raise ValueError(f"passage {h.chunk_id} is not in the rendered prompt")
        ids += tokenizer.encode(text[cursor:at])
        spans.append((len(ids), len(ids) + len(tokenizer.encode(piece))))
        ids += tokenizer.encode(piece)
        cursor = at + len(piece)
    return ids + tokenizer.encode(text[cursor:]), spans


def format_context(hits: Sequence[Hit]) -> str:
    return "\n\n".join(format_chunk(i + 1, h) for i, h in enumerate(hits))


def order_hits(hits: Sequence[Hit], layout: str, popularity: Popularity | None = None) -> list[Hit]:
    if layout == "naive":
        return sorted(hits, key=lambda h: h.rank)
    if layout == "canonical":
        return sorted(hits, key=lambda h: h.chunk_id)
    if layout == "popular":
        return (popularity or Popularity()).order(hits)
    raise UserError(f"--layout must be one of {', '.join(LAYOUTS)}, not {layout!r}")


def build_messages(
    question: str, hits: Sequence[Hit], layout: str = "canonical", popularity: Popularity | None = None
) -> tuple[list[dict], list[Hit]]:
    """Chat messages for `question` with the retrieved `hits`; returns them with the hits in prompt order."""
    ordered = order_hits(hits, layout, popularity)
    return messages_in_order(question, ordered, layout), ordered


def messages_in_order(question: str, ordered: Sequence[Hit], layout: str = "canonical") -> list[dict]:
    """The chat messages of `build_messages` with the chunks in the order given (rag bench's shuffled orders)."""
    question = question.strip()
    if not question:
        raise UserError("the question is empty")
    context = format_context(ordered)
    if layout == "naive":
        messages = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": f"Question: {question}\n\nReference excerpts:\n\n{context}"},
        ]
    else:
        messages = [
            {"role": "system", "content": f"{SYSTEM_PROMPT}\n\nReference excerpts:\n\n{context}"},
            {"role": "user", "content": question},
        ]
    return messages
