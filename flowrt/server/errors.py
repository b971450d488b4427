"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` with the right HTTP status.

Every error the server returns goes through :func:`error_response`, whether it comes from request
validation (pydantic / FastAPI), from the engine refusing a request (ValueError, ValidationError), from
a wrong API key, an unknown model, a body over the size limit, or an unexpected failure (500, logged).
"""

from __future__ import annotations

import json
import logging
from typing import Any, Mapping, Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("flowrt.server")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}


class OpenAIError(Exception):
    """An error to return to the client as OpenAI-shaped JSON."""

    def __init__(self, message: str, status: int = 400, *, type: str | None = None,
                 param: str | None = None, code: str | int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)

    def sse(self) -> str:
        """The error as one Server-Sent Event (for failures after a stream has started)."""
        return f"data: {json.dumps(self.body())}\n\n"


class RequestTooLarge(OpenAIError):
    def __init__(self, limit: int) -> None:
        super().__init__(f"Request body is larger than the server's limit of {limit} bytes.", 413,
                         code="request_too_large")


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(message, 400, param=param, code=code)


def _loc_to_param(loc: tuple | list) -> str | None:
    parts = [str(p) for p in loc if p not in ("body", "query", "path", "header")]
    # pydantic adds the union member tried ("str", "list[int]" ...) to a location; drop those.
    parts = [p for p in parts if not (p.startswith(("list[", "dict[", "function-")) or p in
                                      ("str", "int", "float", "bool", "none", "constrained-str"))]
    return ".".join(parts) or None


def from_validation_errors(errors: Sequence[Mapping[str, Any]]) -> OpenAIError:
    """One 400 error from a list of pydantic error dicts (the first one names `param`)."""
    if not errors:
        return bad_request("Invalid request.")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return bad_request(f"Request body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}",
                           code="invalid_json")
    messages = []
    for e in errors[:5]:
        param = _loc_to_param(e.get("loc", ()))
        messages.append(f"{param}: {e.get('msg')}" if param else str(e.get("msg")))
    more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
    return bad_request("; ".join(dict.fromkeys(messages)) + more, param=_loc_to_param(first.get("loc", ())))


def from_exception(exc: BaseException, param: str | None = None) -> OpenAIError:
    """Map what the engine raises for a bad request (ValueError / ValidationError) to a 400."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, ValidationError):
        return from_validation_errors(exc.errors(include_url=False))
    return bad_request(str(exc) or type(exc).__name__, param=param)


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return from_validation_errors(list(exc.errors())).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        if exc.status_code == 404 and message == "Not Found":
            message = f"Unknown path: {request.method} {request.url.path}"
        err = OpenAIError(message, exc.status_code)
        resp = err.response()
        for k, v in (exc.headers or {}).items():
            resp.headers[k] = v
        return resp

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return OpenAIError(f"Internal server error: {type(exc).__name__}: {exc}", 500).response()
