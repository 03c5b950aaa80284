"""`pagedllm serve --replicas N`: the cluster's flags, their checks, and starting (or joining) Ray to run it.

The flags live on `pagedllm serve` because that is where a vLLM user looks (`vllm serve --data-parallel-size`)
and the single-process server's flags all still apply; Ray Serve users get the same application from
`serve run pagedllm.cluster.app:app_builder ...` (see app.py). Nothing here imports Ray until the cluster runs,
so `pagedllm serve` works without the `cluster` extra.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from typing import Any

from pagedllm.cluster.routing import POLICIES
from pagedllm.errors import UserError

CLUSTER_FLAGS = ("ray_address", "routing", "cpus_per_replica", "num_gpus_per_replica",
                 "routing_imbalance_threshold")
OBJECT_STORE_BYTES = 100 * 2**20  # a local Ray's object store: requests and outputs are small, RAM is shared


def add_cluster_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("cluster (needs pip install 'pagedllm[cluster]')")
    g.add_argument("--replicas", type=int, default=None,
                   help="serve N engine replicas on Ray Serve behind one OpenAI endpoint (default: one process, "
                        "no Ray)")
    g.add_argument("--ray-address", default=None,
                   help="join this Ray cluster (e.g. ray://head:10001 or auto) instead of starting a local one")
    g.add_argument("--routing", default=None, choices=POLICIES,
                   help="how requests pick a replica: prefix (default: where the prompt's prefix most likely is "
                        "cached), kv-events (where the replicas' KV events say it is), round-robin (Ray's "
                        "power of two choices, cache-blind)")
    g.add_argument("--routing-imbalance-threshold", type=int, default=None,
                   help="prefix / kv-events: go to the least loaded replica instead when the one holding the "
                        "prefix has more than this many requests in flight over it (default: 8)")
    g.add_argument("--cpus-per-replica", type=float, default=None, help="CPUs Ray reserves per replica (default 1)")
    g.add_argument("--num-gpus-per-replica", type=float, default=None,
                   help="GPUs Ray reserves per replica (default 0)")


def check_cluster_args(args: argparse.Namespace) -> None:
    """The cluster's flags without --replicas, or one that makes no sense: one line naming the flag."""
    if args.replicas is None:
        given = [f for f in CLUSTER_FLAGS if getattr(args, f) is not None]
        if given:
            raise UserError(f"--{given[0].replace('_', '-')}: only with --replicas N (a cluster)")
        return
    if args.replicas < 1:
        raise UserError(f"--replicas: must be at least 1, got {args.replicas}")
    if args.cpus_per_replica is not None and args.cpus_per_replica <= 0:
        raise UserError(f"--cpus-per-replica: must be positive, got {args.cpus_per_replica}")
    if args.num_gpus_per_replica is not None and args.num_gpus_per_replica < 0:
        raise UserError(f"--num-gpus-per-replica: must be >= 0, got {args.num_gpus_per_replica}")
    if args.routing_imbalance_threshold is not None and args.routing_imbalance_threshold < 0:
        raise UserError(f"--routing-imbalance-threshold: must be >= 0, got {args.routing_imbalance_threshold}")
    if getattr(args, "rag_index", None):
        raise UserError("--rag-index: the cluster does not serve RAG yet; run it without --replicas")
    try:
        import ray.serve  # noqa: F401
    except ImportError:
        raise UserError("--replicas: needs Ray Serve: pip install 'pagedllm[cluster]'") from None


