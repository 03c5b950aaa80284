"""`pagedllm serve --replicas N`, and Ray Serve's `serve run pagedllm.entrypoints.serve_cluster:app_builder ...`:
`pagedllm serve`'s flags turned into the cluster's typed settings (`pagedllm.cluster` takes it from there).

The flags live on `pagedllm serve` because that is where a vLLM user looks (`vllm serve --data-parallel-size`)
and the single-process server's flags all still apply. Nothing here imports Ray until the cluster runs, so
`pagedllm serve` works without the `cluster` extra.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from pagedllm.entrypoints.serve_args import (
    add_serve_args,
    check_can_listen,
    check_cluster_args,
    check_server_args,
    served_names,
)


def settings_from_args(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    """(EngineConfig, ClusterOptions, IngressSettings) from checked flags; the model is looked up here, before
    Ray starts, so a bad path is one line and not a replica that fails to start over and over."""
    from pagedllm.cluster.app import ClusterOptions
    from pagedllm.cluster.ingress import IngressSettings
    from pagedllm.engine.config import EngineConfig
    from pagedllm.engine.pooling import read_pooler_config
    from pagedllm.model.config import load_model_config, resolve_model_path
    from pagedllm.server.embedders import embedding_model_path

    check_server_args(args)
    check_cluster_args(args)
    config = EngineConfig.from_args(args)
    load_model_config(args.model)
    if args.embedding_model:
        embedding_model_path(args.embedding_model)  # a bad path is one line here, before Ray starts
    pooler = read_pooler_config(resolve_model_path(args.model)) if args.runner == "pooling" else None
    options = ClusterOptions(
        args.replicas,
        args.cpus_per_replica or 1.0,
        args.num_gpus_per_replica or 0.0,
        8 if args.routing_imbalance_threshold is None else args.routing_imbalance_threshold,
        log_level=args.log_level,
    )
    ingress = IngressSettings(
        args.model,
        served_names(args),
        args.routing or "prefix",
        args.api_key or os.environ.get("PAGEDLLM_API_KEY"),
        args.max_waiting_requests,
        getattr(args, "max_request_bytes", None),
        args.reasoning_parser,
        args.trust_request_chat_template,
        args.tool_call_parser,
        pooler,
        args.embedding_model,
        args.max_embedding_tokens,
    )
    return config, options, ingress


def parse_builder_args(values: dict[str, str]) -> argparse.Namespace:
    """`serve run ... key=value` arguments as `pagedllm serve` flags (replicas defaults to 1 here)."""
    values = dict(values)
    argv = [str(values.pop("model"))] if "model" in values else []
    for name, value in values.items():
        flag = "--" + name.replace("_", "-")
        argv += [flag] if str(value).lower() == "true" else [flag, str(value)]
    parser = argparse.ArgumentParser(prog="serve run pagedllm.entrypoints.serve_cluster:app_builder")
    add_serve_args(parser)
    args = parser.parse_args(argv)
    if args.replicas is None:
        args.replicas = 1
    return args


def run_cluster(args: argparse.Namespace) -> int:
    """Start (or join) Ray, deploy the application, serve until SIGINT / SIGTERM (`cluster.launch`)."""
    from pagedllm.cluster.launch import serve_cluster

    config, options, ingress = settings_from_args(args)
    check_can_listen(args.host, args.port)
    return serve_cluster(config, options, ingress, args.host, args.port, args.ray_address)


def app_builder(args: dict[str, str]) -> Any:
    """For `serve run pagedllm.entrypoints.serve_cluster:app_builder key=value ...`: `pagedllm serve`'s flags,
    checked the same way (replicas=2 is --replicas 2; a flag without a value is key=true)."""
    from pagedllm.cluster.app import build_application

    config, options, ingress = settings_from_args(parse_builder_args(args))
    return build_application(config, options, ingress)
