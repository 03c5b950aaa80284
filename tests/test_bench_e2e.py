"""`bench serve` against the real pagedllm server on the default model (a few short requests)."""
import json

import pytest

from pagedllm.bench.server_process import free_port, serve, stop

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = free_port()
    with open(tmp_path_factory.mktemp("srv") / "server.log", "w") as log:
        proc = serve(port, "--host", "127.0.0.1", "--max-model-len", "512", "--kv-cache-memory", "32MiB",
                     "--log-level", "warning", timeout=240, log=log)
        yield f"http://127.0.0.1:{port}"
        stop(proc, timeout=20)


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_bench_serve_real_server(server, tmp_path, endpoint):
    from pagedllm.entrypoints.cli import main

    out = tmp_path / "r.json"
    rc = main(["bench", "serve", "--base-url", server, "--endpoint", endpoint, "--dataset-name", "prefix-repetition",
               "--num-prompts", "4", "--num-prefixes", "1", "--prefix-len", "48", "--suffix-len", "16",
               "--output-len", "6", "--max-concurrency", "2", "--disable-tqdm", "--quiet",
               "--save-result", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["completed"] == 4 and r["failed"] == 0, r["errors"]
    # token totals equal the server's usage fields
    assert r["server_completion_tokens"] == [6] * 4 and r["output_lens"] == [6] * 4
    assert r["total_output_tokens"] == sum(r["server_completion_tokens"]) == 24
    assert r["total_input_tokens"] == sum(r["server_prompt_tokens"])
    if endpoint == "/v1/completions":  # exact prompt lengths: the server counts what the dataset built
        assert r["server_prompt_tokens"] == r["dataset_input_lens"] == [64] * 4
    else:  # the chat template adds its own tokens
        assert all(s > 64 for s in r["server_prompt_tokens"])
    for ttft, itls, e2e in zip(r["ttfts"], r["itls"], r["e2els"]):
        assert 0 < ttft <= e2e
        assert e2e == pytest.approx(ttft + sum(itls), abs=1e-6)
    for m in ("ttft", "tpot", "itl", "e2el"):
        assert 0 < r[f"p50_{m}_ms"] <= r[f"p90_{m}_ms"] <= r[f"p99_{m}_ms"]
    assert r["mean_ttft_ms"] < r["mean_e2el_ms"]
    assert r["output_throughput"] > 0 and r["total_token_throughput"] > r["output_throughput"]
    # the server's /metrics has vLLM's prefix-cache counters; one shared prefix -> some hits
    assert r["prefix_cache_queries"] is not None and r["prefix_cache_queries"] >= 4 * 64 - 1
    assert r["prefix_cache_hit_rate"] is not None and r["prefix_cache_hit_rate"] > 0
