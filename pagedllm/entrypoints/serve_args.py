"""`pagedllm serve`'s flags (engine, server, cluster) and their checks, in one place: the single server
(`serve.py`) and the cluster (`serve_cluster.py`, also behind Ray Serve's `serve run`) parse the same flags."""

from __future__ import annotations

import argparse
import socket

from pagedllm.cluster.routing import POLICIES
from pagedllm.errors import UserError

DEFAULT_SERVED_NAME = "SmolLM2-135M-Instruct"
CLUSTER_FLAGS = ("ray_address", "routing", "cpus_per_replica", "num_gpus_per_replica", "routing_imbalance_threshold")


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    from pagedllm.engine.config import add_engine_args

    add_engine_args(parser)
    s = parser.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    s.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    s.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="model name(s) clients use in 'model' (default: the MODEL argument, or "
        f"{DEFAULT_SERVED_NAME} for the default model)",
    )
    s.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1/* (default: env PAGEDLLM_API_KEY, else none)",
    )
    s.add_argument(
        "--max-waiting-requests",
        type=int,
        default=None,
        help="answer 503 when this many requests already wait to be scheduled (default: no limit)",
    )
    s.add_argument(
        "--max-request-bytes",
        type=int,
        default=None,
        help="answer 413 to a request body larger than this, before reading it "
        "(default: 4 MiB, ~100x the longest prompt of a 32k-token context)",
    )
    add_chat_args(s)
    s.add_argument(
        "--rag-index", default=None, help="an index from `pagedllm rag ingest`: adds POST /v1/rag/chat/completions"
    )
    s.add_argument("--rag-top-k", type=int, default=4, help="chunks retrieved per RAG question")
    s.add_argument(
        "--rag-layout",
        default="canonical",
        choices=["naive", "canonical", "popular"],
        help="prompt layout of RAG requests (canonical/popular share prefixes in the cache)",
    )
    s.add_argument(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
        help="server log level (default: info)",
    )
    add_cluster_args(parser)


def add_chat_args(s: argparse._ArgumentGroup) -> None:
    """The flags of how chats are rendered and answered (issue 28: reasoning models, request templates)."""
    s.add_argument(
        "--reasoning-parser",
        default=None,
        choices=["qwen3", "deepseek_r1"],
        help="return a reasoning model's <think> section apart, as reasoning_content; a request's structured "
        "output or tool choice then holds the answer after it (default: none, the thinking is content)",
    )
    s.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="let requests send their own chat_template (rendered in Jinja's sandbox; a template can still "
        "loop for long, so only for trusted clients; default: refused with a 400)",
    )


def add_cluster_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("cluster (needs pip install 'pagedllm[cluster]')")
    g.add_argument(
        "--replicas",
        type=int,
        default=None,
        help="serve N engine replicas on Ray Serve behind one OpenAI endpoint (default: one process, no Ray)",
    )
    g.add_argument(
        "--ray-address",
        default=None,
        help="join this Ray cluster (e.g. ray://head:10001, or auto: the one `ray start --head` started here) "
        "instead of starting a local one, which listens on 127.0.0.1 only (replicas on other machines: start "
        "the cluster yourself and pass its address)",
    )
    g.add_argument(
        "--routing",
        default=None,
        choices=POLICIES,
        help="how requests pick a replica: prefix (default: where the prompt's prefix most likely is "
        "cached), kv-events (where the replicas' KV events say it is), round-robin (Ray's "
        "power of two choices, cache-blind)",
    )
    g.add_argument(
        "--routing-imbalance-threshold",
        type=int,
        default=None,
        help="prefix / kv-events: go to the least loaded replica instead when the one holding the "
        "prefix has more than this many requests in flight over it (default: 8)",
    )
    g.add_argument("--cpus-per-replica", type=float, default=None, help="CPUs Ray reserves per replica (default 1)")
    g.add_argument("--num-gpus-per-replica", type=float, default=None, help="GPUs Ray reserves per replica (default 0)")


def check_server_args(args: argparse.Namespace) -> None:
    if not 0 <= args.port <= 65535:
        raise UserError(f"--port: must be in 0..65535, got {args.port}")
    if args.max_waiting_requests is not None and args.max_waiting_requests < 0:
        raise UserError(f"--max-waiting-requests: must be >= 0, got {args.max_waiting_requests}")
    if args.max_request_bytes is not None and args.max_request_bytes < 1:
        raise UserError(f"--max-request-bytes: must be >= 1, got {args.max_request_bytes}")


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
        import ray.serve  # noqa: F401 - only whether the cluster extra is installed
    except ImportError:
        raise UserError("--replicas: needs Ray Serve: pip install 'pagedllm[cluster]'") from None


def served_names(args: argparse.Namespace) -> list[str]:
    if args.served_model_name:
        return list(args.served_model_name)
    return [args.model if args.model else DEFAULT_SERVED_NAME]


def check_can_listen(host: str, port: int) -> None:
    """Fail on a taken address before a model load (or a Ray start) takes its seconds, not after."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise UserError(f"--host/--port: cannot listen on {host}:{port}: {e.strerror or e}") from None
