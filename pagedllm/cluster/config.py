"""`pagedllm serve --replicas N`'s own settings, declared once (`pagedllm.settings`): the flags are made from
`ClusterConfig` and the cluster reads the same object. Each flag's command-line default is None so that one
given without --replicas is named (`serve_args.check_cluster_args`); the class holds the real defaults. Imports
without Ray."""

from __future__ import annotations

from typing import Annotated, Literal

from pagedllm.settings import Field, Flag, settings

Routing = Literal["round-robin", "prefix", "kv-events"]  # routing.py's POLICIES


@settings
class ClusterConfig:
    """`pagedllm serve --replicas N`'s settings: engine replicas on Ray Serve behind one endpoint."""

    replicas: Annotated[int, Field(ge=1)] | None = None
    """serve N engine replicas on Ray Serve behind one OpenAI endpoint (default: one process, no Ray)"""
    ray_address: str | None = None
    """join this Ray cluster (e.g. ray://head:10001, or auto: the one `ray start --head` started here) instead of
    starting a local one (default: a local one, which listens on 127.0.0.1 only; replicas on other machines: start
    the cluster yourself and pass its address)"""
    routing: Annotated[Routing, Flag(cli_default=None)] = "prefix"
    """how a request picks its replica: prefix (the default: where its prompt's prefix is most likely cached),
    kv-events (where the replicas' KV events say it is cached), round-robin (by load alone, blind to the cache:
    Ray Serve's default, the less busy of two replicas drawn at random)"""
    routing_imbalance_threshold: Annotated[int, Field(ge=0), Flag(cli_default=None)] = 8
    """prefix / kv-events: go to the least loaded replica instead when the one holding the prefix has more than
    this many requests in flight over it (default: 8)"""
    cpus_per_replica: Annotated[float, Field(gt=0), Flag(cli_default=None)] = 1.0
    """CPUs Ray reserves per replica (default: 1)"""
    num_gpus_per_replica: Annotated[float, Field(ge=0), Flag(cli_default=None)] = 0.0
    """GPUs Ray reserves per replica (default: 0)"""
