"""RAG: chunking, ingest (and re-ingest doing no work), retrieval quality, prompt layouts on token ids, the CLI, and
the engine's prefix cache confirming the canonical layout's shared prefix."""

from __future__ import annotations

import json
import time

import pytest
from rag_eval_questions import EVAL_QUESTIONS
from server_helpers import assert_as_declared, sse_events

from pagedllm.rag.chunking import chunk_text
from pagedllm.rag.index import Hit
from pagedllm.rag.layout import LAYOUTS, Popularity, build_messages

# Distractors next to the answer topics: the statement chapter that repeats them ('compound'), the ones that
# overlap ('context-managers', 'naming', 'execmodel'), and every small topic.
HARD_DISTRACTORS = ["compound", "context-managers", "naming", "execmodel", "exceptions", "return", "booleans"]
SMALL_TOPICS = [
    "atom-identifiers",
    "atom-literals",
    "attribute-references",
    "bltin-code-objects",
    "bltin-ellipsis-object",
    "bltin-null-object",
    "bltin-type-objects",
    "callable-types",
    "conversions",
    "dict",
    "dynamic-features",
    "else",
    "exprlists",
    "floating",
    "id-classes",
    "imaginary",
    "in",
    "integers",
    "lists",
    "numbers",
    "power",
    "specialattrs",
    "typesfunctions",
    "typesmethods",
    "typesmodules",
    "unary",
]


@pytest.fixture(scope="session")
def tokenizer():
    from pagedllm.rag.tokens import get_tokenizer

    return get_tokenizer(None)


@pytest.fixture(scope="session")
def rag_index(tmp_path_factory):
    """The default corpus restricted to the answer topics plus ~35 distractor topics (the whole corpus takes over a
    minute to embed on two cores)."""
    from pagedllm.rag.corpus import default_corpus
    from pagedllm.rag.index import ingest

    topics = sorted({t for _, t in EVAL_QUESTIONS} | set(HARD_DISTRACTORS) | set(SMALL_TOPICS))
    d = tmp_path_factory.mktemp("rag-index")
    t0 = time.perf_counter()
    rep = ingest(default_corpus(topics), d, chunk_size=256, chunk_overlap=32, progress=False)
    print(f"\n[rag] ingested {len(topics)} topics, {rep.total_chunks} chunks in {time.perf_counter() - t0:.1f} s")
    assert rep.embedded and rep.changed == len(topics)
    return d


def _hit(i: int, text: str, source: str = "doc") -> Hit:
    from pagedllm.rag.chunking import chunk_id

    return Hit(chunk_id(source, text), source, source, i, 1.0 - i / 10, text, i)


# ---------------------------------------------------------------- chunking


def test_chunks_fit_token_budget_and_split_on_paragraphs(tokenizer):
    import pydoc_data.topics

    text = pydoc_data.topics.topics["try"]

    def count(s):
        return len(tokenizer.encode(s))

    chunks = chunk_text("try", "try", text, count, chunk_size=128, chunk_overlap=16)
    assert len(chunks) > 3
    for c in chunks:
        assert count(c.text) <= 128 + 8  # counted per piece: joining may merge or add a token or two
        assert c.text == c.text.strip() or c.text.startswith(" ")
    assert [c.position for c in chunks] == list(range(len(chunks)))
    assert len({c.chunk_id for c in chunks}) == len(chunks)
    # paragraphs are kept whole where they fit: every chunk starts at a paragraph or sentence start
    paragraphs = [p.strip() for p in text.split("\n\n") if p.strip()]
    assert sum(any(c.text.startswith(p[:30]) for p in paragraphs) for c in chunks) >= len(chunks) // 2
    # overlap: consecutive chunks share text, and all text is covered
    assert any(chunks[i + 1].text[:40] in chunks[i].text for i in range(len(chunks) - 1))
    again = chunk_text("try", "try", text, count, chunk_size=128, chunk_overlap=16)
    assert [c.chunk_id for c in again] == [c.chunk_id for c in chunks]  # stable ids


def test_long_sentence_is_cut(tokenizer):
    def count(s):
        return len(tokenizer.encode(s))

    text = "word " * 2000
    chunks = chunk_text("x", "x", text, count, chunk_size=64, chunk_overlap=0)
    assert len(chunks) > 10 and all(count(c.text) <= 72 for c in chunks)


# ---------------------------------------------------------------- ingest


