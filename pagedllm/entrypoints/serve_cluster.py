"""`pagedllm serve --replicas N`, and Ray Serve's `serve run pagedllm.entrypoints.serve_cluster:app_builder ...`:
`pagedllm serve`'s flags turned into the cluster's typed settings (`pagedllm.cluster` takes it from there).

The flags live on `pagedllm serve` because that is where a vLLM user looks (`vllm serve --data-parallel-size`)
and the single-process server's flags all still apply. Nothing here imports Ray until the cluster runs, so
`pagedllm serve` works without the `cluster` extra.
"""

from __future__ import annotations

import argparse
from typing import Any

from pagedllm.cluster.config import ClusterConfig
from pagedllm.entrypoints.serve_args import (
    add_serve_args,
    check_can_listen,
    check_cluster_args,
    check_server_args,
    lora_modules,
)


def settings_from_args(args: argparse.Namespace) -> tuple[Any, ClusterConfig, Any]:
    """(EngineConfig, ClusterConfig, IngressSettings) from the flags, checked once here; the model is looked up
    here, before Ray starts, so a bad path is one line and not a replica that fails to start over and over."""
    from pagedllm.cluster.ingress import IngressSettings
    from pagedllm.engine.config import EngineConfig
    from pagedllm.engine.pooling import read_pooler_config
    from pagedllm.model.config import load_model_config, resolve_model_path
    from pagedllm.server.embedders import embedding_model_path

    server = check_server_args(args)
    cluster = check_cluster_args(args)
    assert cluster is not None, "the cluster runs only with --replicas"
    config = EngineConfig.from_args(args)
    load_model_config(config.model)
    if server.embedding_model:
        embedding_model_path(server.embedding_model)  # a bad path is one line here, before Ray starts
    pooler = None if server.generate else read_pooler_config(resolve_model_path(config.model))
    loras = tuple(lora_modules(server, config))
    settings = IngressSettings(model=config.model, server=server, routing=cluster.routing, pooler=pooler, loras=loras)
    return config, cluster, settings


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

    config, cluster, ingress = settings_from_args(args)
    check_can_listen(ingress.server.host, ingress.server.port)
    return serve_cluster(config, cluster, ingress)


def app_builder(args: dict[str, str]) -> Any:
    """For `serve run pagedllm.entrypoints.serve_cluster:app_builder key=value ...`: `pagedllm serve`'s flags,
    checked the same way (replicas=2 is --replicas 2; a flag without a value is key=true)."""
    from pagedllm.cluster.app import build_application

    config, cluster, ingress = settings_from_args(parse_builder_args(args))
    return build_application(config, cluster, ingress)
