"""`PagedLLMRouter`: pagedllm's routing policies on Ray Serve's custom request router API.

Ray Serve runs one router per deployment handle, in the process that holds the handle (here the ingress), and
asks it `choose_replicas` for every request; Ray then sends the request to the first replica of the ranking that
has room (`max_ongoing_requests`), and retries with backoff when none has. This class decides the ranking:

- `round-robin`: Ray's default, power of two choices (two random replicas, the less loaded wins): cache-blind.
- `prefix`: the replica most likely to hold the prompt's longest prefix (`routing.choose`), learnt from where
  this router sent earlier prompts (`routing.PrefixIndex`, bounded by the replica's KV capacity).
- `kv-events`: the same choice, corrected by the blocks the replicas report (their vLLM-format KV events, fed in
  by the ingress's poller): evictions and restarts are known instead of guessed. What it routes is still recorded
  at once, since a replica's events arrive a poll later than the next request of the same prefix may.

In both, a routed prompt's keys are recorded under the chosen replica when it is chosen, not when Ray has sent it,
so that a burst of one prefix group all finds the replica its first request was given.

A request that names a replica (`replica=` keyword, the ingress's per-replica calls for /metrics, /health and KV
events) goes to that replica whatever the policy.

The policy belongs to the front door, not to the replicas: Ray Serve builds this router in the ingress's process,
and the ingress sets `policy` (until then: round-robin). So two ingress applications over the same replicas can
route differently (an A/B of policies on live traffic, or a baseline, without reloading any model).
"""

from __future__ import annotations

import logging
import math
import random
import threading
from collections import OrderedDict
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from pagedllm.cluster import routing
from pagedllm.cluster.routing import POLICIES, PROMPT_KW, PrefixIndex, choose, request_keys

logger = logging.getLogger("pagedllm.cluster")

REPLICA_KW = "replica"  # the keyword a per-replica call names its replica with


class PagedLLMRouter(RequestRouter):
    """Ranks replicas by `policy` (see the module docstring)."""

    def initialize_state(
        self,
        block_size: int = 16,
        max_prefix_blocks: int = 64,
        imbalance_threshold: int = 8,
        min_match_share: float = 0.1,
        **_: Any,
    ) -> None:
        """Called by Ray Serve with the engine deployment's `request_router_kwargs`. `min_match_share`: the share
        of a prompt's (first max_prefix_blocks) blocks a replica must hold to attract it (SGLang's cache
        threshold, Ray Serve LLM's match_rate_threshold)."""
        self.policy = "round-robin"
        self.block_size = block_size
        self.max_prefix_blocks = max_prefix_blocks
        self.imbalance_threshold = imbalance_threshold
        self.min_match_share = min_match_share
        self.index = PrefixIndex()
        self.lock = threading.Lock()  # the index is also written by the ingress's KV-event poller
        self.in_flight: dict[str, int] = {}  # requests this router sent to each replica and not yet finished
        self._sent: dict[str, str] = {}  # internal request id -> replica, until it completes
        self._keys: OrderedDict[str, tuple[list[int], str]] = OrderedDict()  # request id -> (keys, first choice)
        self.decisions: dict[str, int] = {}  # why each replica was chosen ("prefix", "balance", "new"), counted
        # Ray ships this module to the handle's process by value (a copy of its globals): the registry the
        # ingress reads lives in `routing`, which travels by reference.
        routing.ROUTERS[self._deployment_id.app_name, self._deployment_id.name] = self

    def set_policy(self, policy: str) -> None:
        if policy not in POLICIES:
            raise ValueError(f"--routing: must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.policy = policy

    def replica_ids(self) -> list[str]:
        return [r.unique_id for r in self.curr_replicas]

    # ------------------------------------------------------------------ choosing
    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if pending_request is None or not candidate_replicas:
            return [random.sample(candidate_replicas, min(2, len(candidate_replicas)))]
        # Every candidate is ranked below: if none has room, Ray must back off rather than ask again at once.
        pending_request.routing_context.should_backoff = True
        target = pending_request.kwargs.get(REPLICA_KW)
        if target is not None:
            return [[r for r in candidate_replicas if r.replica_id.unique_id == target]]
        if self.policy == "round-robin" or not pending_request.kwargs.get(PROMPT_KW):
            return [random.sample(candidate_replicas, min(2, len(candidate_replicas)))]
        keys = request_keys(pending_request.kwargs, self.block_size, self.max_prefix_blocks)
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        with self.lock:
            self._set_capacity(candidate_replicas)
            matches = self.index.match(keys, by_id)
            cached = {rid: self.index.num_blocks(rid) for rid in by_id}
            choice = choose(
                matches, self.in_flight, cached, self.imbalance_threshold, math.ceil(self.min_match_share * len(keys))
            )
            if choice.ranked:
                # Recorded now, not once Ray has sent it: the next request of the same prefix may be chosen for
                # before that (a burst of one group), and must find it here.
                self.index.insert(choice.ranked[0], keys)
                self._remember(pending_request.metadata.internal_request_id, keys, choice.ranked[0])
        self.decisions[choice.reason] = self.decisions.get(choice.reason, 0) + 1
        return [[by_id[rid]] for rid in choice.ranked]

    def _remember(self, request_id: str, keys: list[int], chosen: str) -> None:
        """Keep a request's keys until it is routed, in case Ray sends it elsewhere (the first choice had no room);
        bounded: a request cancelled before that is forgotten."""
        self._keys[request_id] = (keys, chosen)
        while len(self._keys) > 4096:
            self._keys.popitem(last=False)

    def _set_capacity(self, replicas: list[RunningReplica]) -> None:
        """Bound the learnt index by the replicas' KV capacity (their routing stats): a replica evicts what it has
        no room for, so the router forgets in the same order."""
        if self.index.capacity is not None:
            return
        sizes = [r.routing_stats.get("num_blocks") for r in replicas if r.routing_stats]
        if sizes and all(s is not None for s in sizes):
            self.index.capacity = min(s for s in sizes if s is not None)

    # ------------------------------------------------------------------ what happened
    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        rid, request_id = replica_id.unique_id, pending_request.metadata.internal_request_id
        self._sent[request_id] = rid
        self.in_flight[rid] = self.in_flight.get(rid, 0) + 1
        keys, chosen = self._keys.pop(request_id, ((), rid))
        if chosen != rid:  # Ray sent it past the first choice: it is this replica that will hold the prefix
            with self.lock:
                self.index.insert(rid, keys)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        rid = self._sent.pop(internal_request_id, None)
        if rid is not None and rid in self.in_flight:
            self.in_flight[rid] = max(0, self.in_flight[rid] - 1)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        """Replicas joined or left: a new one starts empty, a gone one's blocks are gone with it."""
        super().update_replicas(replicas)
        live = {r.replica_id.unique_id for r in replicas}
        with self.lock:
            for rid in set(self.index.replicas()) - live:
                self.index.remove_replica(rid)
            for rid in live:
                self.index.add_replica(rid)
        for rid in set(self.in_flight) - live:
            del self.in_flight[rid]

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        with self.lock:
            self.index.remove_replica(replica_id.unique_id)
        self.in_flight.pop(replica_id.unique_id, None)
