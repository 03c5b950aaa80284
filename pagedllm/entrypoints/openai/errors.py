"""OpenAI-style error bodies: `{"error": {"message", "type", "param", "code"}}`, with vLLM's type names."""
from __future__ import annotations

import json
from http import HTTPStatus
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import ValidationError

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "BadRequestError",
    422: "BadRequestError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class APIError(Exception):
    """An error the server answers with `status` and an OpenAI error body."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, type: str | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.type = type or _TYPES.get(status, HTTPStatus(status).phrase.replace(" ", "") + "Error")

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.status, self.param, self.type)


def error_body(message: str, status: int, param: str | None = None, type: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type or _TYPES.get(status, "Error"), "param": param,
                      "code": status}}


def error_response(message: str, status: int, param: str | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, param), status_code=status, headers=headers)


def error_sse(err: APIError) -> str:
    return f"data: {json.dumps(err.body())}\n\n"


def from_validation_error(e: ValidationError) -> APIError:
    """One 400 naming the first bad field (dotted path), what is wrong with it and the value sent."""
    errs = e.errors(include_url=False)
    if not errs:
        return APIError(str(e), 400)
    # A union (prompt) fails once per member; report the member that got furthest, but name the field.
    first = errs[0]
    loc = [str(p) for p in first.get("loc", ())]
    field = loc[0] if loc else None
    path = ".".join(loc)
    msg = first.get("msg", "invalid value")
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    if first.get("type") == "missing":
        return APIError(f"'{field}' is a required field", 400, param=field)
    if not loc:
        # A model-level check ("field: reason") names its field first.
        head = msg.split(":", 1)[0].split(" ", 1)[0]
        return APIError(msg, 400, param=head if head.isidentifier() else None)
    value = first.get("input")
    shown = json.dumps(value) if isinstance(value, (int, float, str, bool, type(None))) else type(value).__name__
    if len(errs) > 1 and all(str(x.get("loc", ("",))[0]) == field for x in errs):
        # union mismatch: several member errors for one field
        if field == "prompt":
            msg = "must be a string, a list of strings, a list of token ids or a list of lists of token ids"
        return APIError(f"Invalid value for '{field}': {msg} (got {shown})", 400, param=field)
    return APIError(f"Invalid value for '{path}': {msg} (got {shown})", 400, param=field)
