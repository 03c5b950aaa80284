"""Retrieval + prompt layout in one object, for the CLI, the bench and the server's /v1/rag/chat/completions."""

from __future__ import annotations

import os
import time
from pathlib import Path

from pagedllm.rag.index import Hit, RagIndex
from pagedllm.rag.layout import LAYOUTS, Popularity, build_messages

POPULARITY_FILE = "popularity.json"


class RagPipeline:
    """`RagPipeline(index_dir).build_messages(question) -> (messages, hits)`.

    messages: OpenAI-style chat messages (system with instructions and, for canonical/popular, the context; the
    question last), ready for a chat template. hits: the retrieved chunks in the order they appear in the prompt.
    Thread-safe for concurrent callers (the popularity counter is locked; faiss search is read-only).

    popularity: "memory" (per pipeline object, the default), "persist" (read/written as popularity.json in the
    index folder) or a Popularity instance. kv_blend: the server's RAG route marks each retrieved passage as a
    reusable segment (engine/blend.py), so a passage's KV is reused in any order (default: off, as the server's
    --rag-kv-blend: an approximation of full prefill).
    """

    def __init__(
        self,
        index_dir: str | os.PathLike,
        top_k: int = 4,
        layout: str = "canonical",
        popularity: str | Popularity = "memory",
        embedding_url: str | None = None,
        kv_blend: bool = False,
    ):
        if layout not in LAYOUTS:
            from pagedllm.errors import UserError

            raise UserError(f"--layout must be one of {', '.join(LAYOUTS)}, not {layout!r}")
        self.index = RagIndex(index_dir, embedding_url)
        self.top_k = top_k
        self.kv_blend = kv_blend
        self.layout = layout
        if isinstance(popularity, Popularity):
            self.popularity = popularity
        elif popularity == "persist":
            self.popularity = Popularity(Path(index_dir) / POPULARITY_FILE)
        else:
            self.popularity = Popularity()
        self.last_retrieval_s = 0.0

    def retrieve(self, question: str, top_k: int | None = None) -> list[Hit]:
        t0 = time.perf_counter()
        hits = self.index.search(question, top_k or self.top_k)
        self.last_retrieval_s = time.perf_counter() - t0
        return hits

    def build_messages(
        self,
        question: str,
        top_k: int | None = None,
        layout: str | None = None,
        hits: list[Hit] | None = None,
        record: bool = True,
    ) -> tuple[list[dict], list[Hit]]:
        """Retrieve (unless `hits` is given), lay out, and count the retrieval for the popular layout."""
        if hits is None:
            hits = self.retrieve(question, top_k)
        if record:
            # recorded before ordering: +1 to every retrieved chunk leaves their relative order unchanged
            self.popularity.record([h.chunk_id for h in hits])
        return build_messages(question, hits, layout or self.layout, self.popularity)

    def save(self) -> None:
        self.popularity.save()
