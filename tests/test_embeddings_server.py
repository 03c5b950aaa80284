"""POST /v1/embeddings: the bundled all-MiniLM-L6-v2 equal to sentence-transformers within 1e-5 (strings, a list,
token ids, base64 through the openai SDK), a tiny decoder pooled as its sentence-transformers files say equal to
transformers' hidden states, OpenAI's errors for bad input, and every KV block back after, aborts included."""

from __future__ import annotations

import base64
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from model_helpers import make_tiny_hf
from server_helpers import AUTH, HANG_S, KEY, StepHold, assert_error, assert_pool_whole, kv, running_server

TEXTS = ["The cat sat on the mat.", "Paris is the capital of France.", "été 你好 !"]
MINILM = "all-MiniLM-L6-v2"
DECODER = "tiny-embed"
MAX_MODEL_LEN = 64
MAX_EMBEDDING_TOKENS = 2000  # the server's --max-embedding-tokens


@pytest.fixture(scope="module")
def minilm():
    from pagedllm.server.embedders import SentenceTransformerEmbedder

    return SentenceTransformerEmbedder("default")


@pytest.fixture(scope="module")
def reference():
    """sentence-transformers itself, loaded apart from the server's copy."""
    from sentence_transformers import SentenceTransformer

    from pagedllm.rag.embed import embed_model_path

    return SentenceTransformer(embed_model_path(), device="cpu")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A random Qwen2-shaped decoder saved with sentence-transformers' files: mean pooling, then Normalize."""
    folder = tmp_path_factory.mktemp("tiny_embed")
    hf = make_tiny_hf("qwen2_bias", str(folder))
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    return str(folder), hf


@pytest.fixture(scope="module")
def server(tiny, minilm):
    """`pagedllm serve TINY --runner pooling --embedding-model default`, in this process."""
    from pagedllm.engine import EngineConfig, LLMEngine
    from pagedllm.engine.async_engine import AsyncLLMEngine
    from pagedllm.engine.pooling import read_pooler_config

    folder, _ = tiny
    config = EngineConfig(
        model=folder,
        dtype="float32",
        kv_cache_memory=2**20,
        block_size=4,
        max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=8,
        log_stats_interval=0,
    )
    engine = AsyncLLMEngine(LLMEngine(config), max_waiting_requests=64)
    app_args = dict(
        pooler=read_pooler_config(folder),
        embedders=[minilm],
        runner="pooling",
        max_embedding_tokens=MAX_EMBEDDING_TOKENS,
    )
    with running_server(engine, served_model_name=[DECODER], **app_args) as s:
        yield s


