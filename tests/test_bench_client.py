"""`bench serve` end to end against a tiny fake OpenAI SSE server (stdlib http.server on a free loopback port)."""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from pagedllm.bench.server_process import free_port
from pagedllm.entrypoints.bench import add_parser

TTFT_S = 0.08
ITL_S = 0.02


class FakeOpenAI(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    state = {"queries": 0, "hits": 0, "bodies": [], "fail_next": 0, "streaming": 0, "peak_streaming": 0}
    lock = threading.Lock()

    def log_message(self, *a):
        pass

    def _send(self, code, body: bytes, ctype="application/json"):
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path == "/v1/models":
            self._send(200, json.dumps({"object": "list", "data": [{"id": "fake-model", "object": "model"}]}).encode())
        elif self.path == "/metrics":
            s = self.state
            text = (
                f'vllm:prefix_cache_queries_total{{engine="0"}} {s["queries"]}\n'
                f'vllm:prefix_cache_hits_total{{engine="0"}} {s["hits"]}\n'
            )
            self._send(200, text.encode(), "text/plain")
        else:
            self._send(404, b"{}")

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with self.lock:
            self.state["bodies"].append(body)
            fail = self.state["fail_next"] > 0
            self.state["fail_next"] -= 1 if fail else 0
        if self.headers.get("Authorization") != "Bearer sk-test":
            return self._send(401, b'{"error": {"message": "bad key"}}')
        if fail:
            return self._send(500, b'{"error": {"message": "boom"}}')
        chat = self.path == "/v1/chat/completions"
        prompt = body["messages"][0]["content"] if chat else body["prompt"]
        n_prompt = len(prompt.split())
        with self.lock:
            self.state["queries"] += n_prompt
            self.state["hits"] += n_prompt // 2
            self.state["streaming"] += 1
            self.state["peak_streaming"] = max(self.state["peak_streaming"], self.state["streaming"])
        self._stream(body, chat, n_prompt)

    def _stream(self, body: dict, chat: bool, n_prompt: int) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()

        def send(obj):
            self.wfile.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
            self.wfile.flush()

        if chat:  # a role-only first chunk: not a token
            send({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        time.sleep(TTFT_S)
        n = body["max_tokens"]
        for i in range(n):
            if i:
                time.sleep(ITL_S)
            piece = f" t{i}"
            choice = {"index": 0, "delta": {"content": piece}} if chat else {"index": 0, "text": piece}
            send({"choices": [choice]})
        send(
            {"choices": [], "usage": {"prompt_tokens": n_prompt, "completion_tokens": n, "total_tokens": n_prompt + n}}
        )
        with self.lock:  # before [DONE]: the client cannot start its next request before this
            self.state["streaming"] -= 1
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()
        self.close_connection = True


@pytest.fixture()
def server():
    FakeOpenAI.state.update(queries=0, hits=0, bodies=[], fail_next=0, streaming=0, peak_streaming=0)
    srv = ThreadingHTTPServer(("127.0.0.1", 0), FakeOpenAI)
    srv.daemon_threads = True
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


class WordTokenizer:
    """Tokens are space-separated words: matches the fake server's counting."""

    vocab_size = 1000
    special_ids = frozenset()

    def encode(self, text):
        return [hash(w) % 1000 for w in text.split()]

    def decode(self, ids):
        return " ".join(f"w{i}" for i in ids)


def _run(argv, monkeypatch):
    import argparse

    import pagedllm.bench.tokenizer as bt

    monkeypatch.setattr(bt, "load_bench_tokenizer", lambda path=None: WordTokenizer())
    p = argparse.ArgumentParser()
    add_parser(p.add_subparsers(dest="command"))
    args = p.parse_args(["bench", "serve", *argv])
    return args.func(args)


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_serve_against_fake_server(server, tmp_path, monkeypatch, endpoint):
    out = tmp_path / "r.json"
    rc = _run(
        [
            "--base-url",
            server,
            "--endpoint",
            endpoint,
            "--api-key",
            "sk-test",
            "--num-prompts",
            "6",
            "--input-len",
            "12",
            "--output-len",
            "5",
            "--max-concurrency",
            "3",
            "--disable-tqdm",
            "--quiet",
            "--goodput",
            f"ttft:{TTFT_S * 1000 / 2:g}",  # missed by every request, whatever the speed: the server waits TTFT_S
            "--save-result",
            str(out),
            "--plot",
            str(tmp_path / "p.png"),
        ],
        monkeypatch,
    )
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["completed"] == 6 and r["failed"] == 0 and r["model_id"] == "fake-model"
    assert r["total_input_tokens"] == 6 * 12 and r["input_lens"] == [12] * 6
    assert r["total_output_tokens"] == 30 and r["output_lens"] == [5] * 6
    for ttft, itls, e2e in zip(r["ttfts"], r["itls"], r["e2els"]):
        assert TTFT_S * 0.9 <= ttft < e2e
        # single gaps can shrink when a loaded client reads two chunks late; the whole stream cannot
        assert len(itls) == 4
        assert e2e >= TTFT_S + 4 * ITL_S * 0.9
        assert e2e == pytest.approx(ttft + sum(itls), abs=1e-6)
    assert r["request_goodput"] == 0 < r["request_throughput"]  # no bound a slow machine could miss by chance
    assert FakeOpenAI.state["peak_streaming"] <= 3  # --max-concurrency 3 is honoured
    assert r["max_concurrent_requests"] >= 1 and r["max_output_tokens_per_s"] >= 1
    # 6 measured requests of 12 words: half of them "hit" (the initial test request is not counted)
    assert r["prefix_cache_queries"] == 72 and r["prefix_cache_hit_rate"] == pytest.approx(0.5)
    bodies = FakeOpenAI.state["bodies"]
    assert len(bodies) == 7
    b = bodies[-1]
    assert b["stream"] is True and b["ignore_eos"] is True and b["max_tokens"] == 5 and b["model"] == "fake-model"
    assert b["stream_options"] == {"include_usage": True}
    assert ("messages" in b) == (endpoint == "/v1/chat/completions")
    assert (tmp_path / "p.png").stat().st_size > 10_000


def test_serve_counts_failures(server, tmp_path, monkeypatch):
    FakeOpenAI.state["fail_next"] = 0
    out = tmp_path / "r.json"

    # fail the 2nd and 3rd requests of the run (after the initial test request)
    orig = FakeOpenAI.do_POST
    calls = {"n": 0}

    def flaky(self):
        calls["n"] += 1
        if calls["n"] in (2, 3):
            FakeOpenAI.state["fail_next"] = 1
        return orig(self)

    monkeypatch.setattr(FakeOpenAI, "do_POST", flaky)
    rc = _run(
        [
            "--base-url",
            server,
            "--api-key",
            "sk-test",
            "--model",
            "m",
            "--num-prompts",
            "4",
            "--input-len",
            "3",
            "--output-len",
            "2",
            "--max-concurrency",
            "1",
            "--request-rate",
            "50",
            "--disable-tqdm",
            "--quiet",
            "--save-result",
            str(out),
        ],
        monkeypatch,
    )
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["completed"] == 2 and r["failed"] == 2
    assert sum(1 for e in r["errors"] if e.startswith("HTTP 500")) == 2
    assert r["total_output_tokens"] == 4 and r["request_rate"] == 50


def test_serve_bad_key_is_a_user_error(server, monkeypatch):
    from pagedllm.errors import UserError

    with pytest.raises(UserError, match="401"):
        _run(
            [
                "--base-url",
                server,
                "--api-key",
                "wrong",
                "--num-prompts",
                "1",
                "--input-len",
                "3",
                "--output-len",
                "2",
                "--disable-tqdm",
                "--quiet",
            ],
            monkeypatch,
        )


def test_serve_unreachable_server(monkeypatch):
    from pagedllm.errors import UserError

    port = free_port()  # nobody listens there
    with pytest.raises(UserError, match="cannot reach"):
        _run(
            ["--base-url", f"http://127.0.0.1:{port}", "--num-prompts", "1", "--input-len", "3", "--disable-tqdm"],
            monkeypatch,
        )
