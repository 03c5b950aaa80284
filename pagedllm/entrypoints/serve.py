"""`pagedllm serve [MODEL]`: the OpenAI-compatible server (default model, 127.0.0.1:8000); with --replicas N,
the cluster (`serve_cluster.py`)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import TYPE_CHECKING

from pagedllm.entrypoints.serve_args import (
    DEFAULT_SERVED_NAME,
    add_serve_args,
    check_can_listen,
    check_cluster_args,
    check_server_args,
    served_names,
)
from pagedllm.errors import UserError

if TYPE_CHECKING:
    from pagedllm.server.embedders import Embedder


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve MODEL (default: SmolLM2-135M-Instruct) over an OpenAI-compatible HTTP API: "
        "/v1/completions, /v1/chat/completions, /v1/responses, /v1/messages (Anthropic's), /v1/embeddings, "
        "/v1/models, /health, /metrics, /tokenize, /detokenize; "
        "and /kv, the KV block pool live in a browser.",
    )
    add_serve_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pagedllm.engine.config import EngineConfig
    from pagedllm.entrypoints.serve_cluster import run_cluster

    check_server_args(args)
    if args.replicas is not None:
        return run_cluster(args)
    check_cluster_args(args)
    check_can_listen(args.host, args.port)  # before the model load, not after it
    api_key = args.api_key or os.environ.get("PAGEDLLM_API_KEY") or None
    config = EngineConfig.from_args(args)

    logging.basicConfig(level=getattr(logging, args.log_level.upper()), format="%(levelname)s %(name)s: %(message)s")
    from pagedllm.engine.async_engine import AsyncLLMEngine
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.engine.pooling import read_pooler_config
    from pagedllm.server.api_server import DEFAULT_MAX_REQUEST_BYTES, Server, build_app

    rag = None
    if args.rag_index:
        from pagedllm.rag import RagPipeline

        rag = RagPipeline(args.rag_index, top_k=args.rag_top_k, layout=args.rag_layout, kv_blend=args.rag_kv_blend)
    names = served_names(args)
    print(f"pagedllm serve: loading {args.model or DEFAULT_SERVED_NAME} ...", file=sys.stderr, flush=True)
    embedders = load_embedders(args)  # before the generator: a bad path fails in seconds, not after its load
    core = LLMEngine(config)
    engine = AsyncLLMEngine(core, max_waiting_requests=args.max_waiting_requests)
    app = build_app(
        engine,
        served_model_names=names,
        api_key=api_key,
        model_root=args.model or names[0],
        rag=rag,
        max_request_bytes=args.max_request_bytes or DEFAULT_MAX_REQUEST_BYTES,
        pooler=read_pooler_config(core.loaded.path) if args.runner == "pooling" else None,
        embedders=embedders,
        max_embedding_tokens=args.max_embedding_tokens,
        generate=args.runner != "pooling",
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        trust_request_chat_template=args.trust_request_chat_template,
    )
    server = Server(app, host=args.host, port=args.port, log_level=args.log_level)
    print(
        f"pagedllm serve: serving {', '.join(names)} on http://{args.host}:{args.port} "
        f"(max_model_len {engine.max_model_len}{', API key required' if api_key else ''})",
        file=sys.stderr,
        flush=True,
    )
    status = server.run()
    if server.uvicorn.started is False and not server.uvicorn.should_exit:
        raise UserError(f"could not start the server on {args.host}:{args.port}")
    return status


def load_embedders(args: argparse.Namespace) -> list[Embedder]:
    """--embedding-model: a sentence-transformers model served next to the generator (`--runner pooling` makes
    the generator's own model the embedder instead: build_app's `pooler`)."""
    from pagedllm.server.embedders import SentenceTransformerEmbedder

    return [SentenceTransformerEmbedder(args.embedding_model)] if args.embedding_model else []
