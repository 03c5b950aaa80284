"""`pagedllm serve`'s flags (engine, server, cluster) and their checks, in one place: the single server
(`serve.py`) and the cluster (`serve_cluster.py`, also behind Ray Serve's `serve run`) parse the same flags.
Each group is a settings class (pagedllm/settings.py), so a flag's type, default, check and help are declared
once and a bad value is one line naming the flag."""

from __future__ import annotations

import argparse
import socket
import typing
from typing import Annotated, Literal

from pagedllm.errors import UserError
from pagedllm.rag.layout import LAYOUT_HELP, Layout
from pagedllm.settings import Field, Flag, add_flags, flag_name, from_args, settings

DEFAULT_SERVED_NAME = "SmolLM2-135M-Instruct"  # model_name() of the default model's file
Routing = Literal["round-robin", "prefix", "kv-events"]  # cluster/routing.py's POLICIES
ToolCallParser = Literal["hermes", "llama3_json", "mistral", "pythonic"]  # server/tool_parsers' TOOL_PARSERS
TOOL_PARSER_NAMES = typing.get_args(ToolCallParser)


@settings
class ServerConfig:
    """The OpenAI-compatible server's own settings (the engine's are EngineConfig's)."""

    host: str = "127.0.0.1"
    """address to listen on (default: 127.0.0.1, this machine only)"""
    port: int = Field(default=8000, ge=0, le=65535)
    """port to listen on (default: 8000)"""
    served_model_name: list[str] | None = None
    """model name(s) clients put in "model" (default: the model file or folder's name without its extension, or
    SmolLM2-135M-Instruct for the default model)"""
    api_key: str | None = None
    """require "Authorization: Bearer KEY" on /v1/* (default: $PAGEDLLM_API_KEY, else no key)"""
    max_waiting_requests: Annotated[int, Field(ge=0)] | None = None
    """answer 503 when this many requests already wait to be scheduled (default: no limit)"""
    max_request_bytes: Annotated[int, Field(ge=1)] | None = None
    """answer 413 to a request body larger than this many bytes, before reading it (default: 4 MiB, ~100x the
    longest prompt of a 32k-token context)"""
    rag_index: str | None = None
    """an index from `pagedllm rag ingest`: adds POST /v1/rag/chat/completions (default: no RAG route)"""
    rag_top_k: int = Field(default=4, ge=1)
    """chunks retrieved per RAG question (default: 4)"""
    rag_layout: Layout = Field(
        default="canonical",
        description=f"RAG requests' layout, as `rag ask --layout`: {LAYOUT_HELP} (default: canonical)",
    )
    rag_kv_blend: bool = False
    """RAG requests mark each retrieved passage as a reusable KV segment (kv_blend: its KV reused wherever it
    lands, --kv-blend-recompute of the passages' tokens recomputed); off by default: an approximation of full prefill
    (docs/benchmarks.md measures its KL and top-1 agreement)"""
    runner: Literal["auto", "generate", "pooling"] = "auto"
    """pooling: MODEL is an embedding model (e.g. a Qwen3-Embedding checkpoint): the engine serves /v1/embeddings,
    pooled as its sentence-transformers files say (else the last token, normalized), and no completions; generate:
    completions and chat (default: auto, which is generate; vLLM's flag)"""
    embedding_model: Annotated[str | None, Flag(metavar="PATH")] = None
    """also serve this sentence-transformers model on /v1/embeddings, named by its folder ('default': the bundled
    all-MiniLM-L6-v2, what `pagedllm rag` embeds with) (default: none)"""
    max_embedding_tokens: int = Field(default=65536, ge=1)
    """the most tokens one /v1/embeddings request may hold, all its inputs together; past it a 400 naming input
    (default: 65536, ~20 s of all-MiniLM-L6-v2 on 2 cores); requests take turns in batches either way, so a short
    one never waits for all of a long one"""
    enable_auto_tool_choice: bool = False
    """serve tool_choice "auto" in the format --tool-call-parser names (vLLM's flags; default: off, "auto" is
    parsed in the format the chat template asks for, when it names exactly one)"""
    tool_call_parser: ToolCallParser | None = None
    """the model's tool-call format, parsed for tool_choice "auto" (with --enable-auto-tool-choice; default: the
    chat template's)"""
    reasoning_parser: Literal["qwen3", "deepseek_r1"] | None = None
    """return a reasoning model's <think> section apart, as reasoning_content; a request's structured output or
    tool choice then holds the answer after it (default: none, the thinking is content; vLLM's flag)"""
    trust_request_chat_template: bool = False
    """let requests send their own chat_template (rendered in Jinja's sandbox; a template can still loop for long,
    so only for trusted clients) (default: refused with a 400, as vLLM)"""
    log_level: Literal["critical", "error", "warning", "info", "debug"] = "info"
    """server log level (default: info)"""


@settings
class ClusterConfig:
    """`pagedllm serve --replicas N`'s settings: engine replicas on Ray Serve behind one endpoint."""

    replicas: Annotated[int, Field(ge=1)] | None = None
    """serve N engine replicas on Ray Serve behind one OpenAI endpoint (default: one process, no Ray)"""
    ray_address: str | None = None
    """join this Ray cluster (e.g. ray://head:10001, or auto: the one `ray start --head` started here) instead of
    starting a local one (default: a local one, which listens on 127.0.0.1 only; replicas on other machines: start
    the cluster yourself and pass its address)"""
    routing: Routing | None = None
    """how a request picks its replica: prefix (the default: where its prompt's prefix is most likely cached),
    kv-events (where the replicas' KV events say it is cached), round-robin (by load alone, blind to the cache:
    Ray Serve's default, the less busy of two replicas drawn at random)"""
    routing_imbalance_threshold: Annotated[int, Field(ge=0)] | None = None
    """prefix / kv-events: go to the least loaded replica instead when the one holding the prefix has more than
    this many requests in flight over it (default: 8)"""
    cpus_per_replica: Annotated[float, Field(gt=0)] | None = None
    """CPUs Ray reserves per replica (default: 1)"""
    num_gpus_per_replica: Annotated[float, Field(ge=0)] | None = None
    """GPUs Ray reserves per replica (default: 0)"""


CLUSTER_FLAGS = tuple(n for n in ClusterConfig.__pydantic_fields__ if n != "replicas")  # type: ignore[attr-defined]


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    from pagedllm.engine.config import add_engine_args

    add_engine_args(parser)
    add_flags(parser.add_argument_group("server"), ServerConfig)
    add_cluster_args(parser)


def add_cluster_args(parser: argparse.ArgumentParser) -> None:
    add_flags(parser.add_argument_group("cluster (needs pip install 'pagedllm[cluster]')"), ClusterConfig)


def check_server_args(args: argparse.Namespace) -> ServerConfig:
    config = from_args(ServerConfig, args)
    if config.enable_auto_tool_choice != (config.tool_call_parser is not None):
        given = "--enable-auto-tool-choice" if config.enable_auto_tool_choice else "--tool-call-parser"
        raise UserError(f"{given}: needs --enable-auto-tool-choice and --tool-call-parser NAME together (as vLLM)")
    return config


def check_cluster_args(args: argparse.Namespace) -> ClusterConfig | None:
    """The cluster's flags without --replicas, or one that makes no sense: one line naming the flag."""
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
