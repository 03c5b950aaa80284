"""Two engine replicas on a local Ray Serve (1 CPU each), behind the prefix-aware router, through its HTTP port:
the official openai client works unchanged, the single server's tool-call parser, embedding model and pooling
serve through it, prefix routing keeps every request of a prefix group on one replica
(and beats round-robin's cluster-wide hit rate, measured by a second front door over the same replicas), and a
replica killed mid-stream fails its own request with a clear error while the other serves and Ray starts a new one.

One cluster for the module, started the way a user starts it (`pagedllm serve --replicas 2`, a subprocess; Ray
and two model loads are most of the time): its Ray listens on loopback only, and what it prints from start to
Ctrl-C is nothing alarming (the last test stops it). `-m "not cluster"` skips the module.
"""

from __future__ import annotations

import json
import random
import subprocess
import threading
import time

import httpx
import numpy as np
import openai
import psutil
import pytest
from cluster_helpers import Cluster, start_cli
from prometheus_client.parser import text_string_to_metric_families

from pagedllm.bench.server_process import free_port

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(420)]

MODEL = "SmolLM2-135M-Instruct"
EMBEDDER = "all-MiniLM-L6-v2"  # --embedding-model default
PREFIX = 64  # tokens each group shares: 4 blocks of 16
GROUPS, PER_GROUP = 4, 5
# 0.9 CPUs a replica: Ray's 2 logical CPUs leave room for the MoE application's replica (0.1)
FLAGS = ["--replicas", "2", "--cpus-per-replica", "0.9", "--routing", "prefix", "--kv-cache-memory", "32MiB"]
FLAGS += ["--max-model-len", "512", "--max-num-seqs", "8"]
FLAGS += ["--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--embedding-model", "default"]


def _gcs_address(process: subprocess.Popen) -> str:
    """The GCS the command started, as its raylet was told it (`auto` could find another user's Ray)."""
    for child in psutil.Process(process.pid).children(recursive=True):
        flags = [a for a in child.cmdline() if a.startswith("--gcs-address=")]
        if child.name() == "raylet" and flags:
            return flags[0].split("=", 1)[1]
    raise AssertionError("no raylet under pagedllm serve")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """The real `pagedllm serve --replicas 2` at /, and a round-robin front door at /rr over its replicas."""
    import ray  # the cluster extra, which `make test` installs; imported here so that -m "not cluster" needs none
    from ray import serve
    from ray._private.authentication.authentication_token_setup import maybe_enable_token_auth_if_token_available

    from pagedllm.cluster.app import build_front_door
    from pagedllm.cluster.loopback import loopback_only
    from pagedllm.entrypoints.serve_cluster import parse_builder_args, settings_from_args

    port = free_port()
    stderr_path = tmp_path_factory.mktemp("cluster") / "stderr.txt"
    process = start_cli(port, stderr_path, FLAGS)
    running = Cluster(f"http://127.0.0.1:{port}", process, stderr_path, joined=True)
    try:
        loopback_only()  # or Ray takes 127.0.0.1 for this machine's address, where nothing listens
        maybe_enable_token_auth_if_token_available(warn_if_disabled=False)  # the token the command's Ray made
        ray.init(address=_gcs_address(process), log_to_driver=False)
        _, _, ingress = settings_from_args(parse_builder_args({"routing": "round-robin"}))
        serve.run(build_front_door(ingress), name="rr", route_prefix="/rr")
        yield running
    finally:
        running.stop()


LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}


def test_the_local_ray_listens_on_loopback_only(cluster):
    """Every port of every process the command started (GCS, raylet, agents, workers, Serve's proxy and
    replicas, itself) is on loopback: nobody on the network can reach the Ray it started."""
    command = psutil.Process(cluster.process.pid)
    listening = {}
    for process in [command, *command.children(recursive=True)]:
        try:
            for conn in process.net_connections(kind="inet"):
                if conn.status == psutil.CONN_LISTEN:
                    listening[(conn.laddr.ip, conn.laddr.port)] = process.name()
        except psutil.NoSuchProcess:  # a worker that exited meanwhile
            continue
    assert ("127.0.0.1", int(cluster.url.rsplit(":", 1)[1])) in listening  # the HTTP port: the scan sees them
    assert len(set(listening.values())) >= 4  # gcs_server, raylet, workers, agents at least
    assert {addr: name for addr, name in listening.items() if addr[0] not in LOOPBACK} == {}


def _client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)


