"""The default checkpoint store: one SQLite file through the standard library's sqlite3.

WAL journal (readers never block the writer; several processes can write, each transaction waits up to
``timeout`` seconds for the lock), one ``BEGIN IMMEDIATE`` transaction per checkpoint. A ``schema_version``
table records the format: a file that is not SQLite, is corrupt, or was written by a newer flowrt is a
``CheckpointError`` at open, never a silent fresh start.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
import urllib.parse
from typing import Any

from .store import (CheckpointError, LeaseLostError, ReadOnlyStoreError, RunBusyError, RunNotResumableError,
                    RunRecord, UnknownRunError)

__all__ = ["SQLiteStore", "SCHEMA_VERSION"]

SCHEMA_VERSION = 2   # 2: run leases (lease_holder, lease_expires)

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
    lease_holder TEXT,
    lease_expires REAL
);
CREATE TABLE IF NOT EXISTS checkpoints (
    run_id TEXT NOT NULL REFERENCES runs(run_id),
    seq INTEGER NOT NULL,
    step TEXT,
    visit INTEGER NOT NULL,
    status TEXT NOT NULL,
    result TEXT,
    route TEXT,
    threads TEXT NOT NULL,
    state TEXT NOT NULL,
    created REAL NOT NULL,
    PRIMARY KEY (run_id, seq)
);
"""

# What brings a database of format N-1 to format N (run inside the transaction that records N).
_MIGRATIONS = {
    2: [("runs", "lease_holder", "TEXT"), ("runs", "lease_expires", "REAL")],   # (table, column, type) to add
}

RESUMABLE = ("running", "interrupted", "failed")   # claim_run takes these (running: when its lease ran out)


def _dumps(v: Any) -> str:
    return json.dumps(v, ensure_ascii=True, separators=(",", ":"), default=str)


def _read_only_reason(path: str) -> str | None:
    """Why ``path`` cannot be written (a read-only file system, file or folder), or None."""
    folder = os.path.dirname(os.path.abspath(path))
    try:
        if os.statvfs(folder).f_flag & os.ST_RDONLY:
            return "it is on a read-only file system"
    except OSError:
        pass
    if os.path.exists(path) and not os.access(path, os.W_OK):
        return "the file is read-only"
    if not os.access(folder, os.W_OK):
        return f"its folder {folder} is read-only (SQLite writes its journal there)"
    return None


