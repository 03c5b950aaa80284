"""A pure mixture-of-experts model through the rest of the stack (issue 34's "kv-calc, /kv, bench, the server, the
cluster and the disk tier work with MoE models as with dense ones"), on tests/moe_helpers.py's tiny random
Qwen3-MoE (3 layers, all sparse, 8 experts of which 2 route; float32 folder, and a Q4_0 GGUF with its experts
kept as stored for the disk tier):

- the OpenAI server (one for the module, in process): /v1/completions and /v1/chat/completions answer the offline
  engine's greedy text; /v1/kv/blocks shows a request's blocks while it runs (its steps held, never outrun) and
  every block is back afterwards; /metrics' expert counters move by exactly what one request routed;
- `bench serve` against that server and `bench throughput` on the folder, as test_bench_e2e does for the default
  model;
- `kv-calc --model`: KV bytes per token, total and active parameters and bytes read per decoded token, each
  computed here from config.json;
- the disk tier: prefixes evicted from RAM to disk read back (also by a restarted engine) give a cold run's
  greedy tokens;
- the cluster's figures: two MoE engines' stats and /metrics pages merged as the cluster merges its replicas'
  (expert counters added, each replica's kept). A real Ray Serve replica of a MoE model is started by
  test_cluster.py (`test_a_mixture_of_experts_model_serves_as_a_replica`, on the Ray that module starts anyway:
  one costs 26-29 s even on a tiny model).
"""

from __future__ import annotations

import json
import os
import random
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import pytest
from engine_helpers import assert_disk_tier_round_trip
from moe_helpers import make_moe, write_gguf
from server_helpers import StepHold, assert_pool_whole, kv, running_server

from pagedllm import LLM, SamplingParams
from pagedllm.engine import EngineConfig, LLMEngine
from pagedllm.model import load_model

pytestmark = [pytest.mark.usefixtures("one_thread", "private_tokenizer_cache"), pytest.mark.timeout(300)]

FAMILY = "qwen3_moe"
SERVED = "tiny-moe"
ARGS = dict(dtype="float32", max_model_len=256, max_num_seqs=4, kv_cache_memory=4 * 2**20, log_stats_interval=0)
PROMPT = " ".join(f"t{i}" for i in range(7, 47))  # 40 words: 40 tokens of the word-level tokenizer, 3 blocks
MESSAGES = [{"role": "user", "content": " ".join(f"t{i}" for i in range(60, 80))}]


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> tuple[str, dict, object]:
    """The folder, its config.json and the transformers model."""
    folder = str(tmp_path_factory.mktemp(FAMILY))
    hf = make_moe(FAMILY, folder)
    with open(os.path.join(folder, "config.json")) as f:
        return folder, json.load(f), hf


@pytest.fixture(scope="module")
def offline(moe) -> LLM:
    return LLM(moe[0], **ARGS)


@pytest.fixture(scope="module")
def server(moe):
    from pagedllm.engine.async_engine import AsyncLLMEngine

    engine = AsyncLLMEngine(LLMEngine(EngineConfig(model=moe[0], **ARGS)))
    with running_server(engine, api_key=None, served_model_name=[SERVED]) as s:
        yield s


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def _metric(s, name: str) -> float:
    """One counter of /metrics (its single sample)."""
    lines = [line for line in s.http.get("/metrics").text.splitlines() if line.startswith(name + "{")]
    assert len(lines) == 1, (name, lines)
    return float(lines[0].rsplit(" ", 1)[1])