def test_reingest_unchanged_does_no_work(tmp_path, monkeypatch):
    from pagedllm.rag import index as index_mod
    from pagedllm.rag.corpus import load_paths

    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.md").write_text("# Alpha\n\nPaged attention keeps the KV cache in fixed-size blocks.\n")
    (docs / "b.txt").write_text("Prefix caching shares the blocks of a common prompt prefix.\n")
    idx = tmp_path / "idx"
    rep = index_mod.ingest(load_paths([str(docs)]), idx, progress=False)
    assert rep.embedded and rep.changed == 2 and rep.total_chunks == 2
    stamps = {p.name: p.stat().st_mtime_ns for p in idx.iterdir()}

    def no_work(*a, **k):
        raise AssertionError("re-ingesting unchanged files must not load the tokenizer or the embedder")

    monkeypatch.setattr(index_mod, "get_embedder", no_work)
    monkeypatch.setattr("pagedllm.rag.tokens.get_tokenizer", no_work)
    rep = index_mod.ingest(load_paths([str(docs)]), idx, progress=False)
    assert not rep.embedded and rep.unchanged == 2 and rep.changed == 0 and rep.total_chunks == 2
    assert {p.name: p.stat().st_mtime_ns for p in idx.iterdir()} == stamps
    monkeypatch.undo()

    # a changed file is re-embedded alone; the other keeps its vector
    (docs / "b.txt").write_text("Prefix caching shares KV blocks between requests with the same prefix.\n")
    rep = index_mod.ingest(load_paths([str(docs)]), idx, progress=False)
    assert rep.embedded and rep.changed == 1 and rep.unchanged == 1 and rep.new_chunks == 1
    ix = index_mod.RagIndex(idx)
    assert len(ix) == 2
    assert ix.search("Which requests share KV blocks?", 1)[0].source.endswith("b.txt")


# ---------------------------------------------------------------- retrieval


def test_retrieval_source_in_top3(rag_index):
    from pagedllm.rag.index import RagIndex

    assert len(EVAL_QUESTIONS) >= 20
    ix = RagIndex(rag_index)
    results = ix.search_many([q for q, _ in EVAL_QUESTIONS], top_k=3)
    misses = [
        (q, t, [h.source for h in hits])
        for (q, t), hits in zip(EVAL_QUESTIONS, results)
        if t not in {h.source for h in hits}
    ]
    rate = 1 - len(misses) / len(EVAL_QUESTIONS)
    print(f"\n[rag] source in top 3: {rate:.0%}; misses: {misses}")
    assert rate >= 0.85, misses
    for hits in results:
        assert [h.rank for h in hits] == [0, 1, 2]
        assert hits[0].score >= hits[1].score >= hits[2].score


def test_cli_search_json(rag_index, capsys):
    from pagedllm.entrypoints.cli import main

    assert (
        main(["rag", "search", "What does the pass statement do?", "--index", str(rag_index), "--top-k", "3", "--json"])
        == 0
    )
    hits = json.loads(capsys.readouterr().out)
    assert len(hits) == 3 and hits[0]["source"] == "pass"
    assert {"source", "position", "score", "chunk_id", "text"} <= set(hits[0])


def test_cli_missing_index_is_user_error(tmp_path, capsys):
    from pagedllm.entrypoints.cli import main

    assert main(["rag", "search", "q", "--index", str(tmp_path / "nope")]) == 2
    assert "rag ingest" in capsys.readouterr().err


# ---------------------------------------------------------------- layouts


def _chunk_texts_in(messages: list[dict], hits: list[Hit]) -> list[str]:
    body = "\n".join(m["content"] for m in messages)
    return sorted(h.text.strip() for h in hits if h.text.strip() in body)


def test_layouts_give_the_same_chunks(rag_index):
    from pagedllm.rag.pipeline import RagPipeline

    pipe = RagPipeline(rag_index, top_k=4)
    hits = pipe.retrieve("How does the with statement call __enter__ and __exit__?")
    texts = {}
    for layout in LAYOUTS:
        messages, ordered = build_messages("How does the with statement work?", hits, layout, Popularity())
        assert sorted(h.chunk_id for h in ordered) == sorted(h.chunk_id for h in hits)
        texts[layout] = _chunk_texts_in(messages, hits)
        assert len(texts[layout]) == len(hits)
        assert messages[0]["role"] == "system"
    assert texts["naive"] == texts["canonical"] == texts["popular"]


def test_naive_is_score_order_canonical_is_id_order():
    hits = [_hit(i, f"Chunk number {i} about blocks.") for i in range(4)]
    _, naive = build_messages("q?", hits[::-1], "naive")
    assert [h.rank for h in naive] == [0, 1, 2, 3]
    _, canon = build_messages("q?", hits[::-1], "canonical")
    assert [h.chunk_id for h in canon] == sorted(h.chunk_id for h in hits)
    _, canon2 = build_messages("q?", hits, "canonical")
    assert [h.chunk_id for h in canon2] == [h.chunk_id for h in canon]


