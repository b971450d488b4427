"""The default checkpoint store: one SQLite file through the standard library's sqlite3.

WAL journal (readers never block the writer; several processes can write, each transaction waits up to
``timeout`` seconds for the lock), one ``BEGIN IMMEDIATE`` transaction per checkpoint. A ``schema_version``
table records the format: a file that is not SQLite, is corrupt, or was written by a newer flowrt is a
``CheckpointError`` at open, never a silent fresh start; an older format is migrated in place.

Format 2 (compact, flowrt.checkpoint.compact): a checkpoint row holds its step's result and route; the run's
row holds the latest state and live threads. Format 1 kept the whole state and threads in every checkpoint
row, so a long loop's file grew with steps x state.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from typing import Any

from . import compact
from .store import CheckpointError, RunRecord

__all__ = ["SQLiteStore", "SCHEMA_VERSION"]

SCHEMA_VERSION = 2

_SCHEMA = """
CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS runs (
    run_id TEXT PRIMARY KEY,
    workflow TEXT NOT NULL,
    file TEXT,
    status TEXT NOT NULL,
    inputs TEXT NOT NULL,
    meta TEXT NOT NULL,
    interrupt TEXT,
    created REAL NOT NULL,
    updated REAL NOT NULL,
    state TEXT,
    threads TEXT
);
CREATE TABLE IF NOT EXISTS checkpoints (
    run_id TEXT NOT NULL REFERENCES runs(run_id),
    seq INTEGER NOT NULL,
    step TEXT,
    visit INTEGER NOT NULL,
    status TEXT NOT NULL,
    result TEXT,
    route TEXT,
    created REAL NOT NULL,
    PRIMARY KEY (run_id, seq)
);
"""

# Format 1 -> 2: the latest state and threads move to the run's row (kept whole: unpack reads a state
# without references as it is), the checkpoint rows keep their results and routes.
_MIGRATE_1 = """
ALTER TABLE runs ADD COLUMN state TEXT;
ALTER TABLE runs ADD COLUMN threads TEXT;
UPDATE runs SET state = (SELECT state FROM checkpoints c WHERE c.run_id = runs.run_id ORDER BY seq DESC LIMIT 1),
    threads = (SELECT threads FROM checkpoints c WHERE c.run_id = runs.run_id ORDER BY seq DESC LIMIT 1);