def test_completions_and_chat_answer_the_offline_engines_greedy_text(server, offline):
    want = offline.generate(PROMPT, _greedy(12), use_tqdm=False)[0]
    body = {"model": SERVED, "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    r = server.http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    got = r.json()
    assert (got["usage"]["prompt_tokens"], got["usage"]["completion_tokens"]) == (40, 12)
    assert got["choices"][0]["text"] == want.outputs[0].text and len(want.outputs[0].token_ids) == 12
    chat_want = offline.chat(MESSAGES, _greedy(8), use_tqdm=False)[0]
    body = {"model": SERVED, "messages": MESSAGES, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    r = server.http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["usage"]["prompt_tokens"] == len(chat_want.prompt_token_ids) > len(MESSAGES[0]["content"].split())
    assert got["choices"][0]["message"]["content"] == chat_want.outputs[0].text
    assert_pool_whole(server)


def test_the_kv_page_shows_a_running_requests_blocks_and_gets_them_back(server):
    """The request's prompt step runs, then its steps are held: /v1/kv/blocks lists it running with a block
    table of its tokens' blocks (each MoE layer stores KV as a dense one does: one group of all 3 layers), the
    pool counts them used; once it ends every block is free again."""
    body = {"model": SERVED, "prompt": PROMPT + " t200", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    with StepHold(server.engine) as hold, ThreadPoolExecutor(1) as pool:
        answer = pool.submit(server.http.post, "/v1/completions", json=body, headers={"X-Request-Id": "moe-kv"})
        hold.wait_held()  # the request is in the engine
        hold.allow(1)  # its prompt step
        hold.wait_held()
        data = server.http.get("/v1/kv/blocks").json()
        pool_state = kv(server)
        hold.release()
        r = answer.result()
    assert r.status_code == 200, r.text
    (req,) = data["requests"]
    assert req["request_id"].startswith("cmpl-moe-kv") and req["status"] == "running"
    assert req["prompt_tokens"] == 41 and req["output_tokens"] == 1
    blocks = req["block_ids"]
    assert len(blocks) == -(-req["kv_tokens"] // 16) >= 3 and len(set(blocks)) == len(blocks)
    assert data["counters"]["num_used_blocks"] == len(blocks) == pool_state["used_blocks"]
    assert [g["layers"] for g in data["kv_groups"]] == [[0, 1, 2]] and data["kv_groups"][0]["blocks"] == len(blocks)
    assert pool_state["num_running"] == 1
    after = assert_pool_whole(server)
    assert after["total_blocks"] == data["num_blocks"]


def test_metrics_count_what_one_request_routed(server, moe):
    """One request of P computed prompt tokens and n tokens: (P + n - 1) tokens through 3 sparse layers, each
    routed to 2 experts; expert reads: its decode steps read exactly 2 experts per layer, its prompt step between
    2 and all 8."""
    cfg = moe[1]
    layers, k, experts = cfg["num_hidden_layers"], cfg["num_experts_per_tok"], cfg["num_local_experts"]
    names = ("pagedllm:moe_expert_tokens_total", "pagedllm:moe_expert_reads_total", "vllm:prompt_tokens_total")
    before = [_metric(server, n) for n in names]
    prompt = " ".join(f"t{i}" for i in range(100, 130))  # a prompt no earlier test cached
    body = {"model": SERVED, "prompt": prompt, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    r = server.http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    tokens, reads, prompt_tokens = (_metric(server, n) - b for n, b in zip(names, before))
    assert prompt_tokens == 30
    assert tokens == (30 + 5 - 1) * layers * k
    decode_reads = (5 - 1) * layers * k
    assert layers * k <= reads - decode_reads <= layers * experts


def test_bench_serve_and_bench_throughput(server, moe, tmp_path):
    """As test_bench_e2e does for the default model: four requests sharing a prefix through `bench serve`,
    every token counted as the server counts it, some prefix hits; and the offline `bench throughput`."""
    from pagedllm.entrypoints.cli import main

    out = tmp_path / "serve.json"
    argv = ["bench", "serve", "--base-url", server.base, "--endpoint", "/v1/completions", "--tokenizer", moe[0]]
    argv += ["--dataset-name", "prefix-repetition", "--num-prompts", "4", "--num-prefixes", "1"]
    argv += ["--prefix-len", "48", "--suffix-len", "16", "--output-len", "6", "--max-concurrency", "2"]
    assert main([*argv, "--disable-tqdm", "--quiet", "--save-result", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["completed"] == 4 and r["failed"] == 0, r["errors"]
    assert r["server_completion_tokens"] == r["output_lens"] == [6] * 4
    assert r["server_prompt_tokens"] == r["dataset_input_lens"] == [64] * 4
    assert r["prefix_cache_hit_rate"] is not None and r["prefix_cache_hit_rate"] > 0
    assert r["output_throughput"] > 0
    assert_pool_whole(server)
    out = tmp_path / "throughput.json"
    argv = ["bench", "throughput", "--model", moe[0], "--dtype", "float32", "--max-model-len", "256"]
    argv += ["--num-prompts", "4", "--input-len", "32", "--output-len", "4", "--output-json", str(out)]
    assert main(argv) == 0
    t = json.loads(out.read_text())
    assert (t["num_prompts"], t["input_tokens"], t["output_tokens"]) == (4, 128, 16)
    assert t["output_tokens_per_s"] > 0 and t["dtype"] == "float32"


def test_kv_calc_prints_the_kv_bytes_and_parameters_the_config_implies(moe, capsys):
    """From config.json alone: K and V of every layer's KV heads; parameters of embeddings, attention (Qwen3's
    q/k norms), norms, router and experts, of which a token uses k / experts; a float32 folder's bytes, of which a
    decoded token reads the active ones less all but one row of the untied embedding table."""
    from pagedllm.entrypoints.cli import main

    folder, c, _ = moe
    hidden, layers, hd, vocab = c["hidden_size"], c["num_hidden_layers"], c["head_dim"], c["vocab_size"]
    heads, kv_heads, ffn = c["num_attention_heads"], c["num_key_value_heads"], c["moe_intermediate_size"]
    experts, k = c["num_local_experts"], c["num_experts_per_tok"]
    assert not c["tie_word_embeddings"] and not c["attention_bias"]
    assert c["decoder_sparse_step"] == 1 and not c["mlp_only_layers"]  # every layer sparse
    per_token = layers * 2 * kv_heads * hd * 4
    attention = hidden * heads * hd * 2 + hidden * kv_heads * hd * 2 + 2 * hd
    expert = 3 * hidden * ffn  # gate, up, down
    layer = attention + 2 * hidden + experts * hidden + experts * expert
    total = layers * layer + 2 * vocab * hidden + hidden
    active = total - layers * (experts - k) * expert
    assert main(["kv-calc", "--model", folder, "--dtype", "float32", "--kv-cache-dtype", "auto"]) == 0
    out = capsys.readouterr().out
    assert f"KV bytes per token: {per_token:,}\n" in out, out
    assert f"KV bytes per block of 16: {16 * per_token:,}\n" in out
    assert f"parameters: {total:,} total, {active:,} active per token ({k} of {experts} experts routed)" in out
    assert f"weight bytes: {4 * total:,}; read per decoded token: {4 * (active - (vocab - 1) * hidden):,} " in out


# ---- the disk tier -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def q4_path(moe, tmp_path_factory) -> str:
    """The model as a Q4_0 GGUF, as llama.cpp's converter writes MoE files."""
    path = str(tmp_path_factory.mktemp("gguf") / "tiny-qwen3moe.q4_0.gguf")
    write_gguf(moe[2], moe[0], FAMILY, "q4_0", path)
    return path


def _load_q4(path: str):
    """Its experts kept as stored (Q4_0), whatever the kernel choice measured."""
    return load_model(path, dtype="float32", verbose=False, quantization="gguf")


@pytest.fixture(scope="module")
def q4(q4_path):
    return _load_q4(q4_path)


def _small_engine(model, **kw) -> LLMEngine:
    """A RAM pool of 20 blocks: the four 7-block prompts do not fit in it together."""
    cfg = model.config
    block = 16 * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 4
    args = dict(max_model_len=256, kv_cache_memory=20 * block, log_stats_interval=0, speculative_config=None)
    return LLMEngine(EngineConfig(**(args | kw)), model)


def _run(engine: LLMEngine, prompts: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """Greedy tokens and cached prompt tokens per prompt, one request after another."""
    from engine_helpers import assert_all_blocks_free

    tokens, cached = [], []
    for i, p in enumerate(prompts):
        engine.add_request(f"r{engine.num_steps}-{i}", p, _greedy(4))
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    tokens.append(list(out.outputs[0].token_ids))
                    cached.append(out.num_cached_tokens)
    assert_all_blocks_free(engine)
    return tokens, cached


def test_the_disk_tier_serves_evicted_prefixes_and_a_restarted_engine(q4, tmp_path):
    """test_kv_offload's check on the MoE: a second pass finds the first prompts' blocks on disk (evicted from the
    20-block pool) and answers a cold engine's tokens; so does a new engine over the same folder."""
    rng = random.Random(20)
    prompts = [[rng.randrange(6, 256) for _ in range(100)] for _ in range(4)]
    cold = _run(_small_engine(q4), prompts)[0]
    assert len({tuple(t) for t in cold}) > 1
    assert_disk_tier_round_trip(partial(_small_engine, q4), _run, prompts, cold, str(tmp_path))


# ---- the cluster's figures -----------------------------------------------------------------------------------
def test_replicas_expert_counters_add_up_in_the_clusters_figures(q4_path):
    """Two MoE engines, each over its own load as each replica has: the cluster's summed stats add their expert
    counters, and its /metrics (each replica's page with a `replica` label) keeps each one's."""
    from prometheus_client.parser import text_string_to_metric_families

    from pagedllm.cluster.replica_metrics import sum_stats, with_replica_labels
    from pagedllm.engine.metrics import PrometheusStatLogger

    a, b = _small_engine(_load_q4(q4_path)), _small_engine(_load_q4(q4_path))
    _run(a, [[7 + i for i in range(30)]])
    _run(b, [[9 + i for i in range(20)], [40 + i for i in range(20)]])
    st_a, st_b = a.stats(), b.stats()
    assert st_a.moe_expert_tokens == (30 + 4 - 1) * 3 * 2 and st_b.moe_expert_tokens == 2 * (20 + 4 - 1) * 3 * 2
    total = sum_stats([st_a, st_b])
    assert total.moe_expert_tokens == st_a.moe_expert_tokens + st_b.moe_expert_tokens
    assert total.moe_expert_reads == st_a.moe_expert_reads + st_b.moe_expert_reads > 0
    pages = {r: PrometheusStatLogger().render(s, "m").decode() for r, s in (("ra", st_a), ("rb", st_b))}
    families = {f.name: f for f in text_string_to_metric_families(with_replica_labels(pages))}
    for name, field in (
        ("pagedllm:moe_expert_tokens", "moe_expert_tokens"),
        ("pagedllm:moe_expert_reads", "moe_expert_reads"),
    ):
        samples = {s.labels["replica"]: s.value for s in families[name].samples if s.name.endswith("_total")}
        assert samples == {"ra": float(getattr(st_a, field)), "rb": float(getattr(st_b, field))}