def test_the_openai_client_works_unchanged(cluster):
    client = _client(cluster.url)
    assert [m.id for m in client.models.list().data] == [MODEL, EMBEDDER]
    whole = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0)
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 6
    streamed = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == whole.choices[0].text  # greedy: same text either way
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say hi"}],
        max_tokens=5,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(chat)
    assert chunks[-1].usage.completion_tokens == len([c for c in chunks if c.choices and c.choices[0].delta.content])
    with pytest.raises(openai.BadRequestError) as bad:  # the single server's validation and error body
        client.completions.create(model=MODEL, prompt="x", max_tokens=4, temperature=-1)
    assert bad.value.body["param"] == "temperature"
    several = client.completions.create(model=MODEL, prompt=["One", "Two", "Three"], max_tokens=2)
    assert sorted(c.index for c in several.choices) == [0, 1, 2]  # concurrent calls of one HTTP request
    health = httpx.get(f"{cluster.url}/health", timeout=60).json()
    assert health["status"] == "ok" and list(health["replicas"].values()) == ["ok", "ok"]
    page = httpx.get(f"{cluster.url}/metrics", timeout=60).text
    running = next(f for f in text_string_to_metric_families(page) if f.name == "vllm:num_requests_running")
    assert {sample.labels["replica"] for sample in running.samples} == set(health["replicas"])


def _prefix_workload(base: str, seed: int) -> list[tuple[int, bool, int]]:
    """GROUPS prefixes of PREFIX tokens, PER_GROUP prompts each (a distinct tail), shuffled and sent one at a
    time: (group, whether an earlier prompt of the group was sent, the tokens the cache served)."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1000, 40000) for _ in range(PREFIX)] for _ in range(GROUPS)]
    order = [g for g in range(GROUPS) for _ in range(PER_GROUP)]
    rng.shuffle(order)
    client, seen, out = _client(base), set(), []
    for g in order:
        tail = [rng.randrange(1000, 40000) for _ in range(8)]
        r = client.completions.create(model=MODEL, prompt=prefixes[g] + tail, max_tokens=1)
        out.append((g, g in seen, r.usage.prompt_tokens_details.cached_tokens))
        seen.add(g)
    return out


def _cluster_hits(base: str) -> dict[str, float]:
    from pagedllm.bench.serve_metrics import parse_prefix_cache_counters

    counters = parse_prefix_cache_counters(httpx.get(f"{base}/metrics", timeout=60).text)
    assert counters is not None
    return counters


def _decisions(base: str) -> dict[str, int]:
    return httpx.get(f"{base}/v1/kv", timeout=60).json()["routing_decisions"]


def test_prefix_routing_keeps_each_group_on_one_replica_and_beats_round_robin(cluster):
    before, decided = _cluster_hits(cluster.url), _decisions(cluster.url)
    prefix = _prefix_workload(cluster.url, seed=1)
    middle = _cluster_hits(cluster.url)
    # Every repeat found its whole prefix cached: it went where the group's first prompt went, since no other
    # replica held that prefix (so every request of a group went to one replica).
    assert all(cached == PREFIX for _, repeat, cached in prefix if repeat)
    assert all(cached == 0 for _, repeat, cached in prefix if not repeat)
    now = _decisions(cluster.url)
    assert {k: now[k] - decided.get(k, 0) for k in now} == {"new": GROUPS, "prefix": GROUPS * (PER_GROUP - 1)}

    baseline = _prefix_workload(f"{cluster.url}/rr", seed=2)  # new prefixes, the same replicas, cache-blind routing
    after = _cluster_hits(cluster.url)
    rate = (middle["hits"] - before["hits"]) / (middle["queries"] - before["queries"])
    rr_rate = (after["hits"] - middle["hits"]) / (after["queries"] - middle["queries"])
    assert rate == pytest.approx(GROUPS * (PER_GROUP - 1) * PREFIX / (GROUPS * PER_GROUP * (PREFIX + 8)))
    assert rr_rate < rate, (rr_rate, rate, baseline)
    assert any(repeat and cached == 0 for _, repeat, cached in baseline)  # a repeat sent where its prefix was not


TOOLS = [
    {
        "type": "function",
        "function": {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}},
    }
]
HERMES_CALL = '<tool_call>{"name": "add", "arguments": {"a": 12}}</tool_call>'


def test_tool_calls_and_the_embedding_model_are_the_single_servers(cluster):
    """--tool-call-parser (tool_choice "auto" parsed in its format, streamed and not) and --embedding-model (the
    ingress serves all-MiniLM-L6-v2, equal to sentence-transformers' vectors) on the cluster (issue 28)."""
    from sentence_transformers import SentenceTransformer

    from pagedllm.rag.embed import embed_model_path

    client = _client(cluster.url)
    messages = [{"role": "user", "content": "Add 12."}]
    body = dict(model=MODEL, messages=messages, tools=TOOLS, temperature=0, max_tokens=40)
    forced = {"structured_outputs": {"choice": [HERMES_CALL]}}  # the model is made to write a Hermes call
    whole = client.chat.completions.create(**body, extra_body=forced)
    call = whole.choices[0].message.tool_calls[0].function
    assert (call.name, json.loads(call.arguments), whole.choices[0].finish_reason) == ("add", {"a": 12}, "tool_calls")
    chunks = list(client.chat.completions.create(**body, extra_body=forced, stream=True))
    deltas = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
    assert deltas[0].function.name == "add" and json.loads("".join(t.function.arguments for t in deltas)) == {"a": 12}
    texts = ["Paged attention splits the KV cache into blocks.", "A second text"]
    got = client.embeddings.create(model=EMBEDDER, input=texts)
    reference = SentenceTransformer(embed_model_path(), device="cpu").encode(texts)
    np.testing.assert_allclose([d.embedding for d in got.data], reference, atol=1e-5, rtol=0)


def test_a_pooling_front_door_embeds_with_the_replicas_model(cluster):
    """--runner pooling on the cluster (as `serve run ... runner=pooling`, a front door over the same replicas):
    /v1/embeddings pools the replicas' model as one in-process engine does, and no completions are served."""
    from ray import serve

    from pagedllm import LLM
    from pagedllm.cluster.app import build_front_door
    from pagedllm.entrypoints.serve_cluster import parse_builder_args, settings_from_args

    _, _, pooling = settings_from_args(parse_builder_args({"runner": "pooling"}))
    prompts = [[1000 + 7 * i for i in range(n)] for n in (5, 40)]
    serve.run(build_front_door(pooling), name="pool", route_prefix="/pool")
    try:
        client = _client(f"{cluster.url}/pool")
        got = [d.embedding for d in client.embeddings.create(model=MODEL, input=prompts).data]
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model=MODEL, prompt="Hello", max_tokens=2)
    finally:
        serve.delete("pool")
    llm = LLM(max_model_len=512, kv_cache_memory=32 * 2**20, log_stats_interval=0)
    reference = np.array([out.embedding for out in llm.embed(prompts, use_tqdm=False)])
    assert np.linalg.norm(got, axis=1) == pytest.approx(1.0)  # a GGUF: the last token's state, normalized
    # bfloat16 (--dtype auto) in batches of other shapes: equal up to rounding, not bit for bit
    assert (np.sum(np.array(got) * reference, axis=1) > 0.999).all()


