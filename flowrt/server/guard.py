"""The ASGI guard in front of /v1: API key, body size, draining, and request counting.

Pure ASGI (not BaseHTTPMiddleware) so that streaming responses pass through untouched.
"""

from __future__ import annotations

import hmac
from typing import Any, Callable

from starlette.types import Message

from .errors import OpenAIError, RequestTooLarge, bad_request
from .state import ServerState
from .streaming import ABORTED_KEY

_KNOWN_PATHS = ("/v1/models", "/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/workflows")


class Guard:
    """Checks the API key, refuses bodies over the limit (413, chunked ones included) and new requests
    while the server drains (503), and counts requests by endpoint and final status (499 when the client
    disconnected)."""

    def __init__(self, app: Any, state: ServerState) -> None:
        self.app = app
        self.st = state

    @staticmethod
    def _endpoint(path: str) -> str:
        if path in _KNOWN_PATHS:
            return path
        if path.startswith("/v1/models/"):
            return "/v1/models/{model}"
        if path.startswith("/v1/responses/"):
            return "/v1/responses/{id}"
        if path.startswith("/v1/workflows/") and path.endswith("/runs"):
            return "/v1/workflows/{name}/runs"
        return "other"

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1"):
            await self.app(scope, receive, send)
            return
        st = self.st
        status = {"code": 500}

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        st.metrics.in_flight.inc()
        st.in_flight += 1
        try:
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
            err = self._check_key(headers.get("authorization"))
            if err is None and st.shutting_down:
                err = OpenAIError("The server is shutting down.", 503)
            if err is None:
                err = self._check_length(headers.get("content-length"))
            if err is None and "content-length" not in headers:
                receive, err = await self._buffer_body(receive)
            if err is not None:
                await err.response()(scope, receive, counting_send)
                return
            await self.app(scope, receive, counting_send)
        finally:
            st.in_flight -= 1
            st.metrics.in_flight.dec()
            code = "499" if scope.get("state", {}).get(ABORTED_KEY) else str(status["code"])
            st.metrics.requests.labels(endpoint=self._endpoint(scope["path"]), status=code).inc()

    def _check_key(self, authorization: str | None) -> OpenAIError | None:
        key = self.st.api_key
        if key is None:
            return None
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode()):
            return None
        what = "Missing API key" if not authorization else "Incorrect API key provided"
        return OpenAIError(f"{what}: pass it as 'Authorization: Bearer <key>'.", 401,
                           type="invalid_request_error", code="invalid_api_key")

    def _check_length(self, content_length: str | None) -> OpenAIError | None:
        if content_length is None:
            return None
        try:
            n = int(content_length)
        except ValueError:
            return bad_request("Invalid Content-Length header.")
        return RequestTooLarge(self.st.max_body_bytes) if n > self.st.max_body_bytes else None

    async def _buffer_body(self, receive: Callable) -> tuple[Callable, OpenAIError | None]:
        """A body without Content-Length (chunked) is read here, up to the limit, so that an oversized one
        is a 413 before the app sees it; the app then gets the buffered body replayed."""
        limit, chunks, size = self.st.max_body_bytes, [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return receive, None  # the client went away; the app will see the disconnect
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > limit:
                return receive, RequestTooLarge(limit)
            if not message.get("more_body", False):
                break
        body = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return body

        return replay, None
