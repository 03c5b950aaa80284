"""The OpenAI-compatible server's settings, declared once (`pagedllm.settings`): `pagedllm serve` makes its flags
from `ServerConfig`, the single server and the cluster's ingress both build their app from it (`build_app`), and
a Python caller passes the same class."""

from __future__ import annotations

import os
import typing
from typing import Annotated, Literal

from pagedllm.errors import UserError
from pagedllm.rag.layout import LAYOUT_HELP, Layout
from pagedllm.settings import Field, Flag, settings

DEFAULT_MAX_REQUEST_BYTES = 4 * 2**20
DEFAULT_MAX_EMBEDDING_TOKENS = 65536  # ~20 s of all-MiniLM-L6-v2 on 2 cores
ToolCallParser = Literal["hermes", "llama3_json", "mistral", "pythonic", "openai"]  # tool_parsers' TOOL_PARSERS
TOOL_PARSER_NAMES = typing.get_args(ToolCallParser)
ReasoningParserName = Literal["qwen3", "deepseek_r1", "openai_gptoss"]  # reasoning.py's REASONING_PARSERS
REASONING_PARSER_NAMES = typing.get_args(ReasoningParserName)


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
    lora_modules: Annotated[list[str] | None, Flag(metavar="NAME=PATH")] = None
    """LoRA adapters a request picks by its "model": name=path (a PEFT folder or a GGUF LoRA file), or vLLM's JSON
    '{"name": ..., "path": ..., "base_model_name": ...}'; needs --enable-lora (default: none)"""
    api_key: str | None = None
    """require "Authorization: Bearer KEY" on /v1/* (default: $PAGEDLLM_API_KEY, else no key)"""
    max_waiting_requests: Annotated[int, Field(ge=0)] | None = None
    """answer 503 when this many requests already wait to be scheduled (default: no limit)"""
    max_request_bytes: int = Field(default=DEFAULT_MAX_REQUEST_BYTES, ge=1)
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
    max_embedding_tokens: int = Field(default=DEFAULT_MAX_EMBEDDING_TOKENS, ge=1)
    """the most tokens one /v1/embeddings request may hold, all its inputs together; past it a 400 naming input
    (default: 65536, ~20 s of all-MiniLM-L6-v2 on 2 cores); requests take turns in batches either way, so a short
    one never waits for all of a long one"""
    enable_auto_tool_choice: bool = False
    """serve tool_choice "auto" in the format --tool-call-parser names (vLLM's flags; default: off, "auto" is
    parsed in the format the chat template asks for, when it names exactly one)"""
    tool_call_parser: ToolCallParser | None = None
    """the model's tool-call format, parsed for tool_choice "auto" (with --enable-auto-tool-choice; default: the
    chat template's)"""
    reasoning_parser: ReasoningParserName | None = None
    """return a reasoning model's <think> section (openai_gptoss: gpt-oss's analysis channel) apart, as
    reasoning_content; a request's structured output or tool choice then holds the answer after it (default:
    none, the thinking is content; vLLM's flag and names)"""
    trust_request_chat_template: bool = False
    """let requests send their own chat_template (rendered in Jinja's sandbox; a template can still loop for long,
    so only for trusted clients) (default: refused with a 400, as vLLM)"""
    log_level: Literal["critical", "error", "warning", "info", "debug"] = "info"
    """server log level (default: info)"""

    def __post_init__(self) -> None:
        if self.api_key is None:
            self.api_key = os.environ.get("PAGEDLLM_API_KEY") or None
        if self.enable_auto_tool_choice != (self.tool_call_parser is not None):
            given = "--enable-auto-tool-choice" if self.enable_auto_tool_choice else "--tool-call-parser"
            raise UserError(f"{given}: needs --enable-auto-tool-choice and --tool-call-parser NAME together (as vLLM)")

    @property
    def generate(self) -> bool:
        """Whether the app serves completions (with --runner pooling the model only embeds)."""
        return self.runner != "pooling"