class SQLiteStore:
    """A ``CheckpointStore`` in one SQLite file (``":memory:"``: in memory, for this process only).

    ``readonly=True``: opened for reading only (``flowrt runs list|show``): works on a read-only file or file
    system, never creates or changes the file, and the writing methods raise ``ReadOnlyStoreError``.
    ``create=False``: a missing file is a ``CheckpointError`` ("no checkpoint database at ...") instead of
    a new database (readonly implies it)."""

    def __init__(self, path: str | os.PathLike[str], *, timeout: float = 30.0, readonly: bool = False,
                 create: bool = True) -> None:
        self.path = os.fspath(path)
        self.readonly = readonly
        self._lock = threading.Lock()
        memory = self.path == ":memory:"
        if not memory:
            parent = os.path.dirname(os.path.abspath(self.path))
            if not os.path.isdir(parent):
                raise CheckpointError(f"checkpoint database {self.path}: folder {parent} does not exist")
            if (readonly or not create) and not os.path.exists(self.path):
                raise CheckpointError(f"no checkpoint database at {self.path}")
            reason = None if readonly else _read_only_reason(self.path)
            if reason is not None:
                raise ReadOnlyStoreError(self._read_only_message(reason))
        try:
            self._conn = self._connect(timeout, memory)
        except sqlite3.Error as e:
            raise CheckpointError(f"cannot open checkpoint database {self.path}: {e}") from None
        try:
            self._conn.execute(f"PRAGMA busy_timeout={int(timeout * 1000)}")
            if not memory and not readonly:
                mode = self._conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
                if str(mode).lower() != "wal":
                    raise CheckpointError(f"checkpoint database {self.path}: cannot use WAL mode (got {mode})")
                self._conn.execute("PRAGMA synchronous=NORMAL")
            self._init_schema()
        except sqlite3.DatabaseError as e:
            self._conn.close()
            reason = None if memory or readonly else _read_only_reason(self.path)
            if reason is not None:
                raise ReadOnlyStoreError(self._read_only_message(reason)) from None
            raise CheckpointError(f"{self.path} is not a flowrt checkpoint database, or it is corrupt: {e}") from None
        except CheckpointError:
            self._conn.close()
            raise

    def _read_only_message(self, reason: str) -> str:
        return (f"checkpoint database {self.path} is read-only ({reason}): reading commands (flowrt runs list, "
                f"runs show) can open it; to run or resume, copy it somewhere writable")

    def _connect(self, timeout: float, memory: bool) -> sqlite3.Connection:
        kw: dict[str, Any] = dict(timeout=timeout, isolation_level=None, check_same_thread=False)
        if not self.readonly or memory:
            return sqlite3.connect(self.path, **kw)
        uri = "file:" + urllib.parse.quote(os.path.abspath(self.path))
        conn = sqlite3.connect(uri + "?mode=ro", uri=True, **kw)
        try:
            conn.execute("SELECT 1 FROM sqlite_master LIMIT 1").fetchall()
            return conn
        except sqlite3.OperationalError:
            # A WAL database on a read-only file system: SQLite cannot make its shared-memory file there.
            # Nothing can write the file then, so it is read as immutable.
            conn.close()
            if _read_only_reason(self.path) is None:
                raise
            return sqlite3.connect(uri + "?mode=ro&immutable=1", uri=True, **kw)

    def _init_schema(self) -> None:
        tables = {r[0] for r in self._conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        if tables and "schema_version" not in tables:
            raise CheckpointError(f"{self.path} is an SQLite database but not a flowrt checkpoint database "
                                  f"(tables: {', '.join(sorted(tables))})")
        self._version = SCHEMA_VERSION
        if "schema_version" in tables:
            version = self._stored_version()
            if tables >= {"runs", "checkpoints"} and version == SCHEMA_VERSION:
                return
            if self.readonly:   # read as it is: an older format lacks the lease columns
                self._version = version
                return
        elif self.readonly:
            raise CheckpointError(f"{self.path} is an empty database, not a flowrt checkpoint database")
        with self._tx():
            version = self._stored_version() if "schema_version" in tables else None
            for stmt in _SCHEMA.strip().split(";"):
                if stmt.strip():
                    self._conn.execute(stmt)
            if version is None:
                self._conn.execute("INSERT INTO schema_version (version) VALUES (?)", (SCHEMA_VERSION,))
            elif version < SCHEMA_VERSION:
                for v in range(version + 1, SCHEMA_VERSION + 1):
                    for table, column, kind in _MIGRATIONS.get(v, []):
                        have = {r[1] for r in self._conn.execute(f"PRAGMA table_info({table})")}
                        if column not in have:
                            self._conn.execute(f"ALTER TABLE {table} ADD COLUMN {column} {kind}")
                self._conn.execute("UPDATE schema_version SET version = ?", (SCHEMA_VERSION,))

    def _stored_version(self) -> int:
        """The format version the file records (``CheckpointError`` when none, or newer than this flowrt's)."""
        row = self._conn.execute("SELECT MAX(version) FROM schema_version").fetchone()
        version = row[0] if row else None
        if version is None:
            raise CheckpointError(f"{self.path}: checkpoint database without a schema version (corrupt?)")
        if version > SCHEMA_VERSION:
            raise CheckpointError(f"{self.path} was written by a newer flowrt (checkpoint format {version}; "
                                  f"this flowrt reads format {SCHEMA_VERSION} and older): upgrade flowrt")
        return int(version)

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

    def _guard(self, what: str, fn: Any, *, writes: bool = True) -> Any:
        if writes and self.readonly:
            raise ReadOnlyStoreError(f"checkpoint database {self.path} was opened read-only: {what} needs a "
                                     f"writable one")
        try:
            return fn()
        except sqlite3.DatabaseError as e:
            if writes and "readonly" in str(e):
                raise ReadOnlyStoreError(f"checkpoint database {self.path} is read-only: {what} failed: {e}") from None
            raise CheckpointError(f"checkpoint database {self.path}: {what} failed: {e}") from None

    # ------------------------------------------------------------------ writing
    def create_run(self, run_id: str, workflow: str, inputs: dict[str, Any], *, file: str | None = None,
                   meta: dict[str, Any] | None = None, holder: str | None = None, ttl: float = 0.0) -> None:
        now = time.time()

        def go() -> None:
            try:
                with self._tx() as c:
                    c.execute("INSERT INTO runs (run_id, workflow, file, status, inputs, meta, created, updated, "
                              "lease_holder, lease_expires) VALUES (?, ?, ?, 'running', ?, ?, ?, ?, ?, ?)",
                              (run_id, workflow, file, _dumps(inputs), _dumps(meta or {}), now, now, holder,
                               now + ttl if holder else None))
            except sqlite3.IntegrityError:
                raise CheckpointError(f"run {run_id!r} already exists in {self.path}") from None

        self._guard("creating a run", go)

    def claim_run(self, run_id: str, holder: str, ttl: float, *, take_over: str | None = None,
                  waiting: bool = False) -> RunRecord:
        now = time.time()
        statuses = ("interrupted",) if waiting else RESUMABLE

        def go() -> RunRecord:
            with self._tx() as c:
                # One conditional UPDATE inside BEGIN IMMEDIATE: of two claims, exactly one changes the row.
                taken = c.execute(
                    f"UPDATE runs SET status = 'running', lease_holder = ?, lease_expires = ?, updated = ? "
                    f"WHERE run_id = ? AND status IN ({', '.join('?' * len(statuses))}) AND (lease_holder IS NULL "
                    f"OR lease_expires IS NULL OR lease_expires <= ? OR lease_holder = ? OR lease_holder = ?)",
                    (holder, now + ttl, now, run_id, *statuses, now, holder, take_over)).rowcount
                row = c.execute(f"SELECT {self._cols} FROM runs WHERE run_id = ?", (run_id,)).fetchone()
                if row is None:
                    raise UnknownRunError(f"no run {run_id!r} in {self.path}")
                if not taken:
                    status, current, expires = row[3], row[9], row[10]
                    if status not in RESUMABLE:
                        raise RunNotResumableError(f"run {run_id} already finished (status {status}); nothing to "
                                                   f"resume")
                    if current is not None and current not in (holder, take_over) and (expires or 0) > now:
                        raise RunBusyError(run_id, current, expires)
                    raise RunNotResumableError(f"run {run_id} is not waiting for an answer (status {status})")
                return self._record(row, True, c)

        return self._guard("claiming a run", go)

    def renew_lease(self, run_id: str, holder: str, ttl: float) -> bool:
        def go() -> bool:
            with self._tx() as c:
                return c.execute("UPDATE runs SET lease_expires = ? WHERE run_id = ? AND lease_holder = ?",
                                 (time.time() + ttl, run_id, holder)).rowcount == 1

        return self._guard("renewing a run's lease", go)

    def release_run(self, run_id: str, holder: str) -> None:
        def go() -> None:
            with self._tx() as c:
                c.execute("UPDATE runs SET lease_holder = NULL, lease_expires = NULL WHERE run_id = ? AND "
                          "lease_holder = ?", (run_id, holder))

        self._guard("releasing a run", go)

    def save(self, run_id: str, *, step: str | None, visit: int, step_status: str, result: Any, route: Any,
             threads: list[dict[str, Any]], state: dict[str, Any], run_status: str,
             interrupt: dict[str, Any] | None = None, holder: str | None = None) -> int:
        now = time.time()

        def go() -> int:
            with self._tx() as c:
                lease = "" if run_status == "running" else ", lease_holder = NULL, lease_expires = NULL"
                fence = "" if holder is None else " AND lease_holder = ?"
                updated = c.execute(f"UPDATE runs SET status = ?, interrupt = ?, updated = ?{lease} WHERE run_id = ?"
                                    f"{fence}", (run_status, _dumps(interrupt) if interrupt is not None else None, now,
                                                 run_id, *([holder] if holder is not None else []))).rowcount
                if not updated:
                    row = c.execute("SELECT lease_holder FROM runs WHERE run_id = ?", (run_id,)).fetchone()
                    if row is None:
                        raise UnknownRunError(f"no run {run_id!r} in {self.path}")
                    raise LeaseLostError(f"run {run_id}: {holder} no longer holds it ({row[0] or 'no one'} took it "
                                         f"over after its lease ran out), so this checkpoint is not saved")
                row = c.execute("SELECT COALESCE(MAX(seq), 0) FROM checkpoints WHERE run_id = ?", (run_id,)).fetchone()
                seq = int(row[0]) + 1
                c.execute("INSERT INTO checkpoints (run_id, seq, step, visit, status, result, route, threads, state, "
                          "created) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                          (run_id, seq, step, visit, step_status, _dumps(result), _dumps(route), _dumps(threads),
                           _dumps(state), now))
                return seq

        return self._guard("saving a checkpoint", go)

    def delete_run(self, run_id: str) -> None:
        def go() -> None:
            with self._tx() as c:
                c.execute("DELETE FROM checkpoints WHERE run_id = ?", (run_id,))
                c.execute("DELETE FROM runs WHERE run_id = ?", (run_id,))

        self._guard("deleting a run", go)

    # ------------------------------------------------------------------ reading
    @property
    def _cols(self) -> str:
        """The runs columns ``_record`` reads (a read-only database of format 1 has no lease columns)."""
        lease = "lease_holder, lease_expires" if self._version >= 2 else "NULL, NULL"
        return f"run_id, workflow, file, status, inputs, meta, interrupt, created, updated, {lease}"

    def _record(self, row: tuple, with_state: bool, conn: sqlite3.Connection | None = None) -> RunRecord:
        run_id, workflow, file, status, inputs, meta, interrupt, created, updated, holder, expires = row
        query = ("SELECT COUNT(*), (SELECT state FROM checkpoints WHERE run_id = ?1 ORDER BY seq DESC LIMIT 1) "
                 "FROM checkpoints WHERE run_id = ?1")
        if conn is not None:   # inside a transaction that holds the lock
            n, state = conn.execute(query, (run_id,)).fetchone()
        else:
            with self._lock:
                n, state = self._conn.execute(query, (run_id,)).fetchone()
        return RunRecord(run_id=run_id, workflow=workflow, status=status, inputs=json.loads(inputs), file=file,
                         meta=json.loads(meta), created=created, updated=updated,
                         interrupt=json.loads(interrupt) if interrupt else None, checkpoints=int(n),
                         state=json.loads(state) if (with_state and state) else None, holder=holder,
                         lease_expires=expires)

    def get_run(self, run_id: str, *, with_state: bool = True) -> RunRecord:
        def go() -> RunRecord:
            with self._lock:
                row = self._conn.execute(f"SELECT {self._cols} FROM runs WHERE run_id = ?", (run_id,)).fetchone()
            if row is None:
                raise UnknownRunError(f"no run {run_id!r} in {self.path}")
            return self._record(row, with_state)

        return self._guard("reading a run", go, writes=False)

    def list_runs(self, limit: int = 50) -> list[RunRecord]:
        def go() -> list[RunRecord]:
            with self._lock:
                rows = self._conn.execute(f"SELECT {self._cols} FROM runs ORDER BY created DESC LIMIT ?",
                                          (limit,)).fetchall()
            return [self._record(r, False) for r in rows]

        return self._guard("listing runs", go, writes=False)

    def history(self, run_id: str) -> list[dict[str, Any]]:
        def go() -> list[dict[str, Any]]:
            with self._lock:
                rows = self._conn.execute("SELECT seq, step, visit, status, result, route, created FROM checkpoints "
                                          "WHERE run_id = ? ORDER BY seq", (run_id,)).fetchall()
            return [{"seq": s, "step": st, "visit": v, "status": stat, "result": json.loads(r) if r else None,
                     "route": json.loads(ro) if ro else None, "created": cr} for s, st, v, stat, r, ro, cr in rows]

        return self._guard("reading a run's history", go, writes=False)

    def close(self) -> None:
        with self._lock:
            try:
                self._conn.close()
            except sqlite3.Error:
                pass

    def __repr__(self) -> str:
        return f"SQLiteStore({self.path!r})"