def test_a_mixture_of_experts_model_serves_as_a_replica(cluster, tmp_path):
    """Issue 34's "the cluster works with MoE models as with dense ones": a tiny random Qwen3-MoE (tests/
    moe_helpers.py) deployed as an application of its own on the same Ray (`build_application`, what `pagedllm
    serve --replicas` deploys), through its ingress: greedy completions equal the offline engine's on the same
    folder, the ingress's /metrics carries the replica's expert counters (moved by what it routed), and /v1/kv
    the replica's blocks, all back in the pool once the requests end."""
    from moe_helpers import make_moe
    from ray import serve

    from pagedllm import LLM, SamplingParams
    from pagedllm.cluster.app import build_application
    from pagedllm.entrypoints.serve_cluster import parse_builder_args, settings_from_args

    folder = str(tmp_path / "moe")
    make_moe("qwen3_moe", folder)
    flags = {"model": folder, "replicas": "1", "cpus_per_replica": "0.1", "dtype": "float32"}
    flags |= {"max_model_len": "256", "kv_cache_memory": "4MiB", "served_model_name": "tiny-moe"}
    config, options, ingress = settings_from_args(parse_builder_args(flags))
    prompts = [" ".join(f"t{i}" for i in range(start, start + 30)) for start in (7, 60)]
    serve.run(build_application(config, options, ingress), name="moe", route_prefix="/moe")
    try:
        client = _client(f"{cluster.url}/moe")
        got = [client.completions.create(model="tiny-moe", prompt=p, max_tokens=12, temperature=0) for p in prompts]
        page = httpx.get(f"{cluster.url}/moe/metrics", timeout=60).text
        deadline = time.monotonic() + 60  # a hang guard, not a speed bound: the replica's stats follow its steps
        while True:
            (replica,) = httpx.get(f"{cluster.url}/moe/v1/kv", timeout=60).json()["replicas"].values()
            if (replica["num_running"], replica["used_blocks"]) == (0, 0) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    finally:
        serve.delete("moe")
    assert (replica["num_running"], replica["used_blocks"]) == (0, 0), replica
    llm = LLM(folder, dtype="float32", max_model_len=256, kv_cache_memory=4 * 2**20, log_stats_interval=0)
    greedy = SamplingParams(temperature=0, max_tokens=12)
    assert [r.choices[0].text for r in got] == [o.outputs[0].text for o in llm.generate(prompts, greedy)]
    routed = [
        s.value
        for f in text_string_to_metric_families(page)
        if f.name.startswith("pagedllm:moe_expert")
        for s in f.samples
    ]
    assert len(routed) >= 2 and min(routed) > 0, page  # tokens routed and expert reads, both moved


