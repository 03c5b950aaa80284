"""The vector index on disk: a faiss IndexFlatIP over normalized embeddings (inner product = cosine), the chunks'
text and metadata (chunks.jsonl, one row per vector, in index order), the embeddings (embeddings.npy, so the index
can be rebuilt without re-embedding), and a manifest of each source's content hash (re-ingesting an unchanged
source does no work)."""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pagedllm.errors import UserError
from pagedllm.rag.chunking import Chunk, chunk_text
from pagedllm.rag.corpus import Document
from pagedllm.rag.embed import EMBED_MODEL_NAME, get_embedder

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
CHUNKS = "chunks.jsonl"
EMBEDDINGS = "embeddings.npy"
FAISS = "index.faiss"


@dataclass
class Hit:
    chunk_id: str
    source: str
    title: str
    position: int
    score: float
    text: str
    rank: int  # 0 = best score

    def to_dict(self, with_text: bool = True) -> dict:
        d = {
            "chunk_id": self.chunk_id,
            "source": self.source,
            "position": self.position,
            "score": round(self.score, 4),
            "rank": self.rank,
            "title": self.title,
        }
        if with_text:
            d["text"] = self.text
        return d


@dataclass
class IngestReport:
    documents: int = 0
    unchanged: int = 0
    changed: int = 0
    new_chunks: int = 0
    total_chunks: int = 0
    seconds: float = 0.0
    embedded: bool = False  # False: nothing was chunked, embedded or written
    details: dict = field(default_factory=dict)


def content_hash(doc: Document, settings: dict) -> str:
    h = hashlib.sha256()
    h.update(json.dumps(settings, sort_keys=True).encode())
    h.update(b"\0")
    h.update(doc.text.encode())
    return h.hexdigest()


def _embed_text(c: Chunk) -> str:
    # The title helps retrieval for chunks in the middle of a document ("The with statement").
    return c.text if c.position == 0 else f"{c.title}\n{c.text}"


def _atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)


def _embed(emb, chunks: list[Chunk], progress: bool) -> np.ndarray:
    """The chunks' embeddings, in batches of 64 (a progress bar counts chunks)."""
    from tqdm import tqdm

    if not chunks:
        return np.zeros((0, emb.dim), dtype=np.float32)
    texts = [_embed_text(c) for c in chunks]
    batches = []
    with tqdm(total=len(texts), desc="embedding", unit="chunk", disable=not progress) as bar:
        for i in range(0, len(texts), 64):
            batches.append(emb.encode(texts[i : i + 64]))
            bar.update(len(texts[i : i + 64]))
    return np.concatenate(batches)


def ingest(
    docs: list[Document],
    index_dir: str | os.PathLike,
    chunk_size: int = 256,
    chunk_overlap: int = 32,
    model: str | None = None,
    progress: bool = True,
    embedding_url: str | None = None,
) -> IngestReport:
    """Add or update documents in the index at `index_dir` (created if missing). Sources already in the index with
    the same content and settings are skipped; changed sources are re-chunked and re-embedded; other sources in the
    index are kept. `embedding_url`: embed with that server's /v1/embeddings (rag/embed.py)."""
    t0 = time.perf_counter()
    d = Path(index_dir)
    d.mkdir(parents=True, exist_ok=True)
    settings = {
        "chunk_size": chunk_size,
        "chunk_overlap": chunk_overlap,
        "tokenizer": model or "default",
        "embed_model": EMBED_MODEL_NAME,
        "format": FORMAT_VERSION,
    }
    manifest = _read_manifest(d)
    if manifest["sources"] and not _consistent(d, manifest):
        manifest = {"format": FORMAT_VERSION, "sources": {}}  # a damaged index: rebuild it from the documents
    check_embedder(manifest, EMBED_MODEL_NAME, str(d))
    sources = manifest["sources"]
    rep = IngestReport(documents=len(docs))
    hashed = [(doc, content_hash(doc, settings)) for doc in docs]
    todo = [(doc, h) for doc, h in hashed if sources.get(doc.source, {}).get("hash") != h]
    rep.changed, rep.unchanged = len(todo), len(docs) - len(todo)
    if not todo:  # nothing to do: no tokenizer, no model, no write
        rep.total_chunks = sum(len(s["chunk_ids"]) for s in sources.values())
        rep.seconds = time.perf_counter() - t0
        return rep

    old_chunks, old_vecs = _read_chunks(d), _read_embeddings(d)
    replaced = {doc.source for doc, _ in todo}
    keep = [i for i, c in enumerate(old_chunks) if c["source"] not in replaced]
    new_chunks = _chunk_all(todo, sources, model, chunk_size, chunk_overlap, progress)
    emb = get_embedder(embedding_url)
    vecs = _embed(emb, new_chunks, progress)
    manifest["embed_model"] = emb.name
    all_chunks = [old_chunks[i] for i in keep] + [c.to_dict() for c in new_chunks]
    kept_vecs = old_vecs[keep] if old_vecs is not None and len(keep) else np.zeros((0, emb.dim), np.float32)
    all_vecs = np.ascontiguousarray(np.concatenate([kept_vecs, vecs]), dtype=np.float32)
    _write_all(d, manifest, all_chunks, all_vecs)
    rep.new_chunks = len(new_chunks)
    rep.total_chunks = len(all_chunks)
    rep.embedded = True
    rep.seconds = time.perf_counter() - t0
    return rep


