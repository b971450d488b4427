"""A checkpoint store in PostgreSQL (psycopg 3, the ``flowrt[postgres]`` extra), for runs shared between
processes on several machines (``flowrt serve`` processes, Ray replicas).

Same tables (the compact layout of flowrt.checkpoint.compact) and semantics as the SQLite store, prefixed
``flowrt_`` so that the database can hold other things. Every method is one transaction; a checkpoint's
sequence number is taken under a row lock on its run (``SELECT ... FOR UPDATE``), so concurrent writers
never collide. The schema is created under an advisory lock (several processes may open a fresh database at
once) and its version is checked as in SQLite: a newer format is a ``CheckpointError``, never a silent
downgrade. Format 2 adds the run's lease (flowrt.checkpoint.lease); a format-1 database gets its columns on
open. Lease times are the clients' ``time.time()``: the hosts' clocks must agree to well within the lease
TTL (30 s).
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any, Callable, TypeVar

from .compact import pack
from .redact import redact_url, scrub
from .rows import HISTORY_COLUMNS, Row, dumps, history_entry, run_columns, run_record, stored_state
from .store import (RESUMABLE, CheckpointError, ReadOnlyStoreError, RunRecord, UnknownRunError, check_holder,
                    claim_refusal)

__all__ = ["PostgresStore", "is_postgres_url"]

SCHEMA_VERSION = 2
_LOCK_KEY = 0x666C6F77   # "flow": the advisory lock that serializes schema creation

_SCHEMA = [
    "CREATE TABLE IF NOT EXISTS flowrt_schema_version (version INTEGER NOT NULL)",
    """CREATE TABLE IF NOT EXISTS flowrt_runs (
        run_id TEXT PRIMARY KEY,
        workflow TEXT NOT NULL,
        file TEXT,
        status TEXT NOT NULL,
        inputs TEXT NOT NULL,
        meta TEXT NOT NULL,
        interrupt TEXT,
        created DOUBLE PRECISION NOT NULL,
        updated DOUBLE PRECISION NOT NULL,
        state TEXT,
        threads TEXT,
        lease_holder TEXT,
        lease_expires DOUBLE PRECISION
    ) WITH (fillfactor = 50)""",   # room for HOT updates: a run's row is rewritten at every checkpoint
    """CREATE TABLE IF NOT EXISTS flowrt_checkpoints (
        run_id TEXT NOT NULL REFERENCES flowrt_runs(run_id) ON DELETE CASCADE,
        seq INTEGER NOT NULL,
        step TEXT,
        visit INTEGER NOT NULL,
        status TEXT NOT NULL,
        result TEXT,
        route TEXT,
        created DOUBLE PRECISION NOT NULL,
        PRIMARY KEY (run_id, seq)
    )""",
    # format 1 -> 2: the run's lease (no-ops on a table created above)
    "ALTER TABLE flowrt_runs ADD COLUMN IF NOT EXISTS lease_holder TEXT",
    "ALTER TABLE flowrt_runs ADD COLUMN IF NOT EXISTS lease_expires DOUBLE PRECISION",
]

T = TypeVar("T")


def _by_name(conn: Any) -> Any:
    """A cursor on ``conn`` whose rows are dicts (read by column name; the connection's own rows stay tuples)."""
    from psycopg.rows import dict_row

    return conn.cursor(row_factory=dict_row)


def is_postgres_url(spec: str) -> bool:
    return spec.startswith(("postgresql://", "postgres://"))


class PostgresStore:
    """A ``CheckpointStore`` in a PostgreSQL database (``postgresql://user:pass@host:port/db``).

    ``readonly=True`` (reading commands: ``flowrt runs list|show``): never creates or changes a table (the
    session's transactions are read-only, and the writing methods raise ``ReadOnlyStoreError``), as on SQLite.
    ``create=False`` (readonly implies it): a database without flowrt's tables is a ``CheckpointError`` ("no
    flowrt checkpoints in ...") instead of getting them."""

    def __init__(self, url: str, *, connect_timeout: float = 10.0, readonly: bool = False,
                 create: bool = True) -> None:
        try:
            import psycopg
        except ImportError:
            raise CheckpointError("a postgresql:// checkpoint store needs psycopg 3: pip install 'flowrt[postgres]'"
                                  ) from None
        self._psycopg = psycopg
        self.url = url
        self.where = redact_url(url)   # how the store is named in messages: never its password
        self._timeout = connect_timeout
        self.readonly = readonly
        self._create = create and not readonly
        self._cols = run_columns()
        self._lock = threading.Lock()
        self._conn: Any = None
        with self._lock:
            self._connect()
        self._guard("opening the database", self._init_schema, writes=False)

    # ------------------------------------------------------------------ connection
    def _connect(self) -> Any:
        if self._conn is not None and not self._conn.closed and not self._conn.broken:
            return self._conn
        try:
            self._conn = self._psycopg.connect(self.url, autocommit=True, connect_timeout=max(1, int(self._timeout)))
            if self.readonly:   # the server itself refuses any write of this session
                self._conn.execute("SET SESSION CHARACTERISTICS AS TRANSACTION READ ONLY")
        except self._psycopg.Error as e:
            raise CheckpointError(f"cannot connect to the checkpoint database {self.where}: "
                                  f"{self._message(e)}") from None
        return self._conn

    def _message(self, e: Exception) -> str:
        """A driver error's text, without the password should it quote the connection string."""
        return scrub(str(e).strip() or type(e).__name__, self.url)

    def _guard(self, what: str, fn: Callable[[Any], T], *, writes: bool = True) -> T:
        """``fn(connection)`` in one transaction, under the store's lock; database errors as ``CheckpointError``
        (a connection lost since the last call is opened again first)."""
        if writes and self.readonly:
            raise ReadOnlyStoreError(f"checkpoint database {self.where} was opened read-only: {what} needs a "
                                     f"writable one")
        with self._lock:
            conn = self._connect()
            try:
                with conn.transaction():
                    return fn(conn)
            except self._psycopg.Error as e:
                raise CheckpointError(f"checkpoint database {self.where}: {what} failed: {self._message(e)}") from None

    def _init_schema(self, c: Any) -> None:
        if not self.readonly:
            c.execute("SELECT pg_advisory_xact_lock(%s)", (_LOCK_KEY,))
        tables = {r[0] for r in c.execute("SELECT table_name FROM information_schema.tables "
                                          "WHERE table_schema = current_schema() AND table_name LIKE 'flowrt%%'")}
        if "flowrt_schema_version" in tables:
            row = c.execute("SELECT MAX(version) FROM flowrt_schema_version").fetchone()
            version = row[0] if row else None
            if version is None:
                raise CheckpointError(f"{self.where}: checkpoint tables without a schema version (corrupt?)")
            if version > SCHEMA_VERSION:
                raise CheckpointError(f"{self.where} was written by a newer flowrt (checkpoint format {version}; "
                                      f"this flowrt reads format {SCHEMA_VERSION} and older): upgrade flowrt")
            if self.readonly:   # read as it is: format 1 lacks only the lease columns
                self._cols = run_columns(lease=version >= 2)
                return
        elif not self._create:
            raise CheckpointError(f"no flowrt checkpoints in {self.where} (the database has no flowrt tables: "
                                  f"no run was saved there)")
        for stmt in _SCHEMA:
            c.execute(stmt)
        if not c.execute("SELECT 1 FROM flowrt_schema_version").fetchone():
            c.execute("INSERT INTO flowrt_schema_version (version) VALUES (%s)", (SCHEMA_VERSION,))
        else:
            c.execute("UPDATE flowrt_schema_version SET version = %s", (SCHEMA_VERSION,))

    # ------------------------------------------------------------------ writing
    def create_run(self, run_id: str, workflow: str, inputs: dict[str, Any], *, file: str | None = None,
                   meta: dict[str, Any] | None = None, holder: str | None = None, ttl: float = 0.0) -> None:
        now = time.time()

        def go(c: Any) -> None:
            cur = c.execute("INSERT INTO flowrt_runs (run_id, workflow, file, status, inputs, meta, created, updated, "
                            "lease_holder, lease_expires) VALUES (%s, %s, %s, 'running', %s, %s, %s, %s, %s, %s) "
                            "ON CONFLICT (run_id) DO NOTHING",
                            (run_id, workflow, file, dumps(inputs), dumps(meta or {}), now, now, holder,
                             now + ttl if holder else None))
            if cur.rowcount == 0:
                raise CheckpointError(f"run {run_id!r} already exists in {self.where}")

        self._guard("creating a run", go)

    def claim_run(self, run_id: str, holder: str, ttl: float, *, take_over: str | None = None,
                  waiting: bool = False) -> RunRecord:
        now = time.time()

        def go(c: Any) -> RunRecord:
            # One conditional UPDATE: a concurrent claim waits for this row's lock, then finds the condition
            # false (READ COMMITTED re-checks it on the updated row), so exactly one changes it.
            taken = c.execute(
                "UPDATE flowrt_runs SET status = 'running', lease_holder = %s, lease_expires = %s, updated = %s "
                "WHERE run_id = %s AND status = ANY(%s) AND (lease_holder IS NULL OR lease_expires IS NULL "
                "OR lease_expires <= %s OR lease_holder = %s OR lease_holder = %s)",
                (holder, now + ttl, now, run_id, ["interrupted"] if waiting else list(RESUMABLE), now, holder,
                 take_over)).rowcount
            row = _by_name(c).execute(f"SELECT {self._cols}, state FROM flowrt_runs WHERE run_id = %s",
                                      (run_id,)).fetchone()
            if row is None:
                raise UnknownRunError(f"no run {run_id!r} in {self.where}")
            if not taken:
                raise claim_refusal(run_id, row["status"], row["lease_holder"], row["lease_expires"], holder, take_over,
                                    now)
            return self._record(c, row, True)

        return self._guard("claiming a run", go)

    def renew_lease(self, run_id: str, holder: str, ttl: float) -> bool:
        return self._guard("renewing a run's lease", lambda c: c.execute(
            "UPDATE flowrt_runs SET lease_expires = %s WHERE run_id = %s AND lease_holder = %s "
                 "AND lease_expires IS NOT NULL",
            (time.time() + ttl, run_id, holder)).rowcount == 1)

    def release_run(self, run_id: str, holder: str, *, status: str | None = None) -> None:
        self._guard("releasing a run", lambda c: c.execute(
            "UPDATE flowrt_runs SET lease_expires = NULL, status = COALESCE(%s, status) "
            "WHERE run_id = %s AND lease_holder = %s", (status, run_id, holder)))

    def save(self, run_id: str, *, step: str | None, visit: int, step_status: str, result: Any, route: Any,
             threads: list[dict[str, Any]], state: dict[str, Any], run_status: str,
             interrupt: dict[str, Any] | None = None, holder: str | None = None) -> int:
        now = time.time()

        def go(c: Any) -> int:
            run = _by_name(c).execute("SELECT state, lease_holder, lease_expires, status FROM flowrt_runs "
                                      "WHERE run_id = %s FOR UPDATE", (run_id,)).fetchone()
            if run is None:
                raise UnknownRunError(f"no run {run_id!r} in {self.where}")
            check_holder(run_id, holder, run["lease_holder"], run["lease_expires"], run["status"])
            seq = int(c.execute("SELECT COALESCE(MAX(seq), 0) FROM flowrt_checkpoints WHERE run_id = %s",
                                (run_id,)).fetchone()[0]) + 1
            packed = pack(state, step, visit, seq, result, route, json.loads(run["state"]) if run["state"] else None)
            c.execute("INSERT INTO flowrt_checkpoints (run_id, seq, step, visit, status, result, route, created) "
                      "VALUES (%s, %s, %s, %s, %s, %s, %s, %s)",
                      (run_id, seq, step, visit, step_status, dumps(result), dumps(route), now))
            lease = "" if run_status == "running" else ", lease_expires = NULL"   # it ended: given back
            c.execute(f"UPDATE flowrt_runs SET status = %s, interrupt = %s, updated = %s, state = %s, threads = %s"
                      f"{lease} WHERE run_id = %s", (run_status, dumps(interrupt) if interrupt is not None else None,
                                                     now, dumps(packed), dumps(threads), run_id))
            return seq

        return self._guard("saving a checkpoint", go)

    def delete_run(self, run_id: str) -> None:
        self._guard("deleting a run", lambda c: c.execute("DELETE FROM flowrt_runs WHERE run_id = %s", (run_id,)))

    # ------------------------------------------------------------------ reading
    @staticmethod
    def _record(c: Any, row: Row, with_state: bool) -> RunRecord:
        """The run of a row of ``_cols`` and ``state``."""
        run_id, raw = row["run_id"], row["state"]
        n = c.execute("SELECT COUNT(*) FROM flowrt_checkpoints WHERE run_id = %s", (run_id,)).fetchone()[0]
        state = stored_state(
            raw,
            lambda seqs: c.execute("SELECT seq, result FROM flowrt_checkpoints WHERE run_id = %s AND seq = ANY(%s)",
                                   (run_id, seqs)),
            lambda: c.execute("SELECT step, visit, route FROM flowrt_checkpoints WHERE run_id = %s AND route != 'null' "
                              "ORDER BY seq", (run_id,))) if with_state else None
        return run_record(row, n, state)

    def get_run(self, run_id: str, *, with_state: bool = True) -> RunRecord:
        def go(c: Any) -> RunRecord:
            row = _by_name(c).execute(f"SELECT {self._cols}, state FROM flowrt_runs WHERE run_id = %s",
                                      (run_id,)).fetchone()
            if row is None:
                raise UnknownRunError(f"no run {run_id!r} in {self.where}")
            return self._record(c, row, with_state)

        return self._guard("reading a run", go, writes=False)

    def list_runs(self, limit: int = 50) -> list[RunRecord]:
        def go(c: Any) -> list[RunRecord]:
            rows = _by_name(c).execute(f"SELECT {self._cols}, NULL AS state FROM flowrt_runs ORDER BY created DESC "
                                       f"LIMIT %s", (limit,)).fetchall()
            return [self._record(c, r, False) for r in rows]

        return self._guard("listing runs", go, writes=False)

    def history(self, run_id: str) -> list[dict[str, Any]]:
        def go(c: Any) -> list[dict[str, Any]]:
            rows = _by_name(c).execute(f"SELECT {HISTORY_COLUMNS} FROM flowrt_checkpoints WHERE run_id = %s "
                                       f"ORDER BY seq", (run_id,)).fetchall()
            return [history_entry(r) for r in rows]

        return self._guard("reading a run's history", go, writes=False)

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                try:
                    self._conn.close()
                except self._psycopg.Error:
                    pass

    def __repr__(self) -> str:
        return f"PostgresStore({self.where!r})"
