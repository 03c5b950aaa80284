"""The OpenAI-compatible HTTP server: `build_app(engine, ...)` and `Server` (uvicorn with pagedllm's shutdown).

Routes come from one router per endpoint family (serving_completion, serving_chat, serving_tokenization,
serving_info, serving_rag), each over the `ServingContext` in `app.state.serving`; another feature adds its own
router with one `include_router` line here.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, FastAPI
from fastapi.openapi.utils import get_openapi

from pagedllm.engine.interfaces import AsyncEngine
from pagedllm.engine.pooling import PoolerConfig
from pagedllm.lora_request import LoRARequest
from pagedllm.server import (
    serving_chat,
    serving_completion,
    serving_embedding,
    serving_info,
    serving_lora,
    serving_messages,
    serving_rag,
    serving_responses,
    serving_tokenization,
)
from pagedllm.server.config import ServerConfig
from pagedllm.server.embedders import Embedder, EngineEmbedder
from pagedllm.server.errors import install_error_handlers
from pagedllm.server.kv_page import router as kv_page_router
from pagedllm.server.middleware import AuthMiddleware, InternalErrorMiddleware, RequestBodyMiddleware
from pagedllm.server.protocol_messages import MessageStreamEvent
from pagedllm.server.protocol_responses import ResponseStreamEvent
from pagedllm.server.reasoning import REASONING_PARSERS
from pagedllm.server.serving_engine import ServingContext
from pagedllm.server.serving_lora import parse_lora_modules, runtime_updates_allowed
from pagedllm.server.streaming import STREAM_RESPONSES

if TYPE_CHECKING:
    from pagedllm.rag import RagPipeline

logger = logging.getLogger("pagedllm.server")


def build_app(
    engine: AsyncEngine,
    config: ServerConfig | None = None,
    *,
    model_root: str | None = None,
    rag: RagPipeline | None = None,
    state_routers: Sequence[APIRouter] | None = None,
    pooler: PoolerConfig | None = None,
    embedders: Sequence[Embedder] = (),
    lora_modules: Sequence[LoRARequest] = (),
) -> FastAPI:
    """The FastAPI app over a (not necessarily started) async engine, as `config` (the server's settings, the
    flags of `pagedllm serve`) says; the app starts and stops the engine. `model_root`: the model's path, where
    the names in /v1/models are rooted (default: the engine's model name). `rag` adds POST
    /v1/rag/chat/completions. `state_routers`: the routes that show the engine's state (default: /health,
    /metrics, /v1/models, /v1/kv and the /kv block map, of one engine); a cluster answers them per replica
    instead. `pooler`: the engine's model also serves /v1/embeddings under its names, pooled that way (with
    `--runner pooling` no completion routes); `embedders`: other embedding models (`--embedding-model`).
    `lora_modules`: LoRA adapters served by name (default: config's --lora-modules; the engine needs enable_lora); with
    VLLM_ALLOW_RUNTIME_LORA_UPDATING true, the load / unload routes too."""
    config = config or ServerConfig()
    root = model_root or engine.model_config.name or "pagedllm"
    names = list(config.served_model_name or [root])

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            engine.shutdown()

    app = FastAPI(title="pagedllm OpenAI-compatible server", lifespan=lifespan)
    app.state.engine = engine
    reasoning = REASONING_PARSERS[config.reasoning_parser] if config.reasoning_parser is not None else None
    app.state.serving = ServingContext(
        engine,
        names,
        root,
        tool_call_parser=config.tool_call_parser,
        reasoning=reasoning,
        trust_request_chat_template=config.trust_request_chat_template,
        loras={lora.lora_name: lora for lora in lora_modules or parse_lora_modules(config.lora_modules or [])},
    )
    app.state.rag = rag
    own = [EngineEmbedder(app.state.serving, pooler)] if pooler is not None else []
    app.state.embedders, app.state.max_embedding_tokens = [*own, *embedders], config.max_embedding_tokens
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]  # FastAPI's documented way to extend it
    install_error_handlers(app)
    _include_routes(app, state_routers, config.generate, rag is not None)
    app.add_middleware(InternalErrorMiddleware)
    app.add_middleware(RequestBodyMiddleware, max_bytes=config.max_request_bytes)
    if config.api_key:
        app.add_middleware(AuthMiddleware, api_key=config.api_key)
    return app


def _include_routes(app: FastAPI, state_routers: Sequence[APIRouter] | None, generate: bool, rag: bool) -> None:
    """One include_router line per endpoint family: the state routes, generation (unless the model only pools),
    tokenization and embeddings, and the RAG route when there is an index."""
    for router in state_routers if state_routers is not None else (serving_info.router, kv_page_router):
        app.include_router(router)  # kv_page_router: GET /kv (the live block map), GET /v1/kv/blocks (its data)
    generation = (serving_completion, serving_chat, serving_responses, serving_messages) if generate else ()
    for module in (*generation, serving_tokenization, serving_embedding):
        app.include_router(module.router)
    if generate and runtime_updates_allowed():  # one engine in this process, or a cluster's every replica
        app.include_router(serving_lora.router)
    if rag:
        app.include_router(serving_rag.router)


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema, plus the chunk models the streams send (their routes' text/event-stream answers point to
    them: FastAPI only collects the JSON ones)."""
    if app.openapi_schema is None:
        spec = get_openapi(title=app.title, version=app.version, routes=app.routes)
        schemas = spec.setdefault("components", {}).setdefault("schemas", {})
        for model in [*STREAM_RESPONSES.values(), ResponseStreamEvent, MessageStreamEvent]:
            own = model.model_json_schema(ref_template="#/components/schemas/{model}", mode="serialization")
            for name, schema in {**own.pop("$defs", {}), model.__name__: own}.items():
                schemas.setdefault(name, schema)
        app.openapi_schema = spec
    return app.openapi_schema


# -------------------------------------------------------------------- running it
class Server:
    """uvicorn on a socket, with pagedllm's shutdown: on SIGINT/SIGTERM stop accepting, abort what runs, exit 0;
    if the engine loop dies (it stops being healthy while serving), exit 1, as vLLM does.

    `run()` blocks (installs signal handlers when on the main thread); `start_in_thread()` is for tests.
    """

    def __init__(
        self,
        app: FastAPI,
        host: str = "127.0.0.1",
        port: int = 8000,
        log_level: str = "info",
        graceful_timeout: float = 5.0,
    ) -> None:
        import uvicorn

        self.app = app
        self.engine: AsyncEngine = app.state.engine
        self.exit_code = 0
        self._shutting_down = False
        config = uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level=log_level,
            lifespan="on",
            timeout_graceful_shutdown=int(graceful_timeout),
            access_log=log_level == "debug",
        )
        outer = self

        class _Uvicorn(uvicorn.Server):
            async def on_tick(self, counter: int) -> bool:  # every 0.1 s while serving
                if not outer._shutting_down and not outer.engine.is_healthy:
                    outer.engine_died()
                return await super().on_tick(counter)

            def handle_exit(self, sig: int, frame: Any) -> None:
                outer.begin_shutdown()
                if self.should_exit and sig == signal.SIGINT:
                    self.force_exit = True
                self.should_exit = True

            @contextlib.contextmanager
            def capture_signals(self) -> Iterator[None]:  # no re-raise after a graceful stop: exit 0
                if threading.current_thread() is not threading.main_thread():
                    yield
                    return
                handled = (signal.SIGINT, signal.SIGTERM)
                original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
                try:
                    yield
                finally:
                    for sig, handler in original.items():
                        signal.signal(sig, handler)

        self.uvicorn = _Uvicorn(config)
        self._thread: threading.Thread | None = None

    def engine_died(self) -> None:
        """The engine loop crashed (its streams are failed already): stop serving and exit non-zero, so that a
        supervisor restarts the server instead of it answering 503 for ever."""
        logger.error("the engine loop died: shutting the server down")
        self._shutting_down = True
        self.exit_code = 1
        self.uvicorn.should_exit = True

    def begin_shutdown(self) -> None:
        """Stop taking requests and abort those in flight, so open streams end at once."""
        logger.info("shutting down: aborting requests in flight")
        self._shutting_down = True
        self.engine.stop_accepting()
        self.engine.abort_all()

    def run(self) -> int:
        """Serve until SIGINT/SIGTERM (0) or the engine's death (1); the exit status."""
        self.uvicorn.run()
        return self.exit_code

    def start_in_thread(self, timeout: float = 120.0) -> None:
        self._thread = threading.Thread(target=self.run, name="pagedllm-uvicorn", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.uvicorn.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)

    def stop(self, timeout: float = 30.0) -> None:
        self.begin_shutdown()
        self.uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
