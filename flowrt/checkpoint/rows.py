"""What the SQL checkpoint stores (SQLite, PostgreSQL) share apart from their SQL dialects: how values are stored
as JSON text, which runs columns a ``RunRecord`` is read from, and how a run's record, its history entries and its
latest state are rebuilt from rows. Each store keeps its own SQL (placeholders, table names, locking)."""

from __future__ import annotations

import json
from typing import Any, Callable, Iterable, Sequence

from .compact import refs, routes_from_rows, unpack
from .store import RunRecord

__all__ = ["dumps", "run_columns", "HISTORY_COLUMNS", "run_record", "history_entry", "stored_state"]

# The checkpoint columns ``history_entry`` reads, in its order.
HISTORY_COLUMNS = "seq, step, visit, status, result, route, created"


def dumps(v: Any) -> str:
    """A value as the JSON text the stores keep (ASCII, compact; what JSON cannot hold as its ``str``)."""
    return json.dumps(v, ensure_ascii=True, separators=(",", ":"), default=str)


def run_columns(lease: bool = True) -> str:
    """The runs columns ``run_record`` reads, in its order (``lease=False``: NULLs in place of the lease columns,
    for a database written before they existed)."""
    lease_cols = "lease_holder, lease_expires" if lease else "NULL, NULL"
    return f"run_id, workflow, file, status, inputs, meta, interrupt, created, updated, {lease_cols}"


def run_record(row: Sequence[Any], checkpoints: int, state: dict[str, Any] | None) -> RunRecord:
    """The run of a row of ``run_columns()`` (extra trailing columns are ignored). A lease given back keeps
    its last holder's name without an expiry (for ``LeaseLostError``): the run has no holder then."""
    run_id, workflow, file, status, inputs, meta, interrupt, created, updated, holder, expires = row[:11]
    return RunRecord(run_id=run_id, workflow=workflow, status=status, inputs=json.loads(inputs), file=file,
                     meta=json.loads(meta), created=created, updated=updated,
                     interrupt=json.loads(interrupt) if interrupt else None, checkpoints=int(checkpoints),
                     state=state, holder=holder if expires is not None else None, lease_expires=expires)


def history_entry(row: Sequence[Any]) -> dict[str, Any]:
    """A checkpoint's entry in ``history`` from a row of ``HISTORY_COLUMNS``."""
    s, st, v, stat, r, ro, cr = row
    return {"seq": s, "step": st, "visit": v, "status": stat, "result": json.loads(r) if r else None,
            "route": json.loads(ro) if ro else None, "created": cr}


def stored_state(raw: str | None, results: Callable[[list[int]], Iterable[tuple[int, str]]],
                 routes: Callable[[], Iterable[tuple[str, int, str]]]) -> dict[str, Any] | None:
    """A run's latest state from its row's stored (packed) form, its references to checkpoint rows resolved
    (flowrt.checkpoint.compact): ``results(seqs)`` gives those rows' (seq, result), ``routes()`` every row's (step,
    visit, route) whose route is not null, in seq order (asked only when the state keeps its routes in rows)."""
    if not raw:
        return None
    packed = json.loads(raw)
    found = {s: json.loads(r) for s, r in results(refs(packed))}
    rows = [(st, v, json.loads(ro)) for st, v, ro in routes()] if routes_from_rows(packed) else []
    return unpack(packed, found, rows)
