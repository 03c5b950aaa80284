"""`pagedllm serve`'s flags (engine, server, cluster) and their checks, in one place: the single server
(`serve.py`) and the cluster (`serve_cluster.py`, also behind Ray Serve's `serve run`) parse the same flags.
Each group is a settings class declared where it is used (`EngineConfig`, `server.config.ServerConfig`,
`cluster.config.ClusterConfig`), so a flag's type, default, check and help are written once and a bad value is
one line naming the flag."""

from __future__ import annotations

import argparse
import socket
from typing import TYPE_CHECKING

from pagedllm.cluster.config import ClusterConfig
from pagedllm.errors import UserError
from pagedllm.server.config import ServerConfig
from pagedllm.settings import add_flags, flag_name, from_args

if TYPE_CHECKING:
    from pagedllm.engine.config import EngineConfig
    from pagedllm.lora_request import LoRARequest

DEFAULT_SERVED_NAME = "SmolLM2-135M-Instruct"  # model_name() of the default model's file

CLUSTER_FLAGS = tuple(n for n in ClusterConfig.__pydantic_fields__ if n != "replicas")  # type: ignore[attr-defined]


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    from pagedllm.engine.config import add_engine_args

    add_engine_args(parser)
    add_flags(parser.add_argument_group("server"), ServerConfig)
    add_cluster_args(parser)


def add_cluster_args(parser: argparse.ArgumentParser) -> None:
    add_flags(parser.add_argument_group("cluster (needs pip install 'pagedllm[cluster]')"), ClusterConfig)


def check_server_args(args: argparse.Namespace) -> ServerConfig:
    """The server's settings from its flags, --served-model-name resolved (`served_names`)."""
    config = from_args(ServerConfig, args)
    config.served_model_name = served_names(args)
    return config


def check_cluster_args(args: argparse.Namespace) -> ClusterConfig | None:
    """The cluster's settings (None without --replicas); a cluster flag without --replicas, or one that makes no
    sense, is one line naming the flag."""
    if args.replicas is None:
        given = [f for f in CLUSTER_FLAGS if getattr(args, f) is not None]
        if given:
            raise UserError(f"{flag_name(given[0])}: only with --replicas N (a cluster)")
        return None
    cluster = from_args(ClusterConfig, args)
    if getattr(args, "rag_index", None):
        raise UserError("--rag-index: the cluster does not serve RAG yet; run it without --replicas")
    try:
        import ray.serve  # noqa: F401 - only whether the cluster extra is installed
    except ImportError:
        raise UserError("--replicas: needs Ray Serve: pip install 'pagedllm[cluster]'") from None
    return cluster


def served_names(args: argparse.Namespace) -> list[str]:
    """--served-model-name, else the model's one name (its file or folder's base name), as in logs and /v1/kv."""
    from pagedllm.model.config import model_name

    if args.served_model_name:
        return list(args.served_model_name)
    return [model_name(args.model) if args.model else DEFAULT_SERVED_NAME]


def check_can_listen(host: str, port: int) -> None:
    """Fail on a taken address before a model load (or a Ray start) takes its seconds, not after."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise UserError(f"--host/--port: cannot listen on {host}:{port}: {e.strerror or e}") from None


def lora_modules(server: ServerConfig, engine: EngineConfig) -> list[LoRARequest]:
    """--lora-modules as LoRARequests (checked: each name=path or vLLM's JSON, each path there; --enable-lora
    given). Checked before any model loads: a cluster's replicas load them, and what fails there is told only
    once Ray Serve has given up retrying the replicas."""
    import os

    from pagedllm.server.serving_lora import parse_lora_modules

    if not server.lora_modules:
        return []
    if not engine.enable_lora:
        raise UserError("--lora-modules: needs --enable-lora")
    loras = parse_lora_modules(server.lora_modules)
    for lora in loras:
        if not os.path.exists(lora.lora_path):
            raise UserError(f"--lora-modules: {lora.lora_name}: no PEFT folder or GGUF file at {lora.lora_path}")
    return loras
