"""What the SQL checkpoint stores (SQLite, PostgreSQL) share apart from their SQL dialects: how values are stored
as JSON text, which runs columns a ``RunRecord`` is read from, and how a run's record, its history entries and its
latest state are rebuilt from rows. Rows are read by column name (``sqlite3.Row``, psycopg's ``dict_row``). Each store
keeps its own SQL (placeholders, table names, locking)."""

from __future__ import annotations

import json
from typing import Any, Callable, Iterable, Protocol

from .compact import refs, routes_from_rows, unpack
from .store import RunRecord

__all__ = ["Row", "dumps", "run_columns", "HISTORY_COLUMNS", "run_record", "history_entry", "stored_state"]


class Row(Protocol):
    """A result row whose columns are read by name: ``sqlite3.Row`` or a psycopg ``dict_row``."""

    def __getitem__(self, column: str, /) -> Any: ...


# The checkpoint columns ``history_entry`` reads.
HISTORY_COLUMNS = "seq, step, visit, status, result, route, created"


def dumps(v: Any) -> str:
    """A value as the JSON text the stores keep (ASCII, compact; what JSON cannot hold as its ``str``)."""
    return json.dumps(v, ensure_ascii=True, separators=(",", ":"), default=str)


def run_columns(lease: bool = True) -> str:
    """The runs columns ``run_record`` reads (``lease=False``: NULLs under the lease columns' names, for a database
    written before they existed)."""
    lease_cols = "lease_holder, lease_expires" if lease else "NULL AS lease_holder, NULL AS lease_expires"
    return f"run_id, workflow, file, status, inputs, meta, interrupt, created, updated, {lease_cols}"


def run_record(row: Row, checkpoints: int, state: dict[str, Any] | None) -> RunRecord:
    """The run of a row of ``run_columns()`` (other columns are ignored). A lease given back keeps its last
    holder's name without an expiry (for ``LeaseLostError``): the run has no holder then."""
    interrupt, expires = row["interrupt"], row["lease_expires"]
    return RunRecord(run_id=row["run_id"], workflow=row["workflow"], status=row["status"],
                     inputs=json.loads(row["inputs"]), file=row["file"], meta=json.loads(row["meta"]),
                     created=row["created"], updated=row["updated"],
                     interrupt=json.loads(interrupt) if interrupt else None, checkpoints=int(checkpoints),
                     state=state, holder=row["lease_holder"] if expires is not None else None, lease_expires=expires)


def history_entry(row: Row) -> dict[str, Any]:
    """A checkpoint's entry in ``history`` from a row of ``HISTORY_COLUMNS``."""
    result, route = row["result"], row["route"]
    return {"seq": row["seq"], "step": row["step"], "visit": row["visit"], "status": row["status"],
            "result": json.loads(result) if result else None, "route": json.loads(route) if route else None,
            "created": row["created"]}


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