def _embed(s, **body):
    r = s.http.post("/v1/embeddings", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _vectors(answer) -> np.ndarray:
    assert [d["index"] for d in answer["data"]] == list(range(len(answer["data"])))
    assert all(d["object"] == "embedding" for d in answer["data"]) and answer["object"] == "list"
    return np.array([d["embedding"] for d in answer["data"]], dtype=np.float32)


def test_minilm_equals_sentence_transformers(server, reference):
    want = reference.encode(TEXTS, convert_to_numpy=True)
    got = _embed(server, model=MINILM, input=TEXTS)
    np.testing.assert_allclose(_vectors(got), want, atol=1e-5, rtol=0)
    one = _embed(server, model=MINILM, input=TEXTS[0])
    np.testing.assert_allclose(_vectors(one)[0], want[0], atol=1e-5, rtol=0)
    ids = [reference.tokenizer(t)["input_ids"] for t in TEXTS]
    assert got["usage"] == {"prompt_tokens": sum(map(len, ids)), "total_tokens": sum(map(len, ids))}
    by_ids = _embed(server, model=MINILM, input=ids)
    np.testing.assert_allclose(_vectors(by_ids), want, atol=1e-5, rtol=0)
    raw = _embed(server, model=MINILM, input=TEXTS, encoding_format="base64")["data"]
    decoded = np.stack([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in raw])
    np.testing.assert_allclose(decoded, want, atol=1e-5, rtol=0)


def test_openai_sdk_reads_the_vectors(server, reference):
    """The SDK asks for base64 by default and decodes it itself."""
    import openai

    client = openai.OpenAI(base_url=server.base + "/v1", api_key=KEY)
    res = client.embeddings.create(model=MINILM, input=TEXTS)
    got = np.array([d.embedding for d in res.data], dtype=np.float32)
    np.testing.assert_allclose(got, reference.encode(TEXTS, convert_to_numpy=True), atol=1e-5, rtol=0)
    assert res.model == MINILM


@torch.inference_mode()
def _mean_normalized(hf, ids: list[int]) -> np.ndarray:
    h = hf.model(torch.tensor([ids])).last_hidden_state[0].float().mean(0)
    return torch.nn.functional.normalize(h, dim=0).numpy()


def test_decoder_pooled_by_the_engine_equals_transformers(server, tiny):
    _, hf = tiny
    ids = [[5, 9, 33, 7, 100, 12, 3, 44, 45, 46, 47, 48, 49, 50], [8, 8]]  # the first: two chunks
    for body_input, want_ids in ((ids, ids), (ids[0], ids[:1])):
        got = _vectors(_embed(server, model=DECODER, input=body_input))
        want = np.stack([_mean_normalized(hf, i) for i in want_ids])
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    assert_pool_whole(server)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": []}, "input"),
        ({"input": [[]]}, "input"),
        ({"input": [""]}, "input"),
        ({"input": [1, "a"]}, "input"),
        ({"input": 5}, "input"),
        ({"input": [-1]}, "input"),
        ({"input": [[3] * (MAX_MODEL_LEN + 1)]}, "input"),
        ({"input": [[300]]}, "input"),  # beyond the tiny vocabulary
        ({"input": [[3]] * 65}, "input"),  # more than --max-waiting-requests 64 at once
        ({"input": "a", "dimensions": 8}, "dimensions"),
        ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(server, body, param):
    r = server.http.post("/v1/embeddings", json={"model": DECODER, **body})
    assert_error(r, 400, param)


@pytest.mark.parametrize("model", [MINILM, DECODER])
@pytest.mark.parametrize("ids", [[30522], [999999999], [[1, 2], [40000]], [[5], [2**31 - 1]]])
def test_a_token_id_outside_the_vocabulary_is_a_400_naming_input(server, model, ids):
    """Issue 38.1: an id past the embedding table (MiniLM's has 30522 rows) was a 500 IndexError."""
    r = server.http.post("/v1/embeddings", json={"model": model, "input": ids})
    assert_error(r, 400, "input", ["out of range"])
    assert_pool_whole(server)


def test_a_request_over_the_token_budget_is_a_400_naming_input(server):
    """Issue 38.3: all of a request's inputs together are at most --max-embedding-tokens, after truncation,
    for either model; one at the budget is served."""
    for model, ids in ((MINILM, [101] + [1000] * 198 + [102]), (DECODER, list(range(3, MAX_MODEL_LEN + 2)))):
        n = MAX_EMBEDDING_TOKENS // len(ids) + 1
        r = server.http.post("/v1/embeddings", json={"model": model, "input": [ids] * n})
        assert_error(r, 400, "input", ["--max-embedding-tokens"])
        assert len(_embed(server, model=model, input=[ids] * (n - 1))["data"]) == n - 1
    texts = ["word " * 400] * 9  # 9 x 256 tokens once cut to what MiniLM takes
    r = server.http.post("/v1/embeddings", json={"model": MINILM, "input": texts, "truncate_prompt_tokens": -1})
    assert_error(r, 400, "input", ["2,304 tokens"])
    assert_pool_whole(server)


def test_a_short_request_takes_its_turn_between_a_long_ones_batches(server, minilm, monkeypatch):
    """Issue 38.3: MiniLM runs one batch at a time, requests in turn: a one-line request sent while a long one's
    first batch is held runs before the long one's last batch, not after all of it."""
    from pagedllm.server.embedders import ENCODE_BATCH

    calls, started, go = [], threading.Event(), threading.Event()
    encode = minilm._encode

    def held(inputs):
        calls.append(len(inputs))
        if len(calls) == 1:
            started.set()
            assert go.wait(HANG_S)
        return encode(inputs)

    monkeypatch.setattr(minilm, "_encode", held)
    long = [f"word {i}" for i in range(3 * ENCODE_BATCH)]
    with ThreadPoolExecutor(2) as pool:
        big = pool.submit(_embed, server, model=MINILM, input=long)
        assert started.wait(HANG_S)
        small = pool.submit(_embed, server, model=MINILM, input="one line")
        deadline = time.monotonic() + HANG_S
        while minilm.turns.waiting == 0:  # the short one is queued for its turn
            assert time.monotonic() < deadline
            time.sleep(0.005)
        go.set()
        assert len(small.result(HANG_S)["data"]) == 1 and len(big.result(HANG_S)["data"]) == len(long)
    assert calls == [ENCODE_BATCH, ENCODE_BATCH, 1, ENCODE_BATCH], calls


def test_a_short_pooling_request_is_not_queued_behind_all_of_a_long_one(server, monkeypatch):
    """Issue 38.3, --runner pooling: a long request has only a few inputs in the engine at once, so a short one
    sent after it is pooled within a few engine steps (held and counted), long before the long one ends."""
    from pagedllm.server import embedders

    monkeypatch.setattr(embedders, "POOLING_IN_FLIGHT", 2)
    long = [[3, 4, 5, 6]] * 40  # 8 tokens a step: at most 2 of these a step, 20 steps at least
    with StepHold(server.engine) as hold, ThreadPoolExecutor(2) as pool:
        big = pool.submit(_embed, server, model=DECODER, input=long)
        _wait_queued(server, 2)
        small = pool.submit(_embed, server, model=DECODER, input=[[7, 8, 9]])
        _wait_queued(server, 3)
        hold.allow(3)
        assert len(small.result(HANG_S)["data"]) == 1
        assert not big.done()
        hold.release()
        assert len(big.result(HANG_S)["data"]) == len(long)
    assert_pool_whole(server)


def _wait_queued(s, n: int) -> None:
    deadline = time.monotonic() + HANG_S
    while (state := kv(s))["num_waiting"] + state["num_running"] < n:
        assert time.monotonic() < deadline, state
        time.sleep(0.01)


def test_minilm_limits_and_unknown_models(server):
    long = " ".join(["word"] * 400)  # over the model's 256 tokens: refused, not truncated in silence
    assert_error(server.http.post("/v1/embeddings", json={"model": MINILM, "input": long}), 400, "input")
    body = {"model": MINILM, "input": "a", "dimensions": 8}
    assert_error(server.http.post("/v1/embeddings", json=body), 400, "dimensions")
    assert_error(server.http.post("/v1/embeddings", json={"model": "nope", "input": "a"}), 404, "model")
    # --runner pooling: the model embeds, it does not generate
    assert server.http.post("/v1/completions", json={"prompt": "a"}).status_code == 404
    assert "/v1/embeddings" in server.http.get("/openapi.json").json()["paths"]
    cards = {m["id"]: m["max_model_len"] for m in server.http.get("/v1/models").json()["data"]}
    assert cards == {DECODER: MAX_MODEL_LEN, MINILM: 256}


def test_a_client_gone_mid_pooling_frees_its_blocks(server):
    """Hold the engine after one step of a 40-token prompt (8 tokens a step), drop the connection: the server
    aborts the pooling request and its blocks come back."""
    body = json.dumps({"model": DECODER, "input": [list(range(3, 43)), list(range(50, 90))]}).encode()
    head = f"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nAuthorization: {AUTH['Authorization']}\r\n"
    head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nX-Request-Id: gone\r\n\r\n"
    with StepHold(server.engine) as hold:
        hold.allow(1)
        sock = socket.create_connection(("127.0.0.1", server.port))
        sock.sendall(head.encode() + body)
        deadline = time.monotonic() + HANG_S
        while kv(server)["used_blocks"] == 0:
            assert time.monotonic() < deadline, kv(server)
            time.sleep(0.02)
        hold.wait_held()
        sock.close()
        hold.wait_abort("embd-gone")
    assert_pool_whole(server)


def test_truncate_prompt_tokens_keeps_what_the_model_takes(server, reference, tiny):
    """vLLM's field: -1 cuts a text as sentence-transformers does (so equal to its vectors); N keeps the last N."""
    long = " ".join(["word"] * 400)
    got = _embed(server, model=MINILM, input=[long], truncate_prompt_tokens=-1)
    np.testing.assert_allclose(_vectors(got), reference.encode([long]), atol=1e-5, rtol=0)
    assert got["usage"]["prompt_tokens"] == reference.max_seq_length
    _, hf = tiny
    ids = list(range(3, 3 + MAX_MODEL_LEN + 20))
    got = _embed(server, model=DECODER, input=[ids], truncate_prompt_tokens=10)
    np.testing.assert_allclose(_vectors(got)[0], _mean_normalized(hf, ids[-10:]), atol=1e-5, rtol=0)
    body = {"model": DECODER, "input": "a", "truncate_prompt_tokens": 0}
    assert_error(server.http.post("/v1/embeddings", json=body), 400, "truncate_prompt_tokens")


def test_the_cluster_takes_the_embedding_flags_and_checks_them_before_ray(tmp_path):
    """--embedding-model and --runner pooling reach the cluster's ingress (which serves /v1/embeddings as one
    server does); a missing folder is one line naming the flag before Ray starts, not an ingress failing over and
    over. Served through a real cluster in test_cluster.py."""
    from pagedllm.engine.pooling import PoolerConfig
    from pagedllm.entrypoints.cli import build_parser
    from pagedllm.entrypoints.serve_cluster import settings_from_args
    from pagedllm.errors import UserError

    def settings(*argv: str):
        return settings_from_args(build_parser().parse_args(["serve", "--replicas", "2", *argv]))[2]

    ingress = settings("--embedding-model", "default", "--runner", "pooling")
    assert (ingress.server.embedding_model, ingress.pooler) == ("default", PoolerConfig())  # a GGUF: last, normed
    assert settings().pooler is None and settings().server.embedding_model is None
    assert settings().server.max_embedding_tokens == 65536
    assert settings("--max-embedding-tokens", "9").server.max_embedding_tokens == 9
    with pytest.raises(UserError, match="^--max-embedding-tokens:"):
        settings("--max-embedding-tokens", "0")
    with pytest.raises(UserError, match="^--embedding-model:"):
        settings("--embedding-model", str(tmp_path / "nope"))


def test_a_missing_embedding_model_folder_is_a_user_error(tmp_path):
    from pagedllm.errors import UserError
    from pagedllm.server.embedders import SentenceTransformerEmbedder

    with pytest.raises(UserError, match="^--embedding-model:"):
        SentenceTransformerEmbedder(str(tmp_path / "nope"))