def test_popular_orders_by_retrieval_count(tmp_path):
    hits = [_hit(i, f"Popular chunk {i}.") for i in range(3)]
    pop = Popularity(tmp_path / "pop.json")
    pop.record([hits[2].chunk_id] * 3 + [hits[1].chunk_id])
    _, ordered = build_messages("q?", hits, "popular", pop)
    assert [h.chunk_id for h in ordered][:2] == [hits[2].chunk_id, hits[1].chunk_id]
    pop.save()
    again = Popularity(tmp_path / "pop.json")
    assert [h.chunk_id for h in again.order(hits)] == [h.chunk_id for h in ordered]


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@pytest.mark.parametrize("layout", ["canonical", "popular"])
def test_shared_prefix_is_all_but_the_question_on_token_ids(tokenizer, layout):
    hits = [_hit(i, f"Excerpt {i}: the with statement calls __enter__ and then __exit__ ({i}).") for i in range(4)]
    pop = Popularity()
    q1, q2 = "How does the with statement work?", "Why is __exit__ always called?"
    ids1 = tokenizer.apply_chat_template(build_messages(q1, hits, layout, pop)[0])
    ids2 = tokenizer.apply_chat_template(build_messages(q2, hits[::-1], layout, pop)[0])
    common = _common_prefix(ids1, ids2)
    # what differs is the question (plus at most the end-of-turn / assistant header, which follow it)
    assert len(ids1) - common <= len(tokenizer.encode(q1)) + 8
    assert len(ids2) - common <= len(tokenizer.encode(q2)) + 8
    # and the shared part holds every chunk
    shared = tokenizer.decode(ids1[:common])
    assert all(h.text in shared for h in hits)
    # the naive layout puts the question first: only the system prompt is shared
    n1 = tokenizer.apply_chat_template(build_messages(q1, hits, "naive")[0])
    n2 = tokenizer.apply_chat_template(build_messages(q2, hits, "naive")[0])
    assert _common_prefix(n1, n2) < common // 2


# ---------------------------------------------------------------- answering and the bench helpers


def test_stream_openai_parses_sse():
    import httpx

    from pagedllm.rag.answer import Answer, stream_openai

    seen = {}

    def handler(request):
        seen["url"] = str(request.url)
        seen["body"] = json.loads(request.content)
        events = [
            {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
            {"choices": [{"index": 0, "delta": {"content": "Hel"}}]},
            {"choices": [{"index": 0, "delta": {"content": "lo"}, "finish_reason": "stop"}]},
            {
                "choices": [],
                "usage": {"prompt_tokens": 50, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 32}},
            },
        ]
        body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        return httpx.Response(200, text=body, headers={"content-type": "text/event-stream"})

    client = httpx.Client(transport=httpx.MockTransport(handler))
    ans = Answer()
    msgs = [{"role": "user", "content": "hi"}]
    deltas = list(stream_openai("http://x:8000/v1", msgs, ans, model="m", client=client))
    assert deltas == ["Hel", "lo"] and ans.text == "Hello"
    assert (ans.prompt_tokens, ans.cached_tokens, ans.output_tokens, ans.finish_reason) == (50, 32, 2, "stop")
    assert seen["url"] == "http://x:8000/v1/chat/completions" and seen["body"]["stream"] is True


