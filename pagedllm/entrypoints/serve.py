"""`pagedllm serve [MODEL]`: the OpenAI-compatible server (default model, 127.0.0.1:8000); with --replicas N,
the cluster (`serve_cluster.py`)."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import TYPE_CHECKING

from pagedllm.entrypoints.serve_args import (
    DEFAULT_SERVED_NAME,
    add_serve_args,
    check_can_listen,
    check_cluster_args,
    check_server_args,
    lora_modules,
)
from pagedllm.errors import UserError

if TYPE_CHECKING:
    from pagedllm.server.config import ServerConfig
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

    if args.replicas is not None:
        return run_cluster(args)
    server_config = check_server_args(args)
    check_cluster_args(args)
    check_can_listen(server_config.host, server_config.port)  # before the model load, not after it
    config = EngineConfig.from_args(args)

    logging.basicConfig(
        level=getattr(logging, server_config.log_level.upper()), format="%(levelname)s %(name)s: %(message)s"
    )
    from pagedllm.engine.async_engine import AsyncLLMEngine
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.engine.pooling import read_pooler_config
    from pagedllm.server.api_server import Server, build_app

    rag = None
    if server_config.rag_index:
        from pagedllm.rag import RagPipeline

        s = server_config
        rag = RagPipeline(s.rag_index, top_k=s.rag_top_k, layout=s.rag_layout, kv_blend=s.rag_kv_blend)
    names = server_config.served_model_name or []
    print(f"pagedllm serve: loading {config.model or DEFAULT_SERVED_NAME} ...", file=sys.stderr, flush=True)
    embedders = load_embedders(server_config)  # before the generator: a bad path fails in seconds, not after its load
    loras = lora_modules(server_config, config)
    core = LLMEngine(config)
    for lora in loras:
        core.add_lora(lora)  # a bad adapter fails at start-up, naming it
    engine = AsyncLLMEngine(core, max_waiting_requests=server_config.max_waiting_requests)
    pooler = None if server_config.generate else read_pooler_config(core.loaded.path)
    app = build_app(
        engine,
        server_config,
        model_root=config.model or names[0],
        rag=rag,
        pooler=pooler,
        embedders=embedders,
        lora_modules=loras,
    )
    host, port = server_config.host, server_config.port
    server = Server(app, host=host, port=port, log_level=server_config.log_level)
    print(
        f"pagedllm serve: serving {', '.join(names)} on http://{host}:{port} "
        f"(max_model_len {engine.max_model_len}{', API key required' if server_config.api_key else ''})",
        file=sys.stderr,
        flush=True,
    )
    status = server.run()
    if server.uvicorn.started is False and not server.uvicorn.should_exit:
        raise UserError(f"could not start the server on {host}:{port}")
    return status


def load_embedders(config: ServerConfig) -> list[Embedder]:
    """--embedding-model: a sentence-transformers model served next to the generator (`--runner pooling` makes
    the generator's own model the embedder instead: build_app's `pooler`)."""
    from pagedllm.server.embedders import SentenceTransformerEmbedder

    return [SentenceTransformerEmbedder(config.embedding_model)] if config.embedding_model else []