def _chunk_all(
    todo: list[tuple[Document, str]],
    sources: dict,
    model: str | None,
    chunk_size: int,
    chunk_overlap: int,
    progress: bool,
) -> list[Chunk]:
    """The changed documents' chunks, measured in the LLM's tokens; `sources` records each document's."""
    from tqdm import tqdm

    from pagedllm.rag.tokens import get_tokenizer

    tok = get_tokenizer(model)

    def count(s: str) -> int:
        return len(tok.encode(s))

    new_chunks: list[Chunk] = []
    for doc, h in tqdm(todo, desc="chunking", unit="doc", disable=not progress):
        try:
            cs = chunk_text(doc.source, doc.title, doc.text, count, chunk_size, chunk_overlap)
        except ValueError as e:
            raise UserError(f"--chunk-size / --chunk-overlap: {e}") from None
        new_chunks.extend(cs)
        sources[doc.source] = {"hash": h, "title": doc.title, "chunk_ids": [c.chunk_id for c in cs]}
    return new_chunks


def check_embedder(manifest: dict, name: str, where: str) -> None:
    """An index is searched only with the embedder that made it (an index from before the field: MiniLM's)."""
    made_by = manifest.get("embed_model", EMBED_MODEL_NAME)
    if made_by != name:
        raise UserError(f"--index {where}: embedded by {made_by!r}, not {name!r}; re-ingest it into a new --index")


def _read_manifest(d: Path) -> dict:
    p = d / MANIFEST
    if not p.exists():
        return {"format": FORMAT_VERSION, "sources": {}}
    m = json.loads(p.read_text())
    if m.get("format") != FORMAT_VERSION:
        return {"format": FORMAT_VERSION, "sources": {}}
    return m


def _consistent(d: Path, manifest: dict) -> bool:
    try:
        n = sum(1 for line in (d / CHUNKS).open(encoding="utf-8") if line.strip())
        vecs = np.load(d / EMBEDDINGS, mmap_mode="r")
    except (OSError, ValueError):
        return False
    expected = sum(len(s["chunk_ids"]) for s in manifest["sources"].values())
    return n == len(vecs) == expected and (d / FAISS).exists()


def _read_chunks(d: Path) -> list[dict]:
    p = d / CHUNKS
    if not p.exists():
        return []
    with p.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _read_embeddings(d: Path):
    p = d / EMBEDDINGS
    return np.load(p) if p.exists() else None


def _write_all(d: Path, manifest: dict, chunks: list[dict], vecs: np.ndarray) -> None:
    import faiss

    index = faiss.IndexFlatIP(vecs.shape[1])
    if len(vecs):
        index.add(vecs)

    def w_chunks(p: Path) -> None:
        with p.open("w", encoding="utf-8") as f:
            for c in chunks:
                f.write(json.dumps(c, ensure_ascii=False) + "\n")

    _atomic_write(d / CHUNKS, w_chunks)

    def w_vecs(p: Path) -> None:
        with p.open("wb") as f:
            np.save(f, vecs)

    _atomic_write(d / EMBEDDINGS, w_vecs)
    _atomic_write(d / FAISS, lambda p: faiss.write_index(index, str(p)))
    manifest["num_chunks"] = len(chunks)
    manifest["dim"] = int(vecs.shape[1])
    _atomic_write(d / MANIFEST, lambda p: None if p.write_text(json.dumps(manifest, indent=1)) else None)


class RagIndex:
    """A loaded index: `search(question, top_k) -> list[Hit]`."""

    def __init__(self, index_dir: str | os.PathLike, embedding_url: str | None = None):
        """`embedding_url`: questions are embedded by that server's /v1/embeddings (rag/embed.py)."""
        import faiss

        d = Path(index_dir)
        if not (d / FAISS).exists() or not (d / CHUNKS).exists():
            raise UserError(f"--index {index_dir}: no RAG index there (run `pagedllm rag ingest --index {index_dir}`)")
        self.dir = d
        self.index = faiss.read_index(str(d / FAISS))
        self.chunks = _read_chunks(d)
        if self.index.ntotal != len(self.chunks):
            raise UserError(f"--index {index_dir}: index and chunks.jsonl disagree; re-run ingest")
        self.by_id = {c["chunk_id"]: c for c in self.chunks}
        self.embedding_url = embedding_url
        self.embed_model = _read_manifest(d).get("embed_model", EMBED_MODEL_NAME)
        self._embedder = None

    def __len__(self) -> int:
        return len(self.chunks)

    @property
    def embedder(self):
        if self._embedder is None:
            emb = get_embedder(self.embedding_url)
            check_embedder({"embed_model": self.embed_model}, emb.name, str(self.dir))
            if emb.dim != self.index.d:
                raise UserError(f"--index {self.dir}: its vectors have {self.index.d} numbers, the embedder {emb.dim}")
            self._embedder = emb
        return self._embedder

    def search(self, question: str, top_k: int = 4) -> list[Hit]:
        return self.search_many([question], top_k)[0]

    def search_many(self, questions: list[str], top_k: int = 4) -> list[list[Hit]]:
        if top_k < 1:
            raise UserError("--top-k must be at least 1")
        if not questions:
            return []
        q = self.embedder.encode(questions)
        k = min(top_k, len(self.chunks))
        if k == 0:
            return [[] for _ in questions]
        scores, ids = self.index.search(q, k)
        out = []
        for srow, irow in zip(scores, ids):
            hits = []
            for rank, (s, i) in enumerate(zip(srow, irow)):  # k <= ntotal: faiss fills every slot (no -1)
                c = self.chunks[i]
                hits.append(
                    Hit(c["chunk_id"], c["source"], c.get("title", ""), c["position"], float(s), c["text"], rank)
                )
            out.append(hits)
        return out
