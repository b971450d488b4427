"""How a response outlives its handler: SSE responses, the client-disconnect watch, and abort.

Every endpoint that runs work (completions, chat, workflows) goes through here, so that all of them
behave the same when the client goes away (the work is aborted and the request counted as 499), when the
work fails after the headers went out (an error event, then ``[DONE]``), and when the server shuts down
(the work is ended early through ``ServerState.stoppers`` and the stream still closes with its final
chunk and ``[DONE]``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, AsyncGenerator, Awaitable, Callable, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from . import protocol as P
from .errors import OpenAIError, from_exception

logger = logging.getLogger("flowrt.server")

ABORTED_KEY = "flowrt_aborted"  # set in scope["state"] when the client went away mid-request
T = TypeVar("T")


def mark_aborted(st: Any, request: Request) -> None:
    """Counts an aborted request; the guard reports it with status 499 (request.state is scope["state"])."""
    setattr(request.state, ABORTED_KEY, True)
    st.metrics.aborted.inc()


async def wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(st: Any, request: Request, work: Awaitable[T]) -> tuple[bool, T | None]:
    """Runs `work` unless the client disconnects first (then it is cancelled and the request counted as
    aborted). Returns (completed, result); exceptions of `work` propagate."""
    task = asyncio.ensure_future(work)
    disc = asyncio.create_task(wait_for_disconnect(request))
    try:
        await asyncio.wait({task, disc}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, disc):
            if not t.done():
                t.cancel()
        await asyncio.gather(task, disc, return_exceptions=True)
    if task.cancelled():
        mark_aborted(st, request)
        return False, None
    return True, task.result()


def _failure_event(e: Exception, what: str) -> str:
    """The error event for a failure after the stream started (a ValueError is the request's fault)."""
    logger.warning("%s failed: %s", what, e, exc_info=not isinstance(e, ValueError))
    err = from_exception(e) if isinstance(e, ValueError) else OpenAIError(f"{type(e).__name__}: {e}", 500)
    return err.sse()


async def guarded(st: Any, request: Request, events: AsyncGenerator[str, None], what: str) -> AsyncGenerator[str, None]:
    """`events` as the body of an SSE response: a client disconnect counts as an abort, and a failure
    mid-stream becomes an error event followed by ``[DONE]`` instead of a cut connection."""
    try:
        async with contextlib.aclosing(events):
            async for event in events:
                yield event
    except (asyncio.CancelledError, GeneratorExit):
        mark_aborted(st, request)
        raise
    except Exception as e:  # noqa: BLE001 - the headers are out: report in-band
        yield _failure_event(e, what)
        yield P.SSE_DONE


class SSEResponse(StreamingResponse):
    """A text/event-stream response that runs `on_close` however it ends (finished, client gone,
    cancelled), even when the body never started: that is where work started for it is released."""

    def __init__(self, events: AsyncGenerator[str, None], on_close: Callable[[], None] | None = None) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if self._on_close is not None:
                self._on_close()
