"""The run a piece of code is part of, as context variables: the step running and its tracer, the threads
the run opened and the sink its events go to.

The runner sets them (flowrt.runner.executor) and the LLM handles read them (flowrt.llm: a Model tags its
requests with the step, a Thread registers with its run and streams its tokens), so both import this module
and neither imports the other for it.

The threads a run opens are kept so that a cancelled run (``asyncio.wait_for`` around ``rt.run``, a client
that went away) releases their engine sequences and KV blocks at once, not whenever garbage collection
gets to the frames its cancellation left in reference cycles."""

from __future__ import annotations

import itertools
import os
import weakref
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .events import EventSink
    from .runner.trace import Tracer

__all__ = ["current_step", "current_tracer", "RunThreads", "current_run_threads", "track", "current_sink",
           "token_sink"]

current_tracer: ContextVar[Tracer | None] = ContextVar("flowrt_tracer", default=None)
current_step: ContextVar[str | None] = ContextVar("flowrt_step", default=None)
current_sink: ContextVar[EventSink | None] = ContextVar("flowrt_event_sink", default=None)


def token_sink() -> EventSink | None:
    """The run's event sink, when it wants token events (else None)."""
    sink = current_sink.get()
    return sink if sink is not None and sink.tokens else None


class RunThreads:
    """Weak references to the threads opened while a run's steps execute."""

    def __init__(self, run_id: str | None = None) -> None:
        # what the engine's program-aware scheduler knows the run by (engine/request/program.py)
        self.run_id = run_id or f"run-{os.getpid()}-{next(_run_ids)}"
        self._threads: weakref.WeakSet[Any] = weakref.WeakSet()
        self._steps: weakref.WeakKeyDictionary[Any, str | None] = weakref.WeakKeyDictionary()

    def add(self, thread: Any) -> None:
        self._threads.add(thread)
        self._steps[thread] = current_step.get()

    def live(self) -> list[tuple[Any, str | None]]:
        """(thread, the step that opened it) for every thread of the run not closed yet, oldest first."""
        alive = [t for t in list(self._threads) if not getattr(t, "closed", False)]
        alive.sort(key=lambda t: getattr(t, "id", 0))
        return [(t, self._steps.get(t)) for t in alive]

    def opened_within(self, step: str) -> list[list[int]]:
        """Token ids of the live threads that ``step`` (a label) or a step enclosing it (a subgraph's, a
        mapped item's) opened: what a step waiting in ``fr.interrupt`` holds only through its frames, which
        are gone once the interrupt has propagated."""
        out = []
        for thread, opened_by in self.live():
            if opened_by is not None and (opened_by == step or step.startswith(opened_by + "/")):
                try:
                    out.append(list(thread.token_ids))
                except Exception:  # noqa: BLE001 - a thread in a state that cannot be read now is left out
                    continue
        return out

    def step_done(self, step: str | None) -> None:
        """A step ended: the threads it opened that are still open are hints of "finished" to the engine
        (their KV is released first under memory pressure; a later step may still use them)."""
        for thread, opened_by in self.live():
            if step is not None and opened_by is not None and (opened_by == step or opened_by.startswith(step + "[")):
                try:
                    thread._hint_state("finished")
                except Exception:  # noqa: BLE001 - best-effort hint
                    pass

    def close_all(self) -> None:
        """Close every thread still alive (each closes its engine sequence, aborting its request)."""
        for thread in list(self._threads):
            try:
                thread.close()
            except Exception:  # noqa: BLE001 - one thread's failure must not keep the others' blocks
                pass


_run_ids = itertools.count(1)

current_run_threads: ContextVar[RunThreads | None] = ContextVar("flowrt_run_threads", default=None)


def track(thread: Any) -> None:
    """Register a new thread with the run executing in this context, if any."""
    run = current_run_threads.get()
    if run is not None:
        run.add(thread)
