"""The checkpoint store interface (any backend: SQLite here; Postgres, Redis later)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

__all__ = ["CheckpointStore", "CheckpointError", "RunRecord"]


class CheckpointError(RuntimeError):
    """The checkpoint store cannot be used (corrupt, newer format, unknown run, ...)."""


@dataclass
class RunRecord:
    run_id: str
    workflow: str
    status: str                          # running, done, failed, interrupted
    inputs: dict[str, Any] = field(default_factory=dict)
    file: str | None = None              # the workflow file (for `flowrt resume`)
    meta: dict[str, Any] = field(default_factory=dict)   # model and engine options, ...
    created: float = 0.0
    updated: float = 0.0
    interrupt: dict[str, Any] | None = None
    checkpoints: int = 0
    state: dict[str, Any] | None = None  # the latest checkpoint's state


@runtime_checkable
class CheckpointStore(Protocol):
    """Where runs and their checkpoints live. Every method is one transaction; safe to call from several
    threads and processes at once (different runs)."""

    def create_run(self, run_id: str, workflow: str, inputs: dict[str, Any], *, file: str | None = None,
                   meta: dict[str, Any] | None = None) -> None: ...

    def save(self, run_id: str, *, step: str | None, visit: int, step_status: str, result: Any,
             route: Any, threads: list[dict[str, Any]], state: dict[str, Any], run_status: str,
             interrupt: dict[str, Any] | None = None) -> int:
        """Append one checkpoint (returns its sequence number) and update the run, atomically."""
        ...

    def get_run(self, run_id: str, *, with_state: bool = True) -> RunRecord:
        """The run (``CheckpointError`` if unknown), with its latest state."""
        ...

    def list_runs(self, limit: int = 50) -> list[RunRecord]: ...

    def delete_run(self, run_id: str) -> None:
        """Forget a run and its checkpoints."""
        ...

    def history(self, run_id: str) -> list[dict[str, Any]]:
        """The run's checkpoints in order: seq, step, visit, status, result, route, created."""
        ...

    def close(self) -> None: ...
