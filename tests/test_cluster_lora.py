"""LoRA adapters through the cluster (issue 37): `pagedllm serve --replicas 2 --enable-lora --lora-modules ...` on
test_lora's tiny random Llama and two of its adapters. The replicas get the LoRA flags and the adapters; /v1/models
lists each adapter with its parent; a request by an adapter's name is answered with that adapter applied (greedy
tokens equal transformers' with the adapter merged, and a single engine's with it); an unknown name is vLLM's 404;
and the router keys a prompt's prefix by the adapter's id, as the replicas' block hashes are: the same prompt under
another adapter is a new prefix to it (never sent for the first adapter's blocks), and each adapter's repeat finds
its own.

One cluster for the module, started the way a user starts it (a subprocess); `-m "not cluster"` skips the module.
"""

from __future__ import annotations

import json

import httpx
import pytest
from cluster_helpers import Cluster, start_cli
from engine_helpers import GREEDY, make_engine
from lora_helpers import PROMPTS, make_tiny_loras
from server_helpers import assert_error

from pagedllm.bench.server_process import free_port

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(420)]
peft = pytest.importorskip("peft")

SERVED = "base"
ADAPTERS = ("qv", "all")
PREFIX = 64  # tokens: 4 blocks of 16


@pytest.fixture(scope="module")
def lora_cluster(tmp_path_factory):
    """The running cluster, the adapters' LoRARequests, transformers' tokens per adapter, the base folder."""
    root = tmp_path_factory.mktemp("cluster-lora")
    base, loras, want, _ = make_tiny_loras(str(root))
    modules = [
        f"qv={loras['qv'].lora_path}",  # both of vLLM's forms
        json.dumps({"name": "all", "path": loras["all"].lora_path, "base_model_name": SERVED}),
    ]
    flags = [base, "--replicas", "2", "--cpus-per-replica", "1", "--routing", "prefix", "--served-model-name", SERVED]
    flags += ["--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory", "1MiB"]
    flags += ["--enable-lora", "--lora-modules", *modules, "--max-loras", "2", "--max-lora-rank", "8"]
    port, stderr = free_port(), root / "stderr.txt"
    runtime = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"}  # vLLM's switch for the load / unload routes
    running = Cluster(f"http://127.0.0.1:{port}", start_cli(port, stderr, flags, runtime), stderr)
    try:
        yield running, loras, want, base
    finally:
        rc, whole, _ = running.stop()
        assert rc == 0, whole


def _completion(url: str, model: str, prompt: list[int], max_tokens: int = GREEDY.max_tokens) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return httpx.post(f"{url}/v1/completions", json=body | {"logprobs": 1}, timeout=120)


def test_models_lists_each_adapter_with_its_parent(lora_cluster):
    cluster = lora_cluster[0]
    models = httpx.get(f"{cluster.url}/v1/models", timeout=60).json()["data"]
    assert [(m["id"], m["parent"]) for m in models] == [(SERVED, None), ("qv", SERVED), ("all", SERVED)]


def test_a_request_by_adapter_name_is_answered_with_that_adapter(lora_cluster):
    """Each adapter's and the base's greedy tokens through the cluster equal transformers' with the adapter merged
    and a single engine's (no cluster) with the adapter, prompt by prompt."""
    from pagedllm.model.loader import load_model
    from pagedllm.model.tokenizer import load_tokenizer

    cluster, loras, want, base = lora_cluster
    tokenizer = load_tokenizer(base)
    single = make_engine(
        load_model(base, "float32", "cpu", False, None),
        dtype="float32",
        max_model_len=256,
        kv_cache_memory=2**20,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
    )
    for model in (*ADAPTERS, SERVED):
        name = None if model == SERVED else model
        for i, prompt in enumerate(PROMPTS):
            alone = _alone(single, prompt, loras.get(model))
            r = _completion(cluster.url, model, prompt)
            assert r.status_code == 200, r.text
            got = r.json()["choices"][0]["logprobs"]["tokens"]
            expected = [tokenizer.decode([t], skip_special_tokens=False) for t in want[name][i]]
            assert alone == want[name][i], (model, i)
            assert got == expected, (model, i)


def _alone(engine, prompt: list[int], lora) -> list[int]:
    engine.add_request("r", prompt, GREEDY, lora_request=lora)
    while True:
        for out in engine.step():
            if out.finished:
                return out.outputs[0].token_ids


def test_an_unknown_adapter_is_vllms_404(lora_cluster):
    cluster = lora_cluster[0]
    assert_error(_completion(cluster.url, "nope", PROMPTS[0]), 404, "model", ["The model `nope` does not exist."])


def test_runtime_load_and_unload_reach_every_replica(lora_cluster):
    """vLLM's /v1/load_lora_adapter through the cluster: the adapter is served by name (every prompt, so both
    replicas are likely to serve it) with its tokens; a bad one is a 400; unloaded, its name is a 404 again."""
    from pagedllm.model.tokenizer import load_tokenizer

    cluster, loras, want, base = lora_cluster
    tokenizer = load_tokenizer(base)
    load = {"lora_name": "mlp", "lora_path": loras["mlp"].lora_path}
    r = httpx.post(f"{cluster.url}/v1/load_lora_adapter", json=load, timeout=120)
    assert r.status_code == 200 and "added successfully" in r.text, r.text
    models = httpx.get(f"{cluster.url}/v1/models", timeout=60).json()["data"]
    assert ("mlp", SERVED) in [(m["id"], m["parent"]) for m in models]
    for i, prompt in enumerate(PROMPTS):
        got = _completion(cluster.url, "mlp", prompt).json()["choices"][0]["logprobs"]["tokens"]
        assert got == [tokenizer.decode([t], skip_special_tokens=False) for t in want["mlp"][i]], i
    bad = {"lora_name": "bad", "lora_path": base}  # a model folder, not an adapter
    assert_error(httpx.post(f"{cluster.url}/v1/load_lora_adapter", json=bad, timeout=120), 400, None, ["'bad'"])
    r = httpx.post(f"{cluster.url}/v1/unload_lora_adapter", json={"lora_name": "mlp"}, timeout=120)
    assert r.status_code == 200 and "removed successfully" in r.text, r.text
    assert_error(_completion(cluster.url, "mlp", PROMPTS[0]), 404, "model", ["The model `mlp` does not exist."])


def _decisions(url: str) -> dict[str, int]:
    return httpx.get(f"{url}/v1/kv", timeout=60).json()["routing_decisions"]


def test_the_router_keys_a_prefix_by_the_adapters_id(lora_cluster):
    """One prompt under two adapters and the base: each one's first request is a new prefix to the router (not
    routed for another adapter's blocks, which its replica's cache would not serve it), each repeat finds its own."""
    cluster = lora_cluster[0]
    prompt = [(i * 37) % 250 + 3 for i in range(PREFIX + 8)]

    def send(model: str) -> tuple[list[str], int]:
        before = _decisions(cluster.url)
        r = _completion(cluster.url, model, prompt, max_tokens=1)
        assert r.status_code == 200, r.text
        now = _decisions(cluster.url)
        return [k for k in now if now[k] != before.get(k, 0)], r.json()["usage"]["prompt_tokens_details"][
            "cached_tokens"
        ]

    for model in (*ADAPTERS, SERVED):
        assert send(model) == (["new"], 0), model
        assert send(model) == (["prefix"], PREFIX), model
