"""OpenAI-style error bodies, `{"error": {"message", "type", "param", "code"}}` with vLLM's type names, and the
app's exception handlers: every failure a client can cause is a 4xx naming the field, and the body is always
valid UTF-8 JSON (messages quote what was sent, which may hold a lone surrogate)."""

from __future__ import annotations

import json
import logging
import re
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedllm.engine.async_engine import (
    EngineBusyError,
    EngineDeadError,
    RequestAbortedError,
    TooManyWaitingRequestsError,
)
from pagedllm.errors import UserError
from pagedllm.server.protocol import ResponseModel
from pagedllm.server.protocol_messages import AnthropicError, AnthropicErrorResponse

logger = logging.getLogger("pagedllm.server")


class ErrorInfo(ResponseModel):
    message: str
    type: str
    param: str | None
    code: int


class ErrorResponse(ResponseModel):
    error: ErrorInfo


_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "BadRequestError",
    415: "BadRequestError",
    422: "BadRequestError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}

# What /openapi.json lists as each route's error answers (Anthropic's shape on its routes).
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": HTTPStatus(status).phrase}
    for status in (400, 401, 404, 413, 415, 500, 503)
}
ANTHROPIC_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": AnthropicErrorResponse, "description": HTTPStatus(status).phrase}
    for status in (400, 401, 404, 413, 415, 500, 503)
}


class APIError(Exception):
    """An error the server answers with `status` and an OpenAI error body."""

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.status, self.param)


def _utf8(text: str) -> str:
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_body(message: str, status: int, param: str | None = None, path: str = "") -> dict[str, Any]:
    """OpenAI's error body, `ErrorResponse` as JSON; Anthropic's (`AnthropicErrorResponse`) on its routes, whose
    clients read only that shape (the field goes in the message: Anthropic's body has no `param`)."""
    if path in ANTHROPIC_PATHS:
        kind = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
        if param and param not in message:
            message = f"{param}: {message}"
        return AnthropicErrorResponse(type="error", error=AnthropicError(type=kind, message=_utf8(message))).body()
    info = ErrorInfo(
        message=_utf8(message), type=_TYPES.get(status, "Error"), param=_utf8(param) if param else None, code=status
    )
    return ErrorResponse(error=info).body()


ANTHROPIC_PATHS = ("/v1/messages",)
_ANTHROPIC_TYPES = {
    401: "authentication_error",
    404: "not_found_error",
    413: "request_too_large",
    500: "api_error",
    503: "overloaded_error",
}


def error_response(
    message: str, status: int, param: str | None = None, headers: dict[str, str] | None = None, path: str = ""
) -> JSONResponse:
    return JSONResponse(error_body(message, status, param, path), status_code=status, headers=headers)


def error_sse(err: APIError) -> str:
    return f"data: {json.dumps(err.body())}\n\n"


def anthropic_error_sse(err: APIError) -> str:
    """A Messages stream's error: Anthropic's `error` event."""
    body = error_body(err.message, err.status, err.param, ANTHROPIC_PATHS[0])
    return f"event: error\ndata: {json.dumps(body)}\n\n"


def _shown(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (int, float, str, bool, type(None))) else type(value).__name__


_UNION_TAG = re.compile(r"str|int|float|bool|\w+\[.*\]")  # pydantic's name of a union member in a location


def _in_an_object(error: dict[str, Any], first: dict[str, Any]) -> bool:
    """Whether a union member's error is about a field of an object inside the value (`messages.0.content`'s
    list member failing at `.0.text`), not the value's type: that one says what is wrong, not "got list"."""
    loc, head = tuple(error.get("loc", ())), tuple(first.get("loc", ()))
    tags = [i for i, p in enumerate(loc) if isinstance(p, str) and _UNION_TAG.fullmatch(p)]
    if not tags or loc[: tags[0]] != head[: tags[0]]:
        return False
    return any(isinstance(p, str) and not _UNION_TAG.fullmatch(p) for p in loc[tags[0] + 1 :])


