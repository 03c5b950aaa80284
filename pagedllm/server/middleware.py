"""Pure ASGI middleware (so streaming and disconnects pass through untouched): the API key, the request size
limit, and the last-resort 500 that does not drop the connection."""

from __future__ import annotations

import logging
import secrets

from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedllm.server.errors import error_body, error_response

logger = logging.getLogger("pagedllm.server")

# Routes that need the key: everything but /health, /metrics and the docs (as vLLM).
PROTECTED_PREFIXES = ("/v1", "/tokenize", "/detokenize")


def _header(scope: Scope, name: bytes) -> bytes | None:
    return next((v for k, v in scope.get("headers", []) if k == name), None)


class AuthMiddleware:
    """/v1/*, /tokenize and /detokenize need `Authorization: Bearer <key>` (or Anthropic's `x-api-key: <key>`,
    which its SDK sends)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.api_key = api_key.encode()

    def _protected(self, scope: Scope) -> bool:
        if scope["type"] != "http" or scope.get("method") == "OPTIONS":
            return False
        path = scope["path"]
        return any(path == p or path.startswith(p + "/") for p in PROTECTED_PREFIXES)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._protected(scope):
            auth = _header(scope, b"authorization") or b""
            scheme, _, token = auth.partition(b" ")
            key = _header(scope, b"x-api-key")
            if key is not None and not auth:
                scheme, token = b"bearer", key
            if scheme.lower() != b"bearer" or not secrets.compare_digest(token.strip(), self.api_key):
                msg = (
                    "Missing API key: send 'Authorization: Bearer <key>'"
                    if not auth and key is None
                    else "Incorrect API key provided"
                )
                body = error_body(msg, 401, path=scope["path"])
                resp = JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})
                await resp(scope, receive, send)
                return
        await self.app(scope, receive, send)


class RequestBodyMiddleware:
    """Bodies over `max_bytes` are answered 413 before anything parses them: at once from Content-Length, or as
    soon as a chunked body's running count passes the limit. Every POST body of this API is JSON, and one labelled
    otherwise (or not at all) is a 415: a web page may send a form or text/plain post to a local server without a
    CORS preflight, and only application/json needs one, so no page can make the server generate for it."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self) -> str:
        return f"The request body is larger than --max-request-bytes ({self.max_bytes:,} bytes)"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        length = _header(scope, b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            too_large = error_response(self._too_large(), 413, headers={"Connection": "close"}, path=scope["path"])
            await too_large(scope, receive, send)
            return
        kind = (_header(scope, b"content-type") or b"").split(b";")[0].strip().lower()
        if kind != b"application/json":
            shown = kind.decode("latin-1") or "none"
            message = f"The request body must be JSON, sent with Content-Type: application/json (got {shown})"
            await error_response(message, 415, path=scope["path"])(scope, receive, send)
            return
        seen = 0

        async def counting_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise HTTPException(413, self._too_large(), headers={"Connection": "close"})
            return message

        await self.app(scope, counting_receive, send)


class InternalErrorMiddleware:
    """An exception no handler knows becomes a logged 500 here, inside Starlette's ServerErrorMiddleware, which
    would re-raise it and so make uvicorn close the connection (a keep-alive client's next request fails)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as e:
            logger.exception("unhandled error")
            if started:
                raise
            message = f"Internal server error: {type(e).__name__}: {e}"
            await error_response(message, 500, path=scope["path"])(scope, receive, send)
