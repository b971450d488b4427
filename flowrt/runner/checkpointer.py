"""What the executor asks of a run's checkpoint: the runner side of the runner/checkpoint seam
(``flowrt.checkpoint.RunCheckpoint`` implements it)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from .state import RunState, RunStatus

if TYPE_CHECKING:
    from ..checkpoint.state_codec import StoredState
    from ..context import RunThreads
    from ..graph.workflow import Workflow
    from .interrupts import InterruptScope

__all__ = ["Checkpointer"]


class Checkpointer(Protocol):
    run_id: str

    @property
    def saves_kv(self) -> bool:
        """Its checkpoints save KV blocks (a run stopped mid-step saves one more, with its threads' KV)."""
        ...

    def resources_to_continue(self, wf: Workflow) -> list[str] | None:
        """The resources to load before the run starts; None: all of the workflow's (a new run)."""
        ...

    def start(self, st: RunState, scope: InterruptScope, model: Any) -> bool:
        """Fill the run's state from the stored one (a resume); False for a new run."""
        ...

    def restore_into(self, st: RunState, saved: StoredState, model: Any, path: str) -> None:
        """Fill a subgraph's state (at ``path``) from the state its last run left."""
        ...

    def record_output(self, st: RunState, step: str, value: Any) -> None:
        """``step`` of the run of ``st`` ended with ``value``: encode it (once) for the checkpoints."""
        ...

    def save(self, st: RunState, step: str | None, threads: RunThreads, *, at: RunState | None = None) -> None:
        """Checkpoint the run's state ``st`` after ``step`` (a label; None: the run stopped); ``at``: the state
        of the subgraph that holds ``step``, when it is not the run's own."""
        ...

    async def kv_flushed(self) -> None:
        """The KV blocks queued so far are on disk (awaited off the event loop), before the last checkpoint."""
        ...

    def finish(self, st: RunState, status: RunStatus, threads: RunThreads) -> None:
        """The run ended as ``status``: its last checkpoint."""
        ...
