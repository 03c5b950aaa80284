"""The Ray Serve application: N `EngineReplica`s routed by `PagedLLMRouter`, behind an ingress that serves the
OpenAI app, plus the per-replica routes a cluster needs, built from typed settings (`build_application`).
`pagedllm serve --replicas N` runs it (`launch.py`); `serve run pagedllm.entrypoints.serve_cluster:app_builder
replicas=2 routing=prefix` deploys the same application on a Ray cluster a team already runs (the builder takes
`pagedllm serve`'s flags as key=value).
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, FastAPI, Request, Response
from pydantic import Field
from ray import serve

from pagedllm.cluster.config import ClusterConfig
from pagedllm.cluster.ingress import ClusterEngine, IngressSettings, call, wait_for_info
from pagedllm.cluster.loopback import replica_grpc_on_loopback
from pagedllm.cluster.replica import EngineReplica, ReplicaReport, ReplicaSettings
from pagedllm.cluster.replica_metrics import sum_stats, with_replica_labels
from pagedllm.cluster.routing import ROUTERS, apply_events, router_for, router_key
from pagedllm.engine.config import EngineConfig
from pagedllm.engine.metrics import CONTENT_TYPE
from pagedllm.server.errors import ERROR_RESPONSES, error_response
from pagedllm.server.protocol_info import HealthResponse, KVPool
from pagedllm.server.serving_engine import json_response
from pagedllm.server.serving_lora import RUNTIME_UPDATES_ENV

logger = logging.getLogger("pagedllm.cluster")

ENGINE_DEPLOYMENT = "PagedLLMEngine"
INGRESS_DEPLOYMENT = "PagedLLMIngress"
APP_NAME = "pagedllm"
KV_EVENTS_POLL_S = 0.1  # kv-events routing: how often the ingress reads the replicas' new events
MAX_PREFIX_BLOCKS = 64  # the router hashes a prompt's first 64 blocks (1,024 tokens of 16)

cluster_routes = APIRouter()


class ClusterHealthResponse(HealthResponse):
    replicas: dict[str, str] = Field(description='each replica\'s state: "ok", or why not')


class ReplicaKV(KVPool):
    router_index_blocks: int | None = Field(description="what the router believes the replica caches")


class ClusterKVState(KVPool):
    routing: str | None
    routing_decisions: dict[str, int]
    replicas: dict[str, ReplicaKV]


def _engine(request: Request) -> ClusterEngine:
    engine: ClusterEngine = request.app.state.engine
    return engine


def _status(report: ReplicaReport | BaseException) -> str:
    if isinstance(report, ReplicaReport):
        return "ok" if report.healthy else "the engine loop is not running"
    return f"unreachable: {type(report).__name__}: {report}"


@cluster_routes.get("/health", response_model=ClusterHealthResponse, responses={503: ERROR_RESPONSES[503]})
async def health(request: Request) -> Response:
    """200 with each replica's state while any replica is healthy; 503 when none is."""
    reports = await _engine(request).reports()
    replicas = {rid: _status(r) for rid, r in reports.items()}
    if not any(s == "ok" for s in replicas.values()):
        return error_response(f"no replica is healthy: {replicas}", 503)
    return json_response(ClusterHealthResponse(status="ok", replicas=replicas))


@cluster_routes.get("/metrics")
async def metrics(request: Request) -> Response:
    """Every replica's metrics (vLLM's names) with a `replica` label, and `pagedllm:replica_up` per replica:
    PromQL's sum() over the label gives the cluster's figures."""
    reports = await _engine(request).reports()
    pages = {rid: r.metrics_text for rid, r in reports.items() if isinstance(r, ReplicaReport)}
    up = [
        "# HELP pagedllm:replica_up Whether the replica answered this scrape with a healthy engine.",
        "# TYPE pagedllm:replica_up gauge",
    ]
    up += [f'pagedllm:replica_up{{replica="{rid}"}} {float(_status(r) == "ok")}' for rid, r in reports.items()]
    return Response(with_replica_labels(pages) + "\n".join(up) + "\n", media_type=CONTENT_TYPE)


@cluster_routes.get("/v1/kv", response_model=ClusterKVState, responses={401: ERROR_RESPONSES[401]})
async def kv_state(request: Request) -> Response:
    """The block pools: the cluster's totals and each replica's, with what the router believes each one holds."""
    engine = _engine(request)
    reports = await engine.reports()
    per = {rid: r.stats for rid, r in reports.items() if isinstance(r, ReplicaReport)}
    router = ROUTERS.get(router_key(engine.handle))
    replicas = {
        rid: ReplicaKV(**KVPool.fields_of(st), router_index_blocks=router.index.num_blocks(rid) if router else None)
        for rid, st in per.items()
    }
    state = ClusterKVState(
        **KVPool.fields_of(sum_stats(list(per.values()))),
        routing=router.policy if router else None,
        routing_decisions=dict(router.decisions) if router else {},
        replicas=replicas,
    )
    return json_response(state)


def build_ingress_app(engine: ClusterEngine, settings: IngressSettings) -> FastAPI:
    """The single-process server's app over the cluster engine, with per-replica routes in place of its one-engine
    state routes (/health, /metrics, /v1/kv; the /kv block map stays a single server's). Its tool-call and
    reasoning parsers, pooling and embedding model are the single server's: they all run here, in the ingress,
    over the replicas' outputs (the replicas only generate and pool)."""
    from pagedllm.server import serving_info
    from pagedllm.server.api_server import build_app
    from pagedllm.server.embedders import SentenceTransformerEmbedder

    models = APIRouter()
    models.add_api_route("/v1/models", serving_info.models, methods=["GET"], response_model=serving_info.ModelList)
    server = settings.server
    embedders = [SentenceTransformerEmbedder(server.embedding_model)] if server.embedding_model else []
    return build_app(
        engine,
        server,
        model_root=settings.model or settings.served_model_names[0],
        state_routers=[cluster_routes, models],
        pooler=settings.pooler,
        embedders=embedders,
        lora_modules=settings.loras,
    )