def test_a_cache_salt_routes_as_a_prefix_of_its_own(cluster):
    """Two tenants' same prompt (issue 28: cache_salt): the second tenant's first request is a new prefix to the
    router, not sent for the first tenant's blocks, and each tenant's repeat finds its own."""
    prompt = [(i * 31) % 39000 + 1000 for i in range(PREFIX + 8)]
    client = _client(cluster.url)

    def send(salt: str) -> tuple[list[str], int]:
        before = _decisions(cluster.url)
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, extra_body={"cache_salt": salt})
        now = _decisions(cluster.url)
        return [k for k in now if now[k] != before.get(k, 0)], r.usage.prompt_tokens_details.cached_tokens

    assert send("tenant-a") == (["new"], 0)
    assert send("tenant-a") == (["prefix"], PREFIX)
    assert send("tenant-b") == (["new"], 0)
    assert send("tenant-b") == (["prefix"], PREFIX)


def _serving_replica(base: str, timeout: float = 60.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        replicas = httpx.get(f"{base}/v1/kv", timeout=60).json()["replicas"]
        busy = [rid for rid, kv in replicas.items() if kv["num_running"] > 0]
        if busy:
            return busy[0]
        time.sleep(0.05)
    raise AssertionError("the long request never ran")


def test_a_killed_replica_fails_its_request_and_the_other_goes_on(cluster):
    from pagedllm.cluster.app import APP_NAME, ENGINE_DEPLOYMENT

    failure: list[BaseException] = []

    def long_stream() -> None:
        stream = _client(cluster.url).completions.create(
            model=MODEL, prompt="Once upon a time", max_tokens=400, stream=True, extra_body={"ignore_eos": True}
        )
        try:
            for _ in stream:
                pass
        except openai.APIError as e:
            failure.append(e)

    thread = threading.Thread(target=long_stream)
    thread.start()
    victim = _serving_replica(cluster.url)
    import ray

    ray.kill(ray.get_actor(f"SERVE_REPLICA::{APP_NAME}#{ENGINE_DEPLOYMENT}#{victim}", namespace="serve"))
    thread.join(120)
    assert failure and f"replica {victim} died" in str(failure[0])  # its own request: a clear error, not a hang
    client = _client(cluster.url)
    for _ in range(3):  # the other replica serves meanwhile
        assert client.completions.create(model=MODEL, prompt="Hello", max_tokens=2).usage.completion_tokens == 2
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:  # Ray Serve starts a replacement
        replicas = httpx.get(f"{cluster.url}/health", timeout=60).json()["replicas"]
        if len(replicas) == 2 and victim not in replicas and set(replicas.values()) == {"ok"}:
            break
        time.sleep(1)
    else:
        raise AssertionError(f"no replacement replica: {replicas}")


def test_start_and_stop_print_nothing_alarming(cluster):
    """Last in the module: it stops the cluster. What a user reads while it starts and once it is stopped (Ctrl-C)
    is true and calm: no advice to turn off the token authentication Ray turned on, no "New http_options ... will
    not be applied" about the options it was started with, no failed shutdown task, no traceback."""
    rc, stderr, stopping = cluster.stop()
    assert rc == 0, stderr
    ready = "pagedllm serve: serving SmolLM2-135M-Instruct on http://127.0.0.1:"
    assert ready in stderr
    starting = stderr[: stderr.index(ready)]  # a replica the tests killed in between may log a traceback there
    for alarming in (
        "Token authentication",
        "will not be applied",
        "graceful_shutdown",
        "failed to shut down",
        "Traceback",
    ):
        assert alarming not in starting and alarming not in stopping, stderr
