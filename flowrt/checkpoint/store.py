"""The checkpoint store interface (any backend: SQLite here; Postgres, Redis later)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

__all__ = ["CheckpointStore", "CheckpointError", "RunRecord", "UnknownRunError", "RunNotResumableError",
           "RunBusyError", "LeaseLostError", "ReadOnlyStoreError", "RESUMABLE", "claim_refusal", "check_holder"]


class CheckpointError(RuntimeError):
    """The checkpoint store cannot be used (corrupt, newer format, unknown run, ...)."""


class UnknownRunError(CheckpointError):
    """No run with this id in the store (HTTP: 404)."""


class ReadOnlyStoreError(CheckpointError):
    """The store can only be read (a read-only file or file system, or opened for reading)."""


class RunNotResumableError(CheckpointError):
    """The run cannot be resumed: it finished, or it is not waiting for the answer given (HTTP: 409)."""


class RunBusyError(RunNotResumableError):
    """Another holder has the run: its lease is live (it is running, or another resume took it first)."""

    def __init__(self, run_id: str, holder: str, expires: float | None) -> None:
        left = f"; its lease runs out in {max(0.0, expires - time.time()):.0f} s unless renewed" if expires else ""
        super().__init__(f"run {run_id} is held by {holder}, which is running it (a run or a resume that came "
                         f"first){left}")
        self.run_id, self.holder, self.expires = run_id, holder, expires


class LeaseLostError(CheckpointError):
    """This holder's lease on the run was taken over (it expired and another resume claimed the run): the
    checkpoint is refused, so two holders never write one run. ``current``: who holds the run now; ``last``:
    who held it last when no one does now (the resume that took it over and has finished or stopped since)."""

    def __init__(self, run_id: str, holder: str, current: str | None, *, last: str | None = None,
                 status: str | None = None) -> None:
        if current is not None:
            who = f"{current} took it over after its lease ran out"
        elif last is not None and last != holder:
            who = f"{last} took it over after its lease ran out, and has given it back since (the run is {status})"
        else:
            who = "its lease ran out, and no one holds it now"
        super().__init__(f"run {run_id}: {holder} no longer holds it ({who}), so this checkpoint is not saved")
        self.run_id, self.holder, self.current, self.last = run_id, holder, current, last


def check_holder(run_id: str, holder: str | None, lease_holder: str | None, lease_expires: float | None,
                 status: str) -> None:
    """A store's ``save`` check, from the run's row as it is: ``LeaseLostError`` unless ``holder`` (if given)
    holds the run. A given-back lease keeps its holder's name with no expiry (the last holder, for the message)."""
    current = lease_holder if lease_expires is not None else None
    if holder is not None and current != holder:
        raise LeaseLostError(run_id, holder, current, last=lease_holder, status=status)


RESUMABLE = ("running", "interrupted", "failed")   # what claim_run takes (running: when its lease ran out)


def claim_refusal(run_id: str, status: str, current: str | None, expires: float | None, claimant: str,
                  take_over: str | None, now: float) -> CheckpointError:
    """Why a store's ``claim_run`` changed no row, from the run's row as it is (every store says it alike)."""
    if status not in RESUMABLE:
        return RunNotResumableError(f"run {run_id} already finished (status {status}); nothing to resume")
    if current is not None and current not in (claimant, take_over) and (expires or 0) > now:
        return RunBusyError(run_id, current, expires)
    return RunNotResumableError(f"run {run_id} is not waiting for an answer (status {status})")


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
    holder: str | None = None            # who holds the run's lease ("host:pid:random"), if anyone
    lease_expires: float | None = None   # when that lease runs out unless renewed (time.time())


@runtime_checkable
class CheckpointStore(Protocol):
    """Where runs and their checkpoints live. Every method is one transaction; safe to call from several
    threads and processes at once.

    Leases: a run is executed by one holder at a time. ``create_run`` (with ``holder``) and ``claim_run``
    give the holder a lease of ``ttl`` seconds, which it renews (``renew_lease``) while it runs and gives
    back when it ends (``release_run``, or a ``save`` with a final ``run_status``: the row keeps the holder's
    name without an expiry, so that a holder whose lease was taken over learns by whom). A lease whose holder
    died runs out; then the run (status ``running`` with no live lease: it crashed) can be claimed again.
    ``save`` with ``holder`` is refused (``LeaseLostError``) once another holder has claimed the run."""

    def create_run(self, run_id: str, workflow: str, inputs: dict[str, Any], *, file: str | None = None,
                   meta: dict[str, Any] | None = None, holder: str | None = None, ttl: float = 0.0) -> None:
        """A new run, status ``running``; with ``holder``, held by it for ``ttl`` seconds."""
        ...

    def claim_run(self, run_id: str, holder: str, ttl: float, *, take_over: str | None = None,
                  waiting: bool = False) -> RunRecord:
        """Take the run for ``holder`` in one atomic transition: a run ``interrupted``, ``failed`` or
        ``running`` (only ``interrupted`` with ``waiting``: an answer is given) whose lease is free or ran out
        (or is held by ``take_over``, a holder known to be dead) becomes ``running``, held by ``holder`` for
        ``ttl`` seconds. Returns the run with the state read in the same transaction. Refusals, checked in
        this order: ``UnknownRunError`` (no such run), ``RunNotResumableError`` (done), ``RunBusyError``
        naming the holder (another live lease holds it), ``RunNotResumableError`` (``waiting`` and it is not
        interrupted)."""
        ...

    def renew_lease(self, run_id: str, holder: str, ttl: float) -> bool:
        """Extend ``holder``'s lease to ``ttl`` seconds from now; False when it no longer holds the run."""
        ...

    def release_run(self, run_id: str, holder: str, *, status: str | None = None) -> None:
        """Give the lease back (a no-op unless ``holder`` holds it). The status stays as the last save left
        it, or becomes ``status`` (a resume refused after its claim puts the run back as it was)."""
        ...

    def save(self, run_id: str, *, step: str | None, visit: int, step_status: str, result: Any,
             route: Any, threads: list[dict[str, Any]], state: dict[str, Any], run_status: str,
             interrupt: dict[str, Any] | None = None, holder: str | None = None) -> int:
        """Append one checkpoint (returns its sequence number) and update the run, atomically. With
        ``holder``: refused (``LeaseLostError``) unless it holds the run; a ``run_status`` other than
        ``running`` (the run ended) also gives the lease back."""
        ...

    def get_run(self, run_id: str, *, with_state: bool = True) -> RunRecord:
        """The run (``UnknownRunError`` if unknown), with its latest state."""
        ...

    def list_runs(self, limit: int = 50) -> list[RunRecord]: ...

    def delete_run(self, run_id: str) -> None:
        """Forget a run and its checkpoints."""
        ...

    def history(self, run_id: str) -> list[dict[str, Any]]:
        """The run's checkpoints in order: seq, step, visit, status, result, route, created."""
        ...

    def close(self) -> None: ...
