"""`rag --embedding-url`: an index embedded by a server's /v1/embeddings (`pagedllm serve --embedding-model
default`) is the in-process one, and searching either way gives the same hits; an index refuses an embedder
of another name."""

from __future__ import annotations

import json

import numpy as np
import pytest
from model_helpers import make_tiny_hf
from rag_eval_questions import EVAL_QUESTIONS
from server_helpers import KEY, running_server

from pagedllm.errors import UserError

TOPICS = sorted({t for _, t in EVAL_QUESTIONS})[:6]


@pytest.fixture(scope="module")
def embedding_server(tmp_path_factory, monkeypatch_module):
    """A server whose only embedding model is the bundled MiniLM (the generator: a tiny random model)."""
    from pagedllm.engine import EngineConfig, LLMEngine
    from pagedllm.engine.async_engine import AsyncLLMEngine
    from pagedllm.server.embedders import SentenceTransformerEmbedder

    folder = str(tmp_path_factory.mktemp("tiny"))
    make_tiny_hf("llama_gqa_tied", folder)
    core = LLMEngine(EngineConfig(model=folder, dtype="float32", kv_cache_memory=2**20, log_stats_interval=0))
    monkeypatch_module.setenv("PAGEDLLM_API_KEY", KEY)
    with running_server(AsyncLLMEngine(core), embedders=[SentenceTransformerEmbedder("default")]) as s:
        yield s


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def test_server_embedded_index_gives_the_in_process_hits(embedding_server, tmp_path):
    from pagedllm.rag.corpus import default_corpus
    from pagedllm.rag.index import RagIndex, ingest

    docs = default_corpus(TOPICS)
    url = embedding_server.base + "/v1"
    ingest(docs, tmp_path / "local", progress=False)
    ingest(docs, tmp_path / "remote", progress=False, embedding_url=url)
    local, remote = (np.load(tmp_path / d / "embeddings.npy") for d in ("local", "remote"))
    np.testing.assert_allclose(remote, local, atol=1e-5, rtol=0)
    questions = [q for q, t in EVAL_QUESTIONS if t in TOPICS]
    assert questions
    want = RagIndex(tmp_path / "local").search_many(questions, top_k=3)
    for index in (RagIndex(tmp_path / "local", url), RagIndex(tmp_path / "remote", url)):
        got = index.search_many(questions, top_k=3)
        assert [[h.chunk_id for h in hs] for hs in got] == [[h.chunk_id for h in hs] for hs in want]
        for g, w in zip(got, want):
            assert [h.score for h in g] == pytest.approx([h.score for h in w], abs=1e-5)


def test_an_index_refuses_another_embedder(embedding_server, tmp_path):
    from pagedllm.rag.corpus import default_corpus
    from pagedllm.rag.index import RagIndex, ingest

    docs = default_corpus(TOPICS[:1])
    ingest(docs, tmp_path, progress=False, embedding_url=embedding_server.base + "/v1")
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["embed_model"] == "all-MiniLM-L6-v2"
    manifest["embed_model"] = "some-other-model"
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(UserError, match="some-other-model"):
        RagIndex(tmp_path).search("What does the with statement do?")
    with pytest.raises(UserError, match="some-other-model"):
        ingest(docs, tmp_path, chunk_size=128, progress=False)


def test_a_bad_embedding_url_is_a_user_error(tmp_path):
    from pagedllm.rag.embed import RemoteEmbedder

    with pytest.raises(UserError, match="--embedding-url"):
        RemoteEmbedder("http://127.0.0.1:9/v1")
