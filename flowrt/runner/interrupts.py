"""Human in the loop: ``value = await fr.interrupt(payload)`` inside a step pauses the run.

The first time, the call raises ``Interrupt``: the executor checkpoints the run (steps already finished
keep their results), stops starting new steps, and the run ends with status ``"interrupted"`` and the
payload (``flowrt run`` exits 3 and prints both with the run id). Resuming with an answer
(``flowrt resume RUN_ID --answer ...``, ``rt.resume(run_id, answer=...)``, ``POST .../resume``) runs the
interrupted step again *from its start*, and this time the same ``fr.interrupt`` call returns the answer
(the LangGraph model). So whatever the step did before the call runs again on resume: keep side effects
after the interrupt, or in a step of their own. A step may interrupt several times; each resume answers the
next call, in order. Parallel steps may interrupt together, inside subgraphs too: each pending interrupt is
named by its step's path (``rev/legal``) and answered by it.

Interrupts need a checkpointer (``--checkpoint runs.db``, ``fr.Runtime(checkpoint=...)``; the server has
one in memory by default): without one the step fails with an error saying so.
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from .state import PendingInterrupt

__all__ = ["interrupt", "Interrupt", "InterruptScope", "current_interrupts"]


class Interrupt(Exception):
    """Raised by ``fr.interrupt`` to pause the run (the executor handles it; do not catch it)."""

    def __init__(self, payload: Any, step: str, index: int, *, threads: list[list[int]] | None = None,
                 pending: list[PendingInterrupt] | None = None) -> None:
        super().__init__(f"step {step!r} is waiting for an answer (interrupt {index})")
        self.payload = payload
        self.step = step
        self.index = index
        self.threads = threads or []   # token ids of the threads the waiting step holds (their KV is saved)
        # a subgraph's: every interrupt pending in it ({"step", "index", "payload"}), all reaching the parent
        self.pending = pending


@dataclass
class InterruptScope:
    """The interrupt state of one run: the answers given so far, per step label."""

    enabled: bool                                   # a checkpointer is there to resume from
    answers: dict[str, list[Any]] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)   # calls made in the current attempt


current_interrupts: ContextVar[InterruptScope | None] = ContextVar("flowrt_interrupts", default=None)


async def interrupt(payload: Any = None) -> Any:
    """Pause the run and ask for a value (see the module docstring); returns the answer on resume."""
    from ..context import current_run_threads, current_step

    scope = current_interrupts.get()
    label = current_step.get()
    if scope is None or label is None:
        raise RuntimeError("fr.interrupt() can only be called inside a workflow step")
    if not scope.enabled:
        raise RuntimeError("fr.interrupt() needs a checkpointer to resume the run from: run with "
                           "`flowrt run FILE --checkpoint runs.db` or `fr.Runtime(checkpoint=\"runs.db\")`")
    i = scope.calls.get(label, 0)
    scope.calls[label] = i + 1
    given = scope.answers.get(label, [])
    if i < len(given):
        return given[i]
    threads = current_run_threads.get()
    raise Interrupt(payload, label, i, threads=threads.opened_within(label) if threads is not None else None)
