"""A run's state: what the executor knows about a run, and what its checkpoints save.

One type for both sides of the runner/checkpoint seam: the executor writes a ``RunState`` as steps end, the
checkpoint layer turns it into its on-disk form and back (flowrt.checkpoint.state_codec). The statuses are
``str``-valued enums, so JSON, HTTP bodies and comparisons with the strings see the same values as before.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, Iterable, Literal, TypedDict

if TYPE_CHECKING:
    from ..checkpoint.state_codec import StoredState

__all__ = ["StepStatus", "RunStatus", "ErrorKind", "StepError", "PendingInterrupt", "RouteTaken", "RunState",
           "step_of"]


class StepStatus(str, Enum):
    """A step's status in the current pass of a run."""

    PENDING = "pending"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    SKIPPED = "skipped"            # an upstream step failed, or a resource it needs is unavailable
    NOT_ROUTED = "not_routed"      # no route chose it (this pass)
    INTERRUPTED = "interrupted"    # waiting for an answer (fr.interrupt)

    def __str__(self) -> str:
        return self.value


class RunStatus(str, Enum):
    """How a run stands (``RunResult.status``; a checkpointed run's status in its store)."""

    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    INTERRUPTED = "interrupted"

    def __str__(self) -> str:
        return self.value


ErrorKind = Literal["failed", "timeout", "skipped", "not_routed"]


@dataclass
class StepError:
    """Why a step has no output. ``kind``: "failed" (raised), "timeout", "skipped" (an upstream step failed
    or a resource was unavailable), or "not_routed" (no route chose it)."""

    step: str
    message: str
    traceback: str | None = None
    kind: ErrorKind = "failed"
    attempts: int = 0

    def __str__(self) -> str:
        return self.message


class PendingInterrupt(TypedDict):
    """An interrupt waiting for its answer: the step's label (its path), which ``fr.interrupt`` call of the
    step it is, and what it asked."""

    step: str
    index: int
    payload: Any


class RouteTaken(TypedDict):
    """One route a routing step took, at its ``visit``-th run."""

    step: str
    visit: int
    to: list[str]


def step_of(key: str) -> str:
    """The step of a run that a subgraph key below it belongs to (``research``, ``each[3]``, ``ask/agent#2``:
    research, each, ask)."""
    return key.split("/", 1)[0].split("[", 1)[0].split("#", 1)[0]


@dataclass
class RunState:
    """What the scheduler knows about a run or a subgraph's run; a checkpoint saves it.

    ``status`` is per step for the current pass. A loop route back to a step sets it and every step after it
    to pending again (their last results stay until replaced)."""

    status: dict[str, StepStatus]
    visits: dict[str, int]
    outputs: dict[str, Any] = field(default_factory=dict)
    # each output as its checkpoint stores it: encoded once, when its step ends (flowrt.checkpoint.codec)
    encoded: dict[str, dict[str, Any]] = field(default_factory=dict)
    errors: dict[str, StepError] = field(default_factory=dict)
    not_routed: dict[str, StepError] = field(default_factory=dict)
    chosen: dict[str, dict[str, Any]] = field(default_factory=dict)        # router -> {target: value} (this pass)
    loop_values: dict[str, dict[str, Any]] = field(default_factory=dict)   # target -> {router: value}
    route_log: list[RouteTaken] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    interrupt: PendingInterrupt | None = None                   # the first pending interrupt
    interrupts: list[PendingInterrupt] = field(default_factory=list)   # all of them (parallel branches)
    # subgraphs in flight, by their path below this run's (``research``, ``each[3]``, ``ask/agent#2``): saved
    # nested in its checkpoints; and the saved states a resume found, which each takes when it starts again
    children: dict[str, RunState] = field(default_factory=dict)
    restoring: dict[str, StoredState] = field(default_factory=dict)
    # the root run's: token ids of the threads of steps that have not ended (waiting in fr.interrupt, stopped
    # mid-step), by label: their frames are gone, and every checkpoint saves their KV until the step ends
    # (flowrt.checkpoint.kv)
    held_threads: dict[str, list[list[int]]] = field(default_factory=dict)

    @classmethod
    def new(cls, steps: Iterable[str]) -> RunState:
        """A run that has not started: every step pending, none run."""
        names = list(steps)
        return cls(status={n: StepStatus.PENDING for n in names}, visits={n: 0 for n in names})