def from_errors(errors: list[dict[str, Any]]) -> APIError:
    """One 400 naming the first bad field (dotted path), what is wrong with it and the value sent. FastAPI puts
    "body" first in every location; a union (prompt) fails once per member, reported as one error."""
    if not errors:
        return APIError("Invalid request body", 400)
    first, deep = errors[0], False
    if len(errors) > 1:  # a union fails once per member: the one whose type the value has says what is wrong
        same = [e for e in errors if tuple(e.get("loc", ()))[:2] == tuple(first.get("loc", ()))[:2]]
        first = next((e for e in same if not str(e.get("type", "")).endswith("_type")), first)
        inside = [e for e in errors if _in_an_object(e, first)]  # the member the value was (a list of objects)
        first, deep = max(inside, key=lambda e: len(e.get("loc", ())), default=first), bool(inside)
    loc = [str(p) for p in first.get("loc", ()) if not _UNION_TAG.fullmatch(str(p))]
    loc = loc[1:] if loc[:1] == ["body"] else loc
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if first.get("type") == "json_invalid":
        error = (first.get("ctx") or {}).get("error", "")
        return APIError(f"Malformed JSON in the request body: {error}", 400)
    if not loc:
        # A model-level check ("field: reason") names its field first; a body of the wrong type has no field.
        head = msg.split(":", 1)[0]
        if head.isidentifier() and ":" in msg:
            return APIError(msg, 400, param=head)
        return APIError(f"Invalid request body: {msg}", 400)
    field = loc[0]
    if first.get("type") == "missing":
        return APIError(f"'{'.'.join(loc)}' is a required field", 400, param=field)
    if (
        len(errors) > 1
        and not deep
        and field in ("prompt", "input")
        and first.get("type") != "value_error"  # a member's own check (a Responses item's) says what is wrong
        and all(str(e["loc"][1:2]) == str(first["loc"][1:2]) for e in errors)
    ):
        msg = "must be a string, a list of strings, a list of token ids or a list of lists of token ids"
        return APIError(f"Invalid value for '{field}': {msg}", 400, param=field)
    return APIError(f"Invalid value for '{'.'.join(loc)}': {msg} (got {_shown(first.get('input'))})", 400, param=field)


def install_error_handlers(app: FastAPI) -> None:
    """Map every exception a request can raise to its status; anything else is logged and answered 500 (by
    `InternalErrorMiddleware`, which keeps the connection open). Plain functions: they await nothing."""

    def handle(
        exc_type: type[Exception], status: int, message: str = "{}", headers: dict[str, str] | None = None
    ) -> None:
        def handler(request: Request, e: Exception) -> JSONResponse:
            return error_response(message.format(e), status, getattr(e, "param", None), headers, request.url.path)

        app.add_exception_handler(exc_type, handler)

    def api_error(request: Request, e: Exception) -> JSONResponse:
        assert isinstance(e, APIError)
        return error_response(e.message, e.status, e.param, path=request.url.path)

    def validation_error(request: Request, e: Exception) -> JSONResponse:
        assert isinstance(e, (RequestValidationError, ValidationError))
        err = from_errors([dict(d) for d in e.errors()])
        return error_response(err.message, err.status, err.param, path=request.url.path)

    def http_error(request: Request, e: Exception) -> JSONResponse:
        assert isinstance(e, StarletteHTTPException)
        cause = e.__cause__  # FastAPI's "error parsing the body": too deep, an integer too long, not UTF-8
        detail = f"Malformed JSON in the request body: {cause}" if e.status_code == 400 and cause else str(e.detail)
        headers = dict(e.headers) if e.headers else None
        return error_response(detail, e.status_code, headers=headers, path=request.url.path)

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(ValidationError, validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    handle(TooManyWaitingRequestsError, 503, headers={"Retry-After": "1"})
    handle(EngineDeadError, 503)
    handle(EngineBusyError, 503, headers={"Retry-After": "1"})
    handle(RequestAbortedError, 503, "The request was aborted: {}")
    handle(UserError, 400)