CREATE TABLE checkpoints_2 (
    run_id TEXT NOT NULL REFERENCES runs(run_id),
    seq INTEGER NOT NULL,
    step TEXT,
    visit INTEGER NOT NULL,
    status TEXT NOT NULL,
    result TEXT,
    route TEXT,
    created REAL NOT NULL,
    PRIMARY KEY (run_id, seq)
);
INSERT INTO checkpoints_2 SELECT run_id, seq, step, visit, status, result, route, created FROM checkpoints;
DROP TABLE checkpoints;
ALTER TABLE checkpoints_2 RENAME TO checkpoints;
UPDATE schema_version SET version = 2;
"""


def _dumps(v: Any) -> str:
    return json.dumps(v, ensure_ascii=True, separators=(",", ":"), default=str)


class SQLiteStore:
    """A ``CheckpointStore`` in one SQLite file (``":memory:"``: in memory, for this process only)."""

    def __init__(self, path: str | os.PathLike[str], *, timeout: float = 30.0) -> None:
        self.path = os.fspath(path)
        self._lock = threading.Lock()
        memory = self.path == ":memory:"
        if not memory:
            parent = os.path.dirname(os.path.abspath(self.path))
            if not os.path.isdir(parent):
                raise CheckpointError(f"checkpoint database {self.path}: folder {parent} does not exist")
        try:
            self._conn = sqlite3.connect(self.path, timeout=timeout, isolation_level=None, check_same_thread=False)
        except sqlite3.Error as e:
            raise CheckpointError(f"cannot open checkpoint database {self.path}: {e}") from None
        try:
            self._conn.execute(f"PRAGMA busy_timeout={int(timeout * 1000)}")
            if not memory:
                mode = self._conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
                if str(mode).lower() != "wal":
                    raise CheckpointError(f"checkpoint database {self.path}: cannot use WAL mode (got {mode})")
            self._conn.execute("PRAGMA synchronous=NORMAL")
            self._init_schema()
        except sqlite3.DatabaseError as e:
            self._conn.close()
            raise CheckpointError(f"{self.path} is not a flowrt checkpoint database, or it is corrupt: {e}") from None
        except CheckpointError:
            self._conn.close()
            raise

    def _init_schema(self) -> None:
        tables = {r[0] for r in self._conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        if tables and "schema_version" not in tables:
            raise CheckpointError(f"{self.path} is an SQLite database but not a flowrt checkpoint database "
                                  f"(tables: {', '.join(sorted(tables))})")
        if "schema_version" in tables:
            row = self._conn.execute("SELECT MAX(version) FROM schema_version").fetchone()
            version = row[0] if row else None
            if version is None:
                raise CheckpointError(f"{self.path}: checkpoint database without a schema version (corrupt?)")
            if version > SCHEMA_VERSION:
                raise CheckpointError(f"{self.path} was written by a newer flowrt (checkpoint format {version}; "
                                      f"this flowrt reads format {SCHEMA_VERSION} and older): upgrade flowrt")
            if tables >= {"runs", "checkpoints"}:
                if version == 1:
                    with self._tx():
                        self._script(_MIGRATE_1)
                return
        with self._tx():
            self._script(_SCHEMA)
            if not self._conn.execute("SELECT 1 FROM schema_version").fetchone():
                self._conn.execute("INSERT INTO schema_version (version) VALUES (?)", (SCHEMA_VERSION,))

    def _script(self, sql: str) -> None:
        for stmt in sql.strip().split(";"):
            if stmt.strip():
                self._conn.execute(stmt)

    class _Tx:
        def __init__(self, store: "SQLiteStore") -> None:
            self.store = store

        def __enter__(self) -> sqlite3.Connection:
            self.store._lock.acquire()
            try:
                self.store._conn.execute("BEGIN IMMEDIATE")
            except BaseException:
                self.store._lock.release()
                raise
            return self.store._conn

        def __exit__(self, et: Any, e: Any, tb: Any) -> None:
            try:
                self.store._conn.execute("COMMIT" if et is None else "ROLLBACK")
            finally:
                self.store._lock.release()

    def _tx(self) -> "SQLiteStore._Tx":
        return SQLiteStore._Tx(self)

    def _guard(self, what: str, fn: Any) -> Any:
        try:
            return fn()
        except sqlite3.DatabaseError as e:
            raise CheckpointError(f"checkpoint database {self.path}: {what} failed: {e}") from None

    # ------------------------------------------------------------------ writing
    def create_run(self, run_id: str, workflow: str, inputs: dict[str, Any], *, file: str | None = None,
                   meta: dict[str, Any] | None = None) -> None:
        now = time.time()

        def go() -> None:
            try:
                with self._tx() as c:
                    c.execute("INSERT INTO runs (run_id, workflow, file, status, inputs, meta, created, updated) "
                              "VALUES (?, ?, ?, 'running', ?, ?, ?, ?)",
                              (run_id, workflow, file, _dumps(inputs), _dumps(meta or {}), now, now))
            except sqlite3.IntegrityError:
                raise CheckpointError(f"run {run_id!r} already exists in {self.path}") from None

        self._guard("creating a run", go)

    def save(self, run_id: str, *, step: str | None, visit: int, step_status: str, result: Any, route: Any,
             threads: list[dict[str, Any]], state: dict[str, Any], run_status: str,
             interrupt: dict[str, Any] | None = None) -> int:
        now = time.time()

        def go() -> int:
            with self._tx() as c:
                run = c.execute("SELECT state FROM runs WHERE run_id = ?", (run_id,)).fetchone()
                if run is None:
                    raise CheckpointError(f"no run {run_id!r} in {self.path}")
                row = c.execute("SELECT COALESCE(MAX(seq), 0) FROM checkpoints WHERE run_id = ?", (run_id,)).fetchone()
                seq = int(row[0]) + 1
                packed = compact.pack(state, step, visit, seq, result, route, json.loads(run[0]) if run[0] else None)
                c.execute("INSERT INTO checkpoints (run_id, seq, step, visit, status, result, route, created) "
                          "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                          (run_id, seq, step, visit, step_status, _dumps(result), _dumps(route), now))
                c.execute("UPDATE runs SET status = ?, interrupt = ?, updated = ?, state = ?, threads = ? "
                          "WHERE run_id = ?", (run_status, _dumps(interrupt) if interrupt is not None else None, now,
                                               _dumps(packed), _dumps(threads), run_id))
                return seq

        return self._guard("saving a checkpoint", go)

    def delete_run(self, run_id: str) -> None:
        def go() -> None:
            with self._tx() as c:
                c.execute("DELETE FROM checkpoints WHERE run_id = ?", (run_id,))
                c.execute("DELETE FROM runs WHERE run_id = ?", (run_id,))

        self._guard("deleting a run", go)

    # ------------------------------------------------------------------ reading
    def _record(self, row: tuple, with_state: bool) -> RunRecord:
        run_id, workflow, file, status, inputs, meta, interrupt, created, updated = row
        state = None
        with self._lock:
            n = self._conn.execute("SELECT COUNT(*) FROM checkpoints WHERE run_id = ?", (run_id,)).fetchone()[0]
            if with_state:
                raw = self._conn.execute("SELECT state FROM runs WHERE run_id = ?", (run_id,)).fetchone()[0]
                if raw:
                    packed = json.loads(raw)
                    seqs = compact.refs(packed)
                    marks = ",".join("?" * len(seqs))
                    results = {s: json.loads(r) for s, r in self._conn.execute(
                        f"SELECT seq, result FROM checkpoints WHERE run_id = ? AND seq IN ({marks})", (run_id, *seqs))}
                    rows = [(st, v, json.loads(ro)) for st, v, ro in self._conn.execute(
                        "SELECT step, visit, route FROM checkpoints WHERE run_id = ? AND route != 'null' ORDER BY seq",
                        (run_id,))] if compact.routes_from_rows(packed) else []
                    state = compact.unpack(packed, results, rows)
        return RunRecord(run_id=run_id, workflow=workflow, status=status, inputs=json.loads(inputs), file=file,
                         meta=json.loads(meta), created=created, updated=updated,
                         interrupt=json.loads(interrupt) if interrupt else None, checkpoints=int(n), state=state)

    _COLS = "run_id, workflow, file, status, inputs, meta, interrupt, created, updated"

    def get_run(self, run_id: str, *, with_state: bool = True) -> RunRecord:
        def go() -> RunRecord:
            with self._lock:
                row = self._conn.execute(f"SELECT {self._COLS} FROM runs WHERE run_id = ?", (run_id,)).fetchone()
            if row is None:
                raise CheckpointError(f"no run {run_id!r} in {self.path}")
            return self._record(row, with_state)

        return self._guard("reading a run", go)

    def list_runs(self, limit: int = 50) -> list[RunRecord]:
        def go() -> list[RunRecord]:
            with self._lock:
                rows = self._conn.execute(f"SELECT {self._COLS} FROM runs ORDER BY created DESC LIMIT ?",
                                          (limit,)).fetchall()
            return [self._record(r, False) for r in rows]

        return self._guard("listing runs", go)

    def history(self, run_id: str) -> list[dict[str, Any]]:
        def go() -> list[dict[str, Any]]:
            with self._lock:
                rows = self._conn.execute("SELECT seq, step, visit, status, result, route, created FROM checkpoints "
                                          "WHERE run_id = ? ORDER BY seq", (run_id,)).fetchall()
            return [{"seq": s, "step": st, "visit": v, "status": stat, "result": json.loads(r) if r else None,
                     "route": json.loads(ro) if ro else None, "created": cr} for s, st, v, stat, r, ro, cr in rows]

        return self._guard("reading a run's history", go)

    def close(self) -> None:
        with self._lock:
            try:
                self._conn.close()
            except sqlite3.Error:
                pass

    def __repr__(self) -> str:
        return f"SQLiteStore({self.path!r})"
