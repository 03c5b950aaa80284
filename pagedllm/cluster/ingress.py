"""The cluster's ingress: the single-process server's OpenAI app over `ClusterEngine`, an async engine whose
requests run on the replicas of a Ray Serve deployment.

`ClusterEngine` has the async engine's interface (add_request / iterate / abort / stats ...), so the same routes,
validation, streaming and error bodies serve the cluster: a request is checked and tokenized here, sent through
the deployment handle (whose router, `PagedLLMRouter`, picks the replica) and its outputs streamed back. What
differs is what a cluster is: /health, /metrics and /v1/kv answer per replica (`cluster_routes`), and a replica
that dies fails the requests it was serving with `ReplicaDiedError` (503 with a message naming it) while the
router sends the next ones to the replicas that are left and Ray Serve starts a new one.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from pagedllm.cluster.config import Routing
from pagedllm.cluster.replica import ReplicaInfo, ReplicaReport
from pagedllm.cluster.replica_metrics import sum_stats
from pagedllm.cluster.router import REPLICA_KW
from pagedllm.cluster.routing import LORA_KW, PROMPT_KW, ROUTERS, SALT_KW, router_key
from pagedllm.engine.async_engine import EngineDeadError, EngineShuttingDownError, RequestAbortedError
from pagedllm.engine.outputs import RequestOutput
from pagedllm.engine.pooling import PoolerConfig
from pagedllm.engine.stats import AbortLog, EngineStats
from pagedllm.lora_request import LoRARequest
from pagedllm.model.config import ModelConfig
from pagedllm.model.tokenizer import Tokenizer
from pagedllm.sampling_params import PoolingParams, SamplingParams
from pagedllm.server.config import ServerConfig

logger = logging.getLogger("pagedllm.cluster")


class ReplicaDiedError(EngineDeadError):
    """The replica serving a request died; the cluster goes on (Ray Serve replaces the replica)."""


def replica_error(error: BaseException, replica: str | None) -> BaseException:
    """What a failed replica call means to the server: the replica's own exception (a refused request keeps its
    400 / 503), or ReplicaDiedError when the replica itself is gone."""
    from ray.exceptions import ActorUnavailableError, RayActorError, RayTaskError

    if isinstance(error, RayTaskError) and isinstance(error.cause, Exception):
        return error.cause
    if isinstance(error, (RayActorError, ActorUnavailableError)):
        return ReplicaDiedError(
            f"replica {replica or '(unknown)'} died while serving this request; "
            "the other replicas go on and Ray Serve starts a new one"
        )
    return error


def call(handle: Any, method: str, *args: Any, stream: bool = False, **kwargs: Any) -> Any:
    """`handle.<method>.remote(...)` as a call of its own. Ray Serve gives every call made while serving an HTTP
    request that request's internal id, and its router indexes pending calls by that id, so two concurrent calls
    from one request (a request's several prompts, a fan-out to every replica) are confused: one goes to the
    replica chosen for the other, the other is never sent. A call made from an empty context gets its own id."""
    remote = handle.options(method_name=method, stream=stream).remote
    return contextvars.Context().run(remote, *args, **kwargs)


@dataclass
class ClusterStream:
    """One engine request in flight on a replica: the streaming call its outputs come back on."""

    request_id: str
    replica: str
    call: Any  # ray.serve.handle.DeploymentResponseGenerator


@dataclass
class ClusterEngine:
    """An `AsyncEngine` (engine/interfaces.py) over a deployment of `EngineReplica`s (see the module docstring)."""

    handle: Any  # ray.serve.handle.DeploymentHandle of the replicas
    tokenizer: Tokenizer
    model_config: ModelConfig  # the ingress loads the config the replicas do
    max_model_len: int
    max_waiting_requests: int | None = None  # each replica's limit: a request over it is never admissible
    aborts: AbortLog = field(default_factory=AbortLog)
    _streams: dict[str, ClusterStream] = field(default_factory=dict)
    _accepting: bool = True
    _stats: EngineStats | None = None

    @property
    def is_healthy(self) -> bool:
        """The ingress serves while it accepts; which replicas are healthy is /health's to say."""
        return self._accepting

    def replica_ids(self) -> list[str]:
        router = ROUTERS.get(router_key(self.handle))
        return router.replica_ids() if router is not None else []

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Nothing to start: the replicas run in Ray."""

    def stop_accepting(self) -> None:
        self._accepting = False

    def abort_all(self) -> None:
        for request_id in list(self._streams):
            self.abort(request_id)

    def shutdown(self, timeout: float | None = None) -> None:
        self.stop_accepting()
        self.abort_all()

    # ------------------------------------------------------------------ requests
    async def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | PoolingParams,
        *,
        cache_salt: str | None = None,
        priority: int = 0,
        kv_segments: list[tuple[int, int]] | None = None,
        kv_blend_recompute: float | None = None,
        kv_blend_max_deviation: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> ClusterStream:
        """Send the request to the replica the router picks; returns once that replica's engine took it, or
        raises what it raised (a refusal) or ReplicaDiedError."""
        if not self._accepting:
            raise EngineShuttingDownError("the server is shutting down")
        ids = prompt if isinstance(prompt, list) else await asyncio.to_thread(self.tokenizer.encode, prompt)
        extra: dict = {SALT_KW: cache_salt, "priority": priority}
        if kv_segments is not None:  # kv_blend: sent only when asked for
            extra |= {"kv_segments": kv_segments, "kv_blend_recompute": kv_blend_recompute}
            if kv_blend_max_deviation is not None:
                extra["kv_blend_max_deviation"] = kv_blend_max_deviation
        if lora_request is not None:  # the router keys its prefixes by the adapter's id too
            extra[LORA_KW] = lora_request
        gen = call(self.handle, "generate", request_id, stream=True, **{PROMPT_KW: ids}, params=params, **extra)
        try:
            replica = await gen.__anext__()
        except asyncio.CancelledError:
            gen.cancel()
            raise
        except Exception as e:  # noqa: BLE001 - every failure becomes what it means to the server (replica_error)
            gen.cancel()
            raise replica_error(e, None) from None
        stream = self._streams[request_id] = ClusterStream(request_id, replica, gen)
        return stream

    async def iterate(self, stream: ClusterStream) -> AsyncIterator[RequestOutput]:
        """The request's cumulative outputs until it finishes; leaving early aborts it on its replica."""
        done = False
        try:
            async for out in stream.call:
                done = out.finished
                yield out
                if done:
                    return
            raise RequestAbortedError(f"replica {stream.replica} ended the request before it finished")
        except Exception as e:  # noqa: BLE001 - every failure becomes what it means to the server (replica_error)
            done = True
            raise replica_error(e, stream.replica) from None
        finally:
            self._streams.pop(stream.request_id, None)
            if not done:
                stream.call.cancel()

    def abort(self, request_id: str) -> None:
        """Cancel the call: Ray Serve cancels it on the replica, whose engine frees the request's blocks."""
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return
        stream.call.cancel()
        self.aborts.record(request_id)

    # ------------------------------------------------------------------ per replica
    async def per_replica(self, method: str, timeout: float = 10.0, **kwargs: Any) -> dict[str, Any]:
        """`method` on every replica (the router sends each call to the replica it names); an exception stands
        for a replica that did not answer in time or failed."""
        ids = self.replica_ids()
        calls = [call(self.handle, method, **{REPLICA_KW: rid, **kwargs}) for rid in ids]
        results = await asyncio.gather(*(asyncio.wait_for(c, timeout) for c in calls), return_exceptions=True)
        return dict(zip(ids, results))

    async def add_lora(self, lora: LoRARequest) -> None:
        """Load the adapter on every replica (vLLM's /v1/load_lora_adapter). A replica Ray Serve starts later
        loads it at its first request for it: a request carries its adapter's path."""
        await self._on_every_replica("add_lora", lora=lora)

    async def remove_lora(self, lora_int_id: int) -> None:
        """Unload the adapter on every replica; refused (UserError) where requests still use it, and a replica
        that refused keeps it, so none breaks (its next request loads it again where it went)."""
        await self._on_every_replica("remove_lora", lora_int_id=lora_int_id)

    async def _on_every_replica(self, method: str, **kwargs: Any) -> None:
        """`method` on every replica; the first failure raised as what it means to the server (a replica's
        UserError stays a 400)."""
        for rid, result in (await self.per_replica(method, timeout=60.0, **kwargs)).items():
            if isinstance(result, BaseException):
                raise replica_error(result, rid) from None

    async def reports(self) -> dict[str, ReplicaReport | BaseException]:
        out = await self.per_replica("report")
        self._stats = sum_stats([r.stats for r in out.values() if isinstance(r, ReplicaReport)])
        return out

    def stats(self) -> EngineStats:
        """The replicas' stats summed, as of the last /health, /metrics or /v1/kv."""
        return self._stats or sum_stats([])


@dataclass(frozen=True)
class IngressSettings:
    """What the ingress needs (the replicas get the engine's settings): the model it tokenizes for, the OpenAI
    app's settings as one server's (`server`, its names resolved), the routing policy of this front door, and
    `pooler`: --runner pooling, the replicas' model serves /v1/embeddings pooled this way (read from the model's
    files before Ray starts) and no completions. The sentence-transformers model of --embedding-model is loaded
    here, in the ingress, beside the replicas' generator (one copy). `loras`: --lora-modules with their ids,
    parsed once: the ingress names them in /v1/models and requests, every replica loads the same ids."""

    model: str | None
    server: ServerConfig
    routing: Routing
    pooler: PoolerConfig | None
    loras: tuple[LoRARequest, ...] = ()

    @property
    def served_model_names(self) -> list[str]:
        return list(self.server.served_model_name or ["pagedllm"])


async def wait_for_info(handle: Any, timeout: float = 600.0) -> ReplicaInfo:
    """The engines' facts, from the first replica up (the ingress may start before any has loaded its model)."""
    info: ReplicaInfo = await asyncio.wait_for(call(handle, "info"), timeout)
    return info