def test_zipf_workload_and_answer_check():
    from collections import Counter

    from pagedllm.rag.bench import check_answers
    from pagedllm.rag.workload import zipf_questions

    w = zipf_questions(200, seed=3)
    assert w == zipf_questions(200, seed=3) and w != zipf_questions(200, seed=4)
    counts = Counter(t for _, t in w).most_common()
    assert counts[0][1] >= 5 * counts[len(counts) // 2][1]  # skewed: the top topic repeats far more
    recs = [
        {"setting": "a", "question": "q", "prompt_token_ids": [1, 2], "answer": "x"},
        {"setting": "b", "question": "q", "prompt_token_ids": [1, 2], "answer": "x"},
        {"setting": "c", "question": "q", "prompt_token_ids": [2, 1], "answer": "y"},
        {"setting": "d", "question": "q", "prompt_token_ids": [2, 1], "answer": "z"},
    ]
    chk = check_answers(recs)
    assert chk["groups_compared"] == 2 and chk["groups_identical"] == 1
    assert chk["mismatches"][0]["settings"] == ["c", "d"]


# ---------------------------------------------------------------- the engine confirms it


@pytest.mark.slow
def test_engine_prefix_cache_serves_canonical_prefix(tokenizer):
    """Two questions with the same retrieved chunks: the engine reports the shared prefix as cached tokens."""
    import pydoc_data.topics

    from pagedllm.engine import EngineConfig, LLMEngine
    from pagedllm.rag.answer import Answer, stream_engine
    from pagedllm.sampling_params import SamplingParams

    def count(s):
        return len(tokenizer.encode(s))

    chunks = chunk_text("with", "with", pydoc_data.topics.topics["with"], count, chunk_size=96, chunk_overlap=0)
    hits = [Hit(c.chunk_id, c.source, c.title, c.position, 0.5, c.text, i) for i, c in enumerate(chunks[:2])]
    engine = LLMEngine(EngineConfig(dtype="float32", enable_prefix_caching=True, log_stats_interval=0))
    ids = []
    answers = []
    for q in ("How does the with statement work?", "When is __exit__ called?"):
        m, _ = build_messages(q, hits, "canonical")
        ids.append(engine.tokenizer.apply_chat_template(m))
        a = Answer()
        list(stream_engine(engine, ids[-1], SamplingParams(temperature=0.0, max_tokens=1), a))
        answers.append(a)
    common = _common_prefix(*ids)
    block = engine.stats().block_size
    assert common >= 128
    assert answers[0].cached_tokens == 0
    # everything shared, in whole blocks, is served from the cache
    assert common - block < answers[1].cached_tokens <= common


def test_bench_prompts_hook(rag_index, tokenizer):
    import pagedllm.rag as rag

    prompts = rag.bench_prompts(6, seed=1, store=str(rag_index), top_k=2)
    assert len(prompts) == 6 and all(p.rstrip().endswith("assistant") for p in prompts)
    with pytest.raises(Exception, match="rag ingest"):
        rag.bench_prompts(2, store=str(rag_index) + "-missing")


def test_count_cached_tokens_by_hand():
    from pagedllm.rag.bench import count_cached_tokens

    p1 = list(range(1, 11))  # 10 tokens = 2 full blocks of 4 + 2
    p2 = list(range(1, 9)) + [99, 100]  # shares p1's two full blocks
    p3 = list(p1)  # a repeat: all full blocks but never the last token, so (10 - 1) // 4 = 2 blocks
    p4 = [1, 2, 3, 5] + list(range(5, 11))  # differs inside the first block
    p5 = list(range(1, 5)) + [7, 7, 7, 7, 7]  # shares only the first block
    assert count_cached_tokens([p1, p2, p3, p4, p5], block_size=4) == [0, 8, 8, 0, 4]


def test_count_only_canonical_shares_more_than_naive(rag_index, capsys):
    """The counting mode on a real workload: canonical shares the chunks, naive only the system prompt."""
    from pagedllm.entrypoints.cli import main

    assert (
        main(
            [
                "rag",
                "bench",
                "--index",
                str(rag_index),
                "--count-only",
                "--num-questions",
                "24",
                "--top-k",
                "2",
                "--zipf",
                "1.5",
            ]
        )
        == 0
    )
    rows = {
        line.split()[0]: line.split()
        for line in capsys.readouterr().out.splitlines()
        if line.split() and line.split()[0] in ("naive", "canonical", "popular")
    }
    hit = {k: float(v[1].rstrip("%")) for k, v in rows.items()}
    assert set(hit) == {"naive", "canonical", "popular"}
    assert hit["canonical"] > hit["naive"] + 10 and hit["popular"] > hit["naive"] + 10


def test_damaged_index_is_rebuilt(tmp_path):
    from pagedllm.rag.corpus import load_paths
    from pagedllm.rag.index import RagIndex, ingest

    (tmp_path / "a.txt").write_text("Blocks hold sixteen tokens of keys and values.\n")
    idx = tmp_path / "idx"
    ingest(load_paths([str(tmp_path / "a.txt")]), idx, progress=False)
    (idx / "embeddings.npy").unlink()
    rep = ingest(load_paths([str(tmp_path / "a.txt")]), idx, progress=False)
    assert rep.embedded and rep.changed == 1 and len(RagIndex(idx)) == 1


def test_server_rag_chat_endpoint_names_chunks_and_hits_the_cache(rag_index, model_fp32):
    import httpx

    from pagedllm.engine import EngineConfig, LLMEngine
    from pagedllm.engine.async_engine import AsyncLLMEngine
    from pagedllm.rag import RagPipeline
    from pagedllm.server.api_server import Server, build_app
    from pagedllm.server.config import ServerConfig

    engine = AsyncLLMEngine(
        LLMEngine(EngineConfig(kv_cache_memory=64 * 2**20, max_model_len=2048, log_stats_interval=0), model_fp32)
    )
    app = build_app(
        engine, ServerConfig(served_model_name=["m"]), rag=RagPipeline(rag_index, top_k=2, layout="canonical")
    )
    srv = Server(app, host="127.0.0.1", port=0, log_level="warning")
    srv.start_in_thread()
    url = f"http://127.0.0.1:{srv.uvicorn.servers[0].sockets[0].getsockname()[1]}"
    body = {
        "model": "m",
        "max_tokens": 3,
        "temperature": 0,
        "messages": [{"role": "user", "content": "How does the with statement call __enter__ and __exit__?"}],
    }
    try:
        with httpx.Client(base_url=url, timeout=600) as c:
            spec = c.get("/openapi.json").json()
            r = c.post("/v1/rag/chat/completions", json=body)
            assert_as_declared(spec, "/v1/rag/chat/completions", "post", r)  # the answer is its declared model
            first = r.json()
            assert [h["source"] for h in first["rag"]["chunks"]][:2] and "with" in {
                h["source"] for h in first["rag"]["chunks"]
            }
            assert first["usage"]["prompt_tokens"] > 100 and first["choices"][0]["message"]["content"]
            second = c.post("/v1/rag/chat/completions", json=body).json()
            cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached >= second["usage"]["prompt_tokens"] - 16  # the same retrieved prompt: all but a block
            with c.stream("POST", "/v1/rag/chat/completions", json={**body, "stream": True}) as r:
                assert r.status_code == 200
                assert json.loads(r.headers["x-rag-chunks"]) == first["rag"]["chunks"]
                events = sse_events(r.iter_lines())
                assert "[DONE]" in events
            assert assert_as_declared(spec, "/v1/rag/chat/completions", "post", r, events) > 2
            bad = c.post("/v1/rag/chat/completions", json={**body, "messages": [{"role": "user", "content": " "}]})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages"
            # issue 38.7: the client cannot know the token spans of a prompt the server builds
            blend = c.post("/v1/rag/chat/completions", json={**body, "kv_blend": {"segments": [[0, 8]]}})
            assert blend.status_code == 400 and blend.json()["error"]["param"] == "kv_blend", blend.text
            assert c.get("/v1/kv").json()["used_blocks"] == 0
    finally:
        srv.stop()


def test_ask_lists_its_sources_best_match_first_and_samples_with_its_penalties(rag_index, monkeypatch, capsys):
    """issue 29.5: `rag ask` lists its sources in score order (best first), each with the number its excerpt has
    in the prompt (the layout's order, which the answer cites), and samples with its --repetition-penalty and
    --frequency-penalty (a one-off study, docs/benchmarks.md, measured which defaults stop the model looping)."""
    import re

    import pagedllm.rag.answer as generate
    from pagedllm.entrypoints.cli import main
    from pagedllm.entrypoints.rag import FREQUENCY_PENALTY, REPETITION_PENALTY
    from pagedllm.rag.pipeline import RagPipeline

    seen = {}

    def answer(engine, prompt_ids, params, ans, request_id=None):  # what the engine is asked, not its answer
        seen["params"] = params
        yield "An answer."

    monkeypatch.setattr(generate, "stream_engine", answer)
    question = "How does the with statement call __enter__ and __exit__?"
    assert main(["rag", "ask", question, "--index", str(rag_index), "--max-tokens", "8"]) == 0
    lines = capsys.readouterr().out.split("Sources (best match first):\n")[1].strip().splitlines()
    listed = [re.match(r"\s*\[(\d)\] (\S+) #\d+ \(score (\d\.\d+)", line).groups() for line in lines]  # type: ignore[union-attr]
    _, in_prompt = RagPipeline(rag_index).build_messages(question, record=False)
    assert [float(score) for _, _, score in listed] == sorted((round(h.score, 3) for h in in_prompt), reverse=True)
    assert [in_prompt[int(n) - 1].source for n, _, _ in listed] == [source for _, source, _ in listed]
    assert [int(n) for n, _, _ in listed] != [1, 2, 3, 4]  # this question's prompt order is not its score order
    params = seen["params"]
    assert (params.repetition_penalty, params.frequency_penalty) == (REPETITION_PENALTY, FREQUENCY_PENALTY)
    capsys.readouterr()
    argv = ["rag", "ask", question, "--index", str(rag_index), "--repetition-penalty", "1.2"]
    assert main([*argv, "--frequency-penalty", "0.5"]) == 0
    assert (seen["params"].repetition_penalty, seen["params"].frequency_penalty) == (1.2, 0.5)
