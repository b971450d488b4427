"""Run events: what ``rt.stream(wf, **inputs)`` yields, ``flowrt run --stream`` prints and the HTTP workflow
endpoint sends as Server-Sent Events.

Step events come from the executor (started, finished, failed, skipped, routed, interrupted); ``Token``
events carry each piece of text a thread generates, tagged with the step, the thread's id and its fork
index (its position among the siblings of the ``fork`` that made it; 0 for a thread that is no fork), in
order per thread, each token exactly once. The last event of a stream is ``RunFinished`` with the result.

Emitting is a plain function call into a sink set for the run (flowrt.context.current_sink), so a run with no
listener pays nothing, and token events are produced only when the listener asked for them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

from .context import current_sink
from .render import to_jsonable

__all__ = ["Event", "RunStarted", "StepStarted", "StepFinished", "StepFailed", "StepSkipped", "Routed",
           "Interrupted", "Token", "RunFinished", "EventSink", "emit"]


@dataclass
class Event:
    """A run's event (the subclasses' fields are its payload)."""

    type: ClassVar[str] = "event"

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.type, **{f.name: to_jsonable(getattr(self, f.name)) for f in dataclasses.fields(self)
                                      if f.name != "result"}}


@dataclass
class RunStarted(Event):
    workflow: str
    run_id: str | None
    steps: list[str]
    resumed: bool = False
    type: ClassVar[str] = "run_started"


@dataclass
class StepStarted(Event):
    step: str
    visit: int
    type: ClassVar[str] = "step_started"


@dataclass
class StepFinished(Event):
    step: str
    visit: int
    duration: float
    type: ClassVar[str] = "step_finished"


@dataclass
class StepFailed(Event):
    step: str
    visit: int
    message: str
    kind: str = "failed"
    type: ClassVar[str] = "step_failed"


@dataclass
class StepSkipped(Event):
    step: str
    reason: str
    type: ClassVar[str] = "step_skipped"


@dataclass
class Routed(Event):
    step: str
    targets: list[str]
    loop: list[str]
    type: ClassVar[str] = "routed"


@dataclass
class Interrupted(Event):
    step: str
    payload: Any
    run_id: str | None
    type: ClassVar[str] = "interrupted"


@dataclass
class Token(Event):
    step: str | None
    thread_id: int
    fork_index: int
    text: str
    token_ids: list[int]
    type: ClassVar[str] = "token"


@dataclass
class RunFinished(Event):
    status: str          # "done", "failed" or "interrupted"
    run_id: str | None
    result: Any = field(repr=False, default=None)   # the RunResult
    type: ClassVar[str] = "run_finished"


class EventSink:
    """Where a run's events go: ``fn(event)`` (called on the event loop). ``tokens``: also token events."""

    def __init__(self, fn: Callable[[Event], None], *, tokens: bool = False) -> None:
        self.fn = fn
        self.tokens = tokens

    def __call__(self, event: Event) -> None:
        try:
            self.fn(event)
        except Exception:  # noqa: BLE001 - a listener's failure must not fail the run
            pass


def emit(event: Event) -> None:
    sink = current_sink.get()
    if sink is not None:
        sink(event)