def settings_from_args(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    """(EngineConfig, ClusterOptions, IngressSettings) from checked flags; the model is looked up here, before
    Ray starts, so a bad path is one line and not a replica that fails to start over and over."""
    from pagedllm.cluster.app import ClusterOptions
    from pagedllm.cluster.ingress import IngressSettings
    from pagedllm.engine.config import EngineConfig
    from pagedllm.entrypoints.serve import served_names
    from pagedllm.model.config import load_model_config

    check_cluster_args(args)
    config = EngineConfig.from_args(args)
    load_model_config(args.model)
    options = ClusterOptions(args.replicas, args.cpus_per_replica or 1.0, args.num_gpus_per_replica or 0.0,
                             8 if args.routing_imbalance_threshold is None else args.routing_imbalance_threshold,
                             log_level=args.log_level)
    ingress = IngressSettings(args.model, served_names(args), args.routing or "prefix",
                              args.api_key or os.environ.get("PAGEDLLM_API_KEY"), args.max_waiting_requests,
                              getattr(args, "max_request_bytes", None))
    return config, options, ingress


def parse_builder_args(values: dict[str, str]) -> argparse.Namespace:
    """`serve run ... key=value` arguments as `pagedllm serve` flags (replicas defaults to 1 here)."""
    from pagedllm.entrypoints.cli import build_parser

    values = dict(values)
    argv = ["serve"] + ([str(values.pop("model"))] if "model" in values else [])
    for name, value in values.items():
        flag = "--" + name.replace("_", "-")
        argv += [flag] if str(value).lower() == "true" else [flag, str(value)]
    args = build_parser().parse_args(argv)
    if args.replicas is None:
        args.replicas = 1
    return args


def _ray_init(ray: Any, address: str | None) -> None:
    """Join `address`, or start a small local Ray: no dashboard, a small object store (the machine is shared)."""
    if address:
        ray.init(address=address)
    else:
        ray.init(num_cpus=os.cpu_count(), include_dashboard=False, object_store_memory=OBJECT_STORE_BYTES)


def check_resources(total: dict[str, float], replicas: int, cpus: float, gpus: float) -> None:
    """Replicas that could never be placed would leave Ray waiting for ever: refuse them up front."""
    if replicas * cpus > total.get("CPU", 0):
        raise UserError(f"--cpus-per-replica: {replicas} replicas x {cpus:g} CPUs need {replicas * cpus:g}; the "
                        f"Ray cluster has {total.get('CPU', 0):g}")
    if replicas * gpus > total.get("GPU", 0):
        raise UserError(f"--num-gpus-per-replica: {replicas} replicas x {gpus:g} GPUs need {replicas * gpus:g}; "
                        f"the Ray cluster has {total.get('GPU', 0):g}")


def _local_resources(gpus: float) -> dict[str, float]:
    total = {"CPU": float(os.cpu_count() or 1), "GPU": 0.0}
    if gpus:
        import torch

        total["GPU"] = float(torch.cuda.device_count())
    return total


def run_cluster(args: argparse.Namespace) -> int:
    """Start (or join) Ray, deploy the application, serve until SIGINT / SIGTERM, then take it down: all of
    Ray if this command started it, only this application if it joined a cluster."""
    from pagedllm.cluster.app import APP_NAME, build_application
    from pagedllm.entrypoints.serve import _check_can_listen

    config, options, ingress = settings_from_args(args)
    _check_can_listen(args.host, args.port)
    if not args.ray_address:  # before a local Ray takes its seconds to start
        check_resources(_local_resources(options.num_gpus_per_replica), options.replicas, options.cpus_per_replica,
                        options.num_gpus_per_replica)
    import ray
    from ray import serve

    _ray_init(ray, args.ray_address)
    try:
        check_resources(ray.cluster_resources(), options.replicas, options.cpus_per_replica,
                        options.num_gpus_per_replica)
        serve.start(http_options={"host": args.host, "port": args.port})
        print(f"pagedllm serve: starting {options.replicas} replicas ({ingress.routing} routing) ...",
              file=sys.stderr, flush=True)
        serve.run(build_application(config, options, ingress), name=APP_NAME, route_prefix="/")
        print(f"pagedllm serve: serving {', '.join(ingress.served_model_names)} on http://{args.host}:{args.port} "
              f"({options.replicas} replicas, {ingress.routing} routing)", file=sys.stderr, flush=True)
        _wait_for_signal()
    finally:
        if args.ray_address:
            serve.delete(APP_NAME)
        else:
            serve.shutdown()
        ray.shutdown()
    return 0


def _wait_for_signal() -> None:
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
