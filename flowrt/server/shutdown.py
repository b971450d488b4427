"""Graceful shutdown for ``flowrt serve``: drain, then stop; a second signal stops at once.

uvicorn alone closes the listening socket as soon as a signal arrives (so /health refuses connections
instead of telling a load balancer to go away) and, past its grace period, cancels the tasks that still
stream (cutting them mid-chunk). Here the first SIGTERM/SIGINT starts a drain instead: the socket stays
open, /health and new /v1 requests answer 503, in-flight requests get the grace period to finish, and
those still running after it are ended through ``ServerState.stop_all`` (streams close with a final
``finish_reason: "abort"`` chunk and ``[DONE]``). Only then does uvicorn shut down. A second signal skips
whatever is left of the drain.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
import time
from typing import Any, Callable, Iterator

import uvicorn

from .state import ServerState

logger = logging.getLogger("flowrt.server")

# whole seconds (uvicorn's graceful-shutdown timeout takes an int)
STOP_FLUSH_SECONDS = 5  # after stop_all: time for the ended requests to send their last bytes
_HANDLED = (signal.SIGINT, signal.SIGTERM)


class DrainingServer(uvicorn.Server):
    """uvicorn's server with the drain above; `forced` tells whether a second signal cut it short."""

    def __init__(self, config: uvicorn.Config, state: ServerState, grace: float) -> None:
        super().__init__(config)
        self.st = state
        self.grace = grace
        self.forced = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain: asyncio.Task | None = None  # held: the event loop keeps only weak references to tasks

    async def startup(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """As uvicorn's, without re-raising the signal afterwards: a drained shutdown exits 0."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in _HANDLED}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: Any) -> None:
        # A signal handler runs between two bytecodes of the event loop's thread, perhaps while that code
        # holds the engine's lock: it only sets flags and schedules the real work on the loop.
        name = signal.Signals(sig).name
        if self.st.shutting_down:
            self.forced = self.force_exit = self.should_exit = True
            self._call_soon(self._force, name)
            return
        self.st.shutting_down = True
        if not self._call_soon(self._start_drain, name):
            self.should_exit = True  # not serving yet: nothing to drain

    def _call_soon(self, callback: Callable[..., None], *args: Any) -> bool:
        if self._loop is None or not self.started:
            return False
        self._loop.call_soon_threadsafe(callback, *args)
        return True

    def _force(self, name: str) -> None:
        logger.warning("Second %s: ending %d request(s) and exiting now", name, self.st.stop_all())

    def _start_drain(self, name: str) -> None:
        logger.info("%s: shutting down", name)
        self._drain = asyncio.ensure_future(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        st = self.st
        if st.in_flight:
            logger.info("Draining: /health answers 503 and new requests are refused; waiting up to %g s for "
                        "%d in-flight request(s) (signal again to exit now)", self.grace, st.in_flight)
        if not await self._wait_idle(self.grace):
            logger.warning("Grace period over: ending %d request(s) early", st.stop_all())
            await self._wait_idle(STOP_FLUSH_SECONDS)
        self.should_exit = True

    async def _wait_idle(self, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while self.st.in_flight and time.monotonic() < deadline and not self.force_exit:
            await asyncio.sleep(0.05)
        return not self.st.in_flight
