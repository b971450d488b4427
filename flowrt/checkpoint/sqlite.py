"""The default checkpoint store: one SQLite file through the standard library's sqlite3.

WAL journal (readers never block the writer; several processes can write, each transaction waits up to
``timeout`` seconds for the lock), one ``BEGIN IMMEDIATE`` transaction per checkpoint. A ``schema_version``
table records the format: a file that is not SQLite, is corrupt, or was written by a newer flowrt is a
``CheckpointError`` at open, never a silent fresh start; an older format is migrated in place.

Format 2 (compact, flowrt.checkpoint.compact): a checkpoint row holds its step's result and route; the run's
row holds the latest state and live threads. Format 1 kept the whole state and threads in every checkpoint
row, so a long loop's file grew with steps x state. Format 3 adds the run's lease (flowrt.checkpoint.lease:
``lease_holder``, ``lease_expires``).
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import threading
import time
import urllib.parse
from typing import Any

from .compact import pack
from .rows import HISTORY_COLUMNS, dumps, history_entry, run_columns, run_record, stored_state
from .store import (RESUMABLE, CheckpointError, ReadOnlyStoreError, RunRecord, UnknownRunError, check_holder,
                    claim_refusal)

__all__ = ["SQLiteStore", "SCHEMA_VERSION"]

SCHEMA_VERSION = 3

# The checkpoints table's columns as format 2 made them (format 3 kept them): the fresh schema and the format 1 -> 2
# migration create the same table.
_CHECKPOINTS_2 = """(
    run_id TEXT NOT NULL REFERENCES runs(run_id),
    seq INTEGER NOT NULL,
    step TEXT,
    visit INTEGER NOT NULL,
    status TEXT NOT NULL,
    result TEXT,
    route TEXT,
    created REAL NOT NULL,
    PRIMARY KEY (run_id, seq)
)"""

_SCHEMA = f"""
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
    threads TEXT,
    lease_holder TEXT,
    lease_expires REAL
);
CREATE TABLE IF NOT EXISTS checkpoints {_CHECKPOINTS_2};
"""

# Format 1 -> 2: the latest state and threads move to the run's row (kept whole: unpack reads a state
# without references as it is), the checkpoint rows keep their results and routes.
_MIGRATE_1 = f"""
ALTER TABLE runs ADD COLUMN state TEXT;
ALTER TABLE runs ADD COLUMN threads TEXT;
UPDATE runs SET state = (SELECT state FROM checkpoints c WHERE c.run_id = runs.run_id ORDER BY seq DESC LIMIT 1),
    threads = (SELECT threads FROM checkpoints c WHERE c.run_id = runs.run_id ORDER BY seq DESC LIMIT 1);
