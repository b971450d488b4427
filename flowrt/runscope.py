"""The threads a run opens, so that a cancelled run (``asyncio.wait_for`` around ``rt.run``, a client
that went away) releases their engine sequences and KV blocks at once, not whenever garbage collection
gets to the frames its cancellation left in reference cycles."""

from __future__ import annotations

import weakref
from contextvars import ContextVar
from typing import Any

__all__ = ["RunThreads", "current_run_threads", "track"]


class RunThreads:
    """Weak references to the threads opened while a run's steps execute."""

    def __init__(self) -> None:
        self._threads: weakref.WeakSet[Any] = weakref.WeakSet()

    def add(self, thread: Any) -> None:
        self._threads.add(thread)

    def close_all(self) -> None:
        """Close every thread still alive (each closes its engine sequence, aborting its request)."""
        for thread in list(self._threads):
            try:
                thread.close()
            except Exception:  # one thread's failure must not keep the others' blocks
                pass


current_run_threads: ContextVar[RunThreads | None] = ContextVar("flowrt_run_threads", default=None)


def track(thread: Any) -> None:
    """Register a new thread with the run executing in this context, if any."""
    run = current_run_threads.get()
    if run is not None:
        run.add(thread)
