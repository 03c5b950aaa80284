"""`pagedllm serve [MODEL]`: the OpenAI-compatible server (default model, 127.0.0.1:8000)."""
from __future__ import annotations

import argparse
import logging
import os
import socket
import sys

from pagedllm.errors import UserError

DEFAULT_SERVED_NAME = "SmolLM2-135M-Instruct"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from pagedllm.cluster.launch import add_cluster_args
    from pagedllm.engine.config import add_engine_args

    p = subparsers.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve MODEL (default: SmolLM2-135M-Instruct) over an OpenAI-compatible HTTP API: "
                    "/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics, /tokenize, /detokenize; "
                    "and /kv, the KV block pool live in a browser.")
    add_engine_args(p)
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    s.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    s.add_argument("--served-model-name", nargs="+", default=None,
                   help="model name(s) clients use in 'model' (default: the MODEL argument, or "
                        f"{DEFAULT_SERVED_NAME} for the default model)")
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: env PAGEDLLM_API_KEY, else none)")
    s.add_argument("--max-waiting-requests", type=int, default=None,
                   help="answer 503 when this many requests already wait to be scheduled (default: no limit)")
    s.add_argument("--max-request-bytes", type=int, default=None,
                   help="answer 413 to a request body larger than this, before reading it "
                        "(default: 4 MiB, ~100x the longest prompt of a 32k-token context)")
    s.add_argument("--rag-index", default=None,
                   help="an index from `pagedllm rag ingest`: adds POST /v1/rag/chat/completions")
    s.add_argument("--rag-top-k", type=int, default=4, help="chunks retrieved per RAG question")
    s.add_argument("--rag-layout", default="canonical", choices=["naive", "canonical", "popular"],
                   help="prompt layout of RAG requests (canonical/popular share prefixes in the cache)")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="server log level (default: info)")
    add_cluster_args(p)
    p.set_defaults(func=run)


def served_names(args: argparse.Namespace) -> list[str]:
    if args.served_model_name:
        return list(args.served_model_name)
    return [args.model if args.model else DEFAULT_SERVED_NAME]


def _check_can_listen(host: str, port: int) -> None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise UserError(f"--host/--port: cannot listen on {host}:{port}: {e.strerror or e}") from None


def run(args: argparse.Namespace) -> int:
    from pagedllm.cluster.launch import check_cluster_args, run_cluster
    from pagedllm.engine.config import EngineConfig

    if not 0 <= args.port <= 65535:
        raise UserError(f"--port: must be in 0..65535, got {args.port}")
    if args.max_waiting_requests is not None and args.max_waiting_requests < 0:
        raise UserError(f"--max-waiting-requests: must be >= 0, got {args.max_waiting_requests}")
    if args.max_request_bytes is not None and args.max_request_bytes < 1:
        raise UserError(f"--max-request-bytes: must be >= 1, got {args.max_request_bytes}")
    if args.replicas is not None:
        return run_cluster(args)
    check_cluster_args(args)
    _check_can_listen(args.host, args.port)  # before the model load, not after it
    api_key = args.api_key or os.environ.get("PAGEDLLM_API_KEY") or None
    config = EngineConfig.from_args(args)

    logging.basicConfig(level=getattr(logging, args.log_level.upper()), format="%(levelname)s %(name)s: %(message)s")
    from pagedllm.engine.async_engine import AsyncLLMEngine
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.entrypoints.openai.api_server import DEFAULT_MAX_REQUEST_BYTES, Server, build_app

    rag = None
    if args.rag_index:
        from pagedllm.rag import RagPipeline

        rag = RagPipeline(args.rag_index, top_k=args.rag_top_k, layout=args.rag_layout)
    names = served_names(args)
    print(f"pagedllm serve: loading {args.model or DEFAULT_SERVED_NAME} ...", file=sys.stderr, flush=True)
    engine = AsyncLLMEngine(LLMEngine(config), max_waiting_requests=args.max_waiting_requests)
    app = build_app(engine, served_model_names=names, api_key=api_key, model_root=args.model or names[0],
                    rag=rag, max_request_bytes=args.max_request_bytes or DEFAULT_MAX_REQUEST_BYTES)
    server = Server(app, host=args.host, port=args.port, log_level=args.log_level)
    print(f"pagedllm serve: serving {', '.join(names)} on http://{args.host}:{args.port} "
          f"(max_model_len {engine.max_model_len}{', API key required' if api_key else ''})",
          file=sys.stderr, flush=True)
    status = server.run()
    if server.uvicorn.started is False and not server.uvicorn.should_exit:
        raise UserError(f"could not start the server on {args.host}:{args.port}")
    return status