async def poll_kv_events(engine: ClusterEngine, every: float) -> None:
    """kv-events routing: read each replica's new KV events (vLLM's format) and apply them to the router's index,
    so it knows exactly which prefixes each replica holds, evictions included."""
    from pagedllm.kv.events import decode_batch

    seen: dict[str, int] = {}
    while True:
        await asyncio.sleep(every)
        router = ROUTERS.get(router_key(engine.handle))
        ids = engine.replica_ids()
        calls = [call(engine.handle, "kv_events", replica=rid, after=seen.get(rid, 0)) for rid in ids]
        for rid, result in zip(ids, await asyncio.gather(*calls, return_exceptions=True)):
            if isinstance(result, BaseException) or router is None:
                logger.warning("no KV events from replica %s: %r", rid, result)
                continue
            seen[rid], data = result
            with router.lock:
                apply_events(router.index, rid, decode_batch(data)[1])
        for rid in set(seen) - set(ids):
            del seen[rid]


@dataclass(frozen=True)
class EngineRef:
    """The engine deployment of another application, for a second front door over the same replicas."""

    app_name: str
    deployment_name: str = ENGINE_DEPLOYMENT


class Ingress:
    """The ingress deployment: tokenizer and model config loaded here, engine facts asked of a replica, and the
    routing policy set on this process's router (see router.py: the policy belongs to the front door)."""

    async def __init__(self, engines: Any, settings: IngressSettings) -> None:  # type: ignore[misc]  # Ray Serve awaits an async __init__
        from pagedllm.model.config import load_model_config
        from pagedllm.model.tokenizer import load_tokenizer

        replica_grpc_on_loopback()
        if isinstance(engines, EngineRef):
            engines = serve.get_deployment_handle(engines.deployment_name, app_name=engines.app_name)
        info = await wait_for_info(engines)  # the first call: it makes Ray Serve build this process's router
        router_for(engines).set_policy(settings.routing)
        self.engine = ClusterEngine(
            engines,
            load_tokenizer(settings.model),
            load_model_config(settings.model),
            info.max_model_len,
            settings.server.max_waiting_requests,
        )
        self.fastapi = build_ingress_app(self.engine, settings)
        self._poller = None
        if settings.routing == "kv-events":
            self._poller = asyncio.ensure_future(poll_kv_events(self.engine, KV_EVENTS_POLL_S))

    def __serve_build_asgi_app__(self) -> FastAPI:
        return self.fastapi


def build_application(config: EngineConfig, options: ClusterConfig, ingress: IngressSettings) -> Any:
    """The Serve application (a bound ingress over a bound engine deployment)."""
    from ray.serve.config import RequestRouterConfig

    server = ingress.server
    waiting = server.max_waiting_requests if server.max_waiting_requests is not None else config.max_num_seqs
    settings = ReplicaSettings(
        engine=config,
        served_model_name=ingress.served_model_names[0],
        max_waiting_requests=server.max_waiting_requests,
        num_threads=max(1, int(options.cpus_per_replica)),
        loras=ingress.loras,
    )
    logs = {"log_level": server.log_level.upper(), "enable_access_log": server.log_level == "debug"}
    router: dict[str, Any] = dict(  # a dict: Ray 2.60 annotates these fields with the wrong types
        request_router_class="pagedllm.cluster.router.PagedLLMRouter",
        request_router_kwargs={
            "block_size": config.block_size,
            "max_prefix_blocks": MAX_PREFIX_BLOCKS,
            "imbalance_threshold": options.routing_imbalance_threshold,
        },
        request_routing_stats_period_s=2.0,
    )
    engines: Any = serve.deployment(
        EngineReplica,
        name=ENGINE_DEPLOYMENT,
        num_replicas=options.replicas,
        logging_config=logs,
        ray_actor_options={"num_cpus": options.cpus_per_replica, "num_gpus": options.num_gpus_per_replica},
        # the engine queues and batches itself: Ray only has to keep more than that from piling onto one replica
        max_ongoing_requests=config.max_num_seqs + waiting + 8,
        health_check_period_s=2.0,
        health_check_timeout_s=30.0,
        graceful_shutdown_timeout_s=5.0,
        request_router_config=RequestRouterConfig(**router),
    )
    return _front_door(logs).bind(engines.bind(settings), ingress)


def build_front_door(ingress: IngressSettings, engines_app: str = APP_NAME, log_level: str = "info") -> Any:
    """An application of just an ingress, over the replicas of the application `engines_app` (deploy it under
    another name and route prefix): its own routing policy, the same engines and caches."""
    logs = {"log_level": log_level.upper(), "enable_access_log": log_level == "debug"}
    return _front_door(logs).bind(EngineRef(engines_app), ingress)


def _front_door(logs: dict[str, Any]) -> Any:
    """The ingress deployment; VLLM_ALLOW_RUNTIME_LORA_UPDATING as this process has it (the ingress serves the
    runtime LoRA routes by it), also where Ray's workers do not inherit this environment (a joined cluster)."""
    actor: dict[str, Any] = {"num_cpus": 0}
    if RUNTIME_UPDATES_ENV in os.environ:
        actor["runtime_env"] = {"env_vars": {RUNTIME_UPDATES_ENV: os.environ[RUNTIME_UPDATES_ENV]}}
    return serve.deployment(
        serve.ingress()(Ingress),
        name=INGRESS_DEPLOYMENT,
        ray_actor_options=actor,
        max_ongoing_requests=4096,
        logging_config=logs,
    )