CREATE TABLE checkpoints_2 {_CHECKPOINTS_2};
INSERT INTO checkpoints_2 SELECT run_id, seq, step, visit, status, result, route, created FROM checkpoints;
DROP TABLE checkpoints;
ALTER TABLE checkpoints_2 RENAME TO checkpoints;
UPDATE schema_version SET version = 2;
"""

# Format 2 -> 3: the run's lease.
_MIGRATE_2 = """
ALTER TABLE runs ADD COLUMN lease_holder TEXT;
ALTER TABLE runs ADD COLUMN lease_expires REAL;
UPDATE schema_version SET version = 3;
"""


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
                mode = self._wal_mode(timeout)
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

    def _wal_mode(self, timeout: float) -> str:
        """Switch to WAL. SQLite does not wait out a busy lock for a journal-mode change (its busy handler
        is not called there), so processes opening a new database at once would fail with "database is
        locked": retry until ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self._conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            except sqlite3.OperationalError as e:
                if "locked" not in str(e) or time.monotonic() > deadline:
                    raise
                time.sleep(0.005)

    def _read_only_message(self, reason: str) -> str:
        return (f"checkpoint database {self.path} is read-only ({reason}): reading commands (flowrt runs list, "
                f"runs show) can open it; to run or resume, copy it somewhere writable")

    def _connect(self, timeout: float, memory: bool) -> sqlite3.Connection:
        """The connection, its rows ``sqlite3.Row`` (read by column name; by index too)."""
        conn = self._open(timeout, memory)
        conn.row_factory = sqlite3.Row
        return conn

    def _open(self, timeout: float, memory: bool) -> sqlite3.Connection:
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
            if tables >= {"runs", "checkpoints"}:
                if self.readonly:   # read as it is: format 2 lacks only the lease columns
                    if version < 2:
                        raise CheckpointError(f"{self.path} is in checkpoint format {version} (an older flowrt), "
                                              f"which reading commands do not convert; `flowrt resume` or "
                                              f"`flowrt run --checkpoint` on it (writable) converts it")
                    self._version = version
                    return
                if version < SCHEMA_VERSION:
                    with self._tx():
                        if self._stored_version() == 1:   # another process may have converted it meanwhile
                            self._script(_MIGRATE_1)
                        if self._stored_version() == 2:
                            self._script(_MIGRATE_2)
                return
        elif self.readonly:
            raise CheckpointError(f"{self.path} is an empty database, not a flowrt checkpoint database")
        with self._tx():
            self._script(_SCHEMA)
            if not self._conn.execute("SELECT 1 FROM schema_version").fetchone():
                self._conn.execute("INSERT INTO schema_version (version) VALUES (?)", (SCHEMA_VERSION,))

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
                              (run_id, workflow, file, dumps(inputs), dumps(meta or {}), now, now, holder,
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
                    raise claim_refusal(run_id, row["status"], row["lease_holder"], row["lease_expires"], holder,
                                        take_over, now)
                return self._record(row, True, c)

        return self._guard("claiming a run", go)

    def renew_lease(self, run_id: str, holder: str, ttl: float) -> bool:
        def go() -> bool:
            with self._tx() as c:
                return c.execute("UPDATE runs SET lease_expires = ? WHERE run_id = ? AND lease_holder = ? "
                 "AND lease_expires IS NOT NULL",
                                 (time.time() + ttl, run_id, holder)).rowcount == 1

        return self._guard("renewing a run's lease", go)

    def release_run(self, run_id: str, holder: str, *, status: str | None = None) -> None:
        def go() -> None:
            with self._tx() as c:
                c.execute("UPDATE runs SET lease_expires = NULL, status = COALESCE(?, status) "
                          "WHERE run_id = ? AND lease_holder = ?", (status, run_id, holder))

        self._guard("releasing a run", go)

    def save(self, run_id: str, *, step: str | None, visit: int, step_status: str, result: Any, route: Any,
             threads: list[dict[str, Any]], state: dict[str, Any], run_status: str,
             interrupt: dict[str, Any] | None = None, holder: str | None = None) -> int:
        now = time.time()

        def go() -> int:
            with self._tx() as c:
                run = c.execute("SELECT state, lease_holder, lease_expires, status FROM runs WHERE run_id = ?",
                                (run_id,)).fetchone()
                if run is None:
                    raise UnknownRunError(f"no run {run_id!r} in {self.path}")
                check_holder(run_id, holder, run["lease_holder"], run["lease_expires"], run["status"])
                row = c.execute("SELECT COALESCE(MAX(seq), 0) FROM checkpoints WHERE run_id = ?", (run_id,)).fetchone()
                seq = int(row[0]) + 1
                stored = json.loads(run["state"]) if run["state"] else None
                packed = pack(state, step, visit, seq, result, route, stored)
                c.execute("INSERT INTO checkpoints (run_id, seq, step, visit, status, result, route, created) "
                          "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                          (run_id, seq, step, visit, step_status, dumps(result), dumps(route), now))
                lease = "" if run_status == "running" else ", lease_expires = NULL"   # it ended: given back
                c.execute(f"UPDATE runs SET status = ?, interrupt = ?, updated = ?, state = ?, threads = ?{lease} "
                          f"WHERE run_id = ?", (run_status, dumps(interrupt) if interrupt is not None else None, now,
                                                dumps(packed), dumps(threads), run_id))
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
        """The runs columns ``_record`` reads (a read-only database of format 2 has no lease columns)."""
        return run_columns(lease=self._version >= 3)

    def _record(self, row: sqlite3.Row, with_state: bool, conn: sqlite3.Connection | None = None) -> RunRecord:
        """The run of a row of ``_cols``; ``conn``: inside a transaction that holds the lock already."""
        run_id = row["run_id"]
        with self._lock if conn is None else contextlib.nullcontext():
            c = conn or self._conn
            n = c.execute("SELECT COUNT(*) FROM checkpoints WHERE run_id = ?", (run_id,)).fetchone()[0]
            state = self._state(c, run_id) if with_state else None
        return run_record(row, n, state)

    @staticmethod
    def _state(c: sqlite3.Connection, run_id: str) -> dict[str, Any] | None:
        """The run's latest state, its references to checkpoint rows resolved (flowrt.checkpoint.compact)."""
        raw = c.execute("SELECT state FROM runs WHERE run_id = ?", (run_id,)).fetchone()["state"]
        return stored_state(
            raw,
            lambda seqs: c.execute(f"SELECT seq, result FROM checkpoints WHERE run_id = ? AND seq IN "
                                   f"({','.join('?' * len(seqs))})", (run_id, *seqs)),
            lambda: c.execute("SELECT step, visit, route FROM checkpoints WHERE run_id = ? AND route != 'null' "
                              "ORDER BY seq", (run_id,)))

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
                rows = self._conn.execute(f"SELECT {HISTORY_COLUMNS} FROM checkpoints WHERE run_id = ? ORDER BY seq",
                                          (run_id,)).fetchall()
            return [history_entry(r) for r in rows]

        return self._guard("reading a run's history", go, writes=False)

    def close(self) -> None:
        with self._lock:
            try:
                self._conn.close()
            except sqlite3.Error:
                pass

    def __repr__(self) -> str:
        return f"SQLiteStore({self.path!r})"
