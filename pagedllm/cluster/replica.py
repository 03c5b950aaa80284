"""`EngineReplica`: one pagedllm engine in a Ray Serve replica (its own weights, KV pool and engine thread).

The ingress calls `generate` for every engine request and streams its outputs back; everything else here is
asked of one replica by name (the router sends a call with `replica=<id>` to that replica): its stats and
Prometheus metrics for the cluster's /metrics, its health, and its KV events. Ray Serve calls `check_health`
(a replica whose engine loop died is replaced) and `record_routing_stats` (the KV capacity the router bounds
its prefix index with).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

from pagedllm.cluster.loopback import replica_grpc_on_loopback
from pagedllm.engine.config import EngineConfig
from pagedllm.engine.outputs import RequestOutput
from pagedllm.engine.stats import EngineStats
from pagedllm.lora_request import LoRARequest
from pagedllm.sampling_params import PoolingParams, SamplingParams

logger = logging.getLogger("pagedllm.cluster")


@dataclass(frozen=True)
class ReplicaInfo:
    """What the ingress needs of the engines to check requests as the single-process server does."""

    replica_id: str
    max_model_len: int
    vocab_size: int
    model_name: str
    block_size: int


@dataclass(frozen=True)
class ReplicaReport:
    """One replica's state, for the cluster's /health, /metrics and /v1/kv."""

    replica_id: str
    healthy: bool
    stats: EngineStats
    metrics_text: str  # its own Prometheus page (vLLM names), labelled per replica by the ingress


@dataclass(frozen=True)
class ReplicaSettings:
    engine: EngineConfig
    served_model_name: str
    max_waiting_requests: int | None  # ServerConfig's: the replica's engine queue answers 503 past it
    num_threads: int  # torch threads: the CPUs Ray gave this replica, so replicas do not oversubscribe
    loras: tuple[LoRARequest, ...] = ()  # --lora-modules, ids as the ingress gave them: loaded at start-up


class EngineReplica:
    """A Serve deployment class: the engine loads in the constructor, so a replica is ready once it can serve."""

    def __init__(self, settings: ReplicaSettings) -> None:
        import torch
        from ray import serve

        from pagedllm.engine.async_engine import AsyncLLMEngine
        from pagedllm.engine.llm_engine import LLMEngine

        replica_grpc_on_loopback()
        torch.set_num_threads(settings.num_threads)
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.core = LLMEngine(replace(settings.engine, enable_kv_cache_events=True))
        for lora in settings.loras:  # as the single server does: a bad adapter fails here, naming it
            self.core.add_lora(lora)
        self.engine = AsyncLLMEngine(self.core, max_waiting_requests=settings.max_waiting_requests)
        self.served_model_name = settings.served_model_name  # its metrics' model_name label
        self.engine.start()
        assert self.core.kv.pool.events is not None
        self.events = self.core.kv.pool.events
        logger.info("replica %s ready: %s", self.replica_id, self.core.model_config.name)

    def info(self) -> ReplicaInfo:
        core = self.core
        return ReplicaInfo(
            self.replica_id,
            core.max_model_len,
            core.model_config.vocab_size,
            core.model_config.name or "",
            core.block_size,
        )

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | PoolingParams,
        cache_salt: str | None = None,
        priority: int = 0,
        kv_segments: list[tuple[int, int]] | None = None,
        kv_blend_recompute: float | None = None,
        kv_blend_max_deviation: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[str | RequestOutput]:
        """First this replica's id, once the engine took the request (a refusal raises before it, so the ingress
        can still answer 400 / 503), then the request's cumulative outputs. Cancelling the call (the client went
        away) aborts the request, which frees its blocks within a step."""
        stream = await self.engine.add_request(
            request_id,
            prompt_token_ids,
            params,
            cache_salt=cache_salt,
            priority=priority,
            kv_segments=kv_segments,
            kv_blend_recompute=kv_blend_recompute,
            **({} if kv_blend_max_deviation is None else {"kv_blend_max_deviation": kv_blend_max_deviation}),
            lora_request=lora_request,
        )
        yield self.replica_id
        async for out in self.engine.iterate(stream):
            yield out

    def report(self, replica: str) -> ReplicaReport:
        self._check_addressed(replica)
        stats = self.engine.stats()
        page = self.engine.metrics.render(stats, self.served_model_name).decode()
        return ReplicaReport(self.replica_id, self.engine.is_healthy, stats, page)

    def kv_events(self, replica: str, after: int) -> tuple[int, bytes]:
        """(number of the last event, the events after `after` as one vLLM KVEventBatch in msgpack).

        A reader that fell behind the log (or joins a replica that has run for a while) gets the cache as it is
        now instead: AllBlocksCleared, then one BlockStored of every cached block. Events from just before the
        snapshot may come again in the next batch; replaying a store or a removal twice changes nothing."""
        from pagedllm.kv.events import AllBlocksCleared, BlockStored, encode_batch

        self._check_addressed(replica)
        last, events, lost = self.events.since(after)
        if lost:
            cached = list(self.core.kv.pool.cached)  # one C-level copy: atomic under the GIL
            events = [AllBlocksCleared(), BlockStored(cached, None, [], self.events.block_size, self.events.medium)]
        return last, encode_batch(events)

    async def add_lora(self, replica: str, lora: LoRARequest) -> None:
        """The runtime LoRA route's load, on this replica (the ingress asks every replica)."""
        self._check_addressed(replica)
        await self.engine.add_lora(lora)

    async def remove_lora(self, replica: str, lora_int_id: int) -> None:
        self._check_addressed(replica)
        await self.engine.remove_lora(lora_int_id)

    def _check_addressed(self, replica: str) -> None:
        """A per-replica call that reached another replica is a routing bug, not something to answer for."""
        if replica != self.replica_id:
            raise RuntimeError(f"a call for replica {replica} reached replica {self.replica_id}")

    def check_health(self) -> None:
        """Ray Serve's health check: an engine whose loop died makes Serve replace this replica."""
        if not self.engine.is_healthy:
            raise RuntimeError(f"replica {self.replica_id}: the engine loop is not running")

    def record_routing_stats(self) -> dict[str, Any]:
        """Ray Serve hands this to the routers: the KV capacity the prefix router bounds its guesses by."""
        return {"num_blocks": self.engine.stats().num_blocks}

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
