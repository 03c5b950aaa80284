"""The OpenAI-compatible HTTP server: `build_app(async_engine, ...)` and `run_server(...)`.

Routes: POST /v1/completions, POST /v1/chat/completions (both streaming as server-sent events and not),
GET /v1/models, GET /health, GET /metrics, POST /tokenize, POST /detokenize, and GET /v1/kv (a pagedllm debug
route: the KV block pool and the engine's queues, so tests can check every block came back).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import signal
import threading
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedllm.engine.async_engine import (
    AsyncLLMEngine,
    EngineDeadError,
    RequestAbortedError,
    TooManyWaitingRequestsError,
)
from pagedllm.entrypoints.openai import protocol as P
from pagedllm.entrypoints.openai.errors import APIError, error_body, error_response, error_sse, from_validation_error
from pagedllm.entrypoints.openai.kv_page import router as kv_page_router
from pagedllm.entrypoints.openai.metrics import CONTENT_TYPE, ServerMetrics, kv_usage, stat
from pagedllm.entrypoints.openai.serving import OpenAIServing
from pagedllm.errors import UserError

logger = logging.getLogger("pagedllm.server")


class _AuthMiddleware:
    """Pure ASGI (so streaming and disconnects pass through untouched): /v1/* needs `Bearer <key>`."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app = app
        self.api_key = api_key.encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope.get("method") != "OPTIONS" and (
                scope["path"] == "/v1" or scope["path"].startswith("/v1/")):
            auth = b""
            for k, v in scope.get("headers", []):
                if k == b"authorization":
                    auth = v
                    break
            scheme, _, token = auth.partition(b" ")
            if scheme.lower() != b"bearer" or not secrets.compare_digest(token.strip(), self.api_key):
                msg = ("Missing API key: send 'Authorization: Bearer <key>'" if not auth
                       else "Incorrect API key provided")
                resp = JSONResponse(error_body(msg, 401), status_code=401,
                                    headers={"WWW-Authenticate": "Bearer"})
                await resp(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _SSEResponse(StreamingResponse):
    """Server-sent events; however the response ends (done, disconnect, error), its engine requests are aborted."""

    def __init__(self, gen: AsyncIterator[str], on_close: Any) -> None:
        super().__init__(gen, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._gen = gen
        self._on_close = on_close

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with contextlib.suppress(BaseException):
                await self._gen.aclose()
            self._on_close()


async def _parse(request: Request, model: type) -> Any:
    raw = await request.body()
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(f"Malformed JSON in the request body: {e}", 400) from None
    if not isinstance(data, dict):
        raise APIError(f"The request body must be a JSON object, got {type(data).__name__}", 400)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise from_validation_error(e) from None


async def _cancel_on_disconnect(request: Request, coro: Any) -> Any:
    """Run `coro`; if the client goes away first, cancel it (which aborts its engine requests)."""
    task = asyncio.ensure_future(coro)

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        return Response(status_code=499)  # nobody reads it
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()


def build_app(engine: AsyncLLMEngine, *, served_model_names: list[str] | None = None, api_key: str | None = None,
              model_root: str | None = None, max_n: int | None = None, rag: Any = None) -> FastAPI:
    """The FastAPI app over a (not necessarily started) AsyncLLMEngine; the app starts and stops the engine.

    `rag` (a pagedllm.rag.RagPipeline) adds POST /v1/rag/chat/completions.
    """
    names = list(served_model_names or [])
    if not names:
        names = [getattr(engine.engine, "model_name", None) or model_root or "pagedllm"]
    metrics = ServerMetrics(names[0], engine.stats)
    engine.stat_logger = metrics
    serving = OpenAIServing(engine, names, max_n=max_n)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            engine.shutdown()

    app = FastAPI(title="pagedllm OpenAI-compatible server", lifespan=lifespan)
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.served_model_names = names
    created = int(time.time())

    # ---------------------------------------------------------------- errors
    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(TooManyWaitingRequestsError)
    async def _too_many(_: Request, e: TooManyWaitingRequestsError) -> JSONResponse:
        return error_response(str(e), 503, headers={"Retry-After": "1"})

    @app.exception_handler(EngineDeadError)
    async def _dead(_: Request, e: EngineDeadError) -> JSONResponse:
        return error_response(str(e), 503)

    @app.exception_handler(RequestAbortedError)
    async def _aborted(_: Request, e: RequestAbortedError) -> JSONResponse:
        return error_response(f"The request was aborted: {e}", 503)

    @app.exception_handler(UserError)
    async def _user_error(_: Request, e: UserError) -> JSONResponse:
        return error_response(str(e), 400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return error_response(str(e.detail), e.status_code, headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(_: Request, e: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return error_response(f"Internal server error: {type(e).__name__}: {e}", 500)

    # ---------------------------------------------------------------- routes
    @app.get("/health")
    async def health() -> Response:
        if not engine.is_healthy:
            return error_response("the engine loop is not running", 503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def get_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        data = [{"id": n, "object": "model", "created": created, "owned_by": "pagedllm",
                 "root": model_root or n, "parent": None, "max_model_len": engine.max_model_len}
                for n in names]
        return JSONResponse({"object": "list", "data": data})

    @app.get("/v1/kv")
    async def kv_state() -> JSONResponse:
        st = engine.stats()
        total = int(stat(st, "num_total_blocks", "total_blocks", "num_blocks"))
        free = int(stat(st, "num_free_blocks", "free_blocks"))
        return JSONResponse({
            "block_size": int(stat(st, "block_size")),
            "total_blocks": total,
            "free_blocks": free,
            "used_blocks": total - free,
            "cached_blocks": int(stat(st, "num_cached_blocks", "cached_blocks")),
            "kv_cache_usage": kv_usage(st),
            "num_running": int(stat(st, "num_running", "num_requests_running")),
            "num_waiting": int(stat(st, "num_waiting", "num_requests_waiting")),
            "num_aborted": engine.num_aborted,
            "recent_aborted_request_ids": engine.aborted_ids[-32:],
        })

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = await _parse(request, P.CompletionRequest)
        if req.stream:
            return _SSEResponse(*await serving.completion_stream(req, _request_id(request, req, "cmpl")))
        return await _cancel_on_disconnect(request, serving.completion(req, _request_id(request, req, "cmpl")))

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        req = await _parse(request, P.ChatCompletionRequest)
        if req.stream:
            return _SSEResponse(*await serving.chat_stream(req, _request_id(request, req, "chatcmpl")))
        return await _cancel_on_disconnect(request, serving.chat(req, _request_id(request, req, "chatcmpl")))

    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        raw = await request.body()
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(f"Malformed JSON in the request body: {e}", 400) from None
        model = P.TokenizeChatRequest if isinstance(data, dict) and "messages" in data else P.TokenizeCompletionRequest
        try:
            req = model.model_validate(data)
        except ValidationError as e:
            raise from_validation_error(e) from None
        return JSONResponse(serving.tokenize(req))

    @app.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        req = await _parse(request, P.DetokenizeRequest)
        return JSONResponse(serving.detokenize(req))

    if rag is not None:
        @app.post("/v1/rag/chat/completions")
        async def rag_chat(request: Request) -> Response:
            """Chat completions over retrieved context: the last user message is the question; the prompt is
            laid out by the pipeline's layout so that shared chunks hit the prefix cache. The chunks used are in
            the body's `rag` field, or in the `X-RAG-Chunks` header (JSON) of a stream."""
            req = await _parse(request, P.ChatCompletionRequest)
            try:
                question = next((m.text() for m in reversed(req.messages) if m.role == "user"), "")
            except ValueError as e:
                raise APIError(str(e), 400, param="messages") from None
            if not question.strip():
                raise APIError("messages: needs a user message with the question", 400, param="messages")
            messages, hits = await asyncio.to_thread(rag.build_messages, question)
            req.messages = [P.ChatMessage(role=m["role"], content=m["content"]) for m in messages]
            chunks = [h.to_dict(with_text=False) for h in hits]
            rid = _request_id(request, req, "ragcmpl")
            if req.stream:
                resp = _SSEResponse(*await serving.chat_stream(req, rid))
                resp.headers["X-RAG-Chunks"] = json.dumps(chunks)
                return resp
            body = await _cancel_on_disconnect(request, serving.chat(req, rid))
            body["rag"] = {"layout": rag.layout, "chunks": chunks}
            return JSONResponse(body)

    app.include_router(kv_page_router)  # GET /kv (the live block map) and GET /v1/kv/blocks (its data)
    if api_key:
        app.add_middleware(_AuthMiddleware, api_key=api_key)
    return app


def _request_id(request: Request, req: Any, prefix: str) -> str:
    """`<prefix>-<uuid>`, or `<prefix>-<X-Request-Id>-<8 hex>` so a reused header value cannot collide."""
    given = request.headers.get("x-request-id") or None
    return f"{prefix}-{given}-{uuid.uuid4().hex[:8]}" if given else f"{prefix}-{uuid.uuid4().hex}"


# -------------------------------------------------------------------- running it
class Server:
    """uvicorn on a socket, with pagedllm's shutdown: on SIGINT/SIGTERM stop accepting, abort what runs, exit 0.

    `run()` blocks (installs signal handlers when on the main thread); `start_in_thread()` is for tests.
    """

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info",
                 graceful_timeout: float = 5.0) -> None:
        import uvicorn

        self.app = app
        self.engine: AsyncLLMEngine = app.state.engine
        config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                                timeout_graceful_shutdown=graceful_timeout, access_log=log_level == "debug")
        outer = self

        class _Uvicorn(uvicorn.Server):
            def handle_exit(self, sig: int, frame: Any) -> None:  # noqa: ARG002
                outer.begin_shutdown()
                if self.should_exit and sig == signal.SIGINT:
                    self.force_exit = True
                self.should_exit = True

            @contextlib.contextmanager
            def capture_signals(self):  # noqa: ANN202 - no re-raise after a graceful stop: exit 0
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

    def begin_shutdown(self) -> None:
        """Stop taking requests and abort those in flight, so open streams end at once."""
        logger.info("shutting down: aborting requests in flight")
        self.engine.stop_accepting()
        self.engine.abort_all()

    def run(self) -> None:
        self.uvicorn.run()

    def start_in_thread(self, timeout: float = 120.0) -> None:
        self._thread = threading.Thread(target=self.uvicorn.run, name="pagedllm-uvicorn", daemon=True)
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
