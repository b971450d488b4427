"""Step results kept for ``fr.Cache`` steps, in the checkpoint store's database (a table of their own).

``ResultCache`` is the interface: ``get`` a live entry by key, ``put`` one (replacing an entry of that key;
expired entries are dropped on the way). ``result_cache(store)`` gives the one of a store: a ``step_cache``
table in the SQLite file, ``flowrt_step_cache`` in PostgreSQL, created on first use (runs and checkpoints
do not refer to it, so the store's format is unchanged and an older flowrt reads the file as before), or a
store's own ``result_cache()``. Expiry times are the writers' ``time.time()``: hosts sharing a PostgreSQL
store must agree on the time to well within the TTLs they use.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from .postgres import _LOCK_KEY
from .rows import dumps

__all__ = ["CachedResult", "ResultCache", "result_cache", "SQLiteResultCache", "PostgresResultCache"]


@dataclass(frozen=True)
class CachedResult:
    """A kept step result: ``result`` as flowrt.checkpoint.codec encodes it (``{"json": ...}``)."""

    workflow: str
    step: str
    result: dict[str, Any]
    created: float
    expires: float | None    # time.time() after which it is not used; None: never expires


@runtime_checkable
class ResultCache(Protocol):
    def get(self, key: str, now: float) -> CachedResult | None:
        """The entry of ``key`` that has not expired at ``now``, or None."""
        ...

    def put(self, key: str, entry: CachedResult) -> None:
        """Keep ``entry`` under ``key`` (replacing what was there), in one transaction."""
        ...


def result_cache(store: Any) -> ResultCache | None:
    """The result cache of checkpoint store ``store``; None for a store that keeps none (one opened read-only,
    or another kind without a ``result_cache()`` method)."""
    from .postgres import PostgresStore
    from .sqlite import SQLiteStore

    if getattr(store, "readonly", False):
        return None
    if isinstance(store, SQLiteStore):
        return SQLiteResultCache(store)
    if isinstance(store, PostgresStore):
        return PostgresResultCache(store)
    own = getattr(store, "result_cache", None)
    return own() if callable(own) else None


def _entry(row: tuple) -> CachedResult:
    workflow, step, result, created, expires = row
    return CachedResult(workflow, step, json.loads(result), created, expires)


class SQLiteResultCache:
    """The ``step_cache`` table of an ``SQLiteStore`` (its connection, lock and transactions)."""

    _TABLE = ("CREATE TABLE IF NOT EXISTS step_cache (key TEXT PRIMARY KEY, workflow TEXT NOT NULL, "
              "step TEXT NOT NULL, result TEXT NOT NULL, created REAL NOT NULL, expires REAL)")

    def __init__(self, store: Any) -> None:
        self.store = store
        self._ready = False

    def _ensure(self) -> None:
        if not self._ready:
            def go() -> None:
                with self.store._tx() as c:
                    c.execute(self._TABLE)

            self.store._guard("creating the step cache", go)
            self._ready = True

    def get(self, key: str, now: float) -> CachedResult | None:
        self._ensure()

        def go() -> CachedResult | None:
            with self.store._lock:
                row = self.store._conn.execute(
                    "SELECT workflow, step, result, created, expires FROM step_cache WHERE key = ? "
                    "AND (expires IS NULL OR expires > ?)", (key, now)).fetchone()
            return _entry(row) if row else None

        return self.store._guard("reading the step cache", go, writes=False)

    def put(self, key: str, entry: CachedResult) -> None:
        self._ensure()

        def go() -> None:
            with self.store._tx() as c:
                c.execute("DELETE FROM step_cache WHERE expires <= ?", (entry.created,))
                c.execute("INSERT INTO step_cache (key, workflow, step, result, created, expires) "
                          "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (key) DO UPDATE SET workflow = excluded.workflow, "
                          "step = excluded.step, result = excluded.result, created = excluded.created, "
                          "expires = excluded.expires",
                          (key, entry.workflow, entry.step, dumps(entry.result), entry.created, entry.expires))

        self.store._guard("writing the step cache", go)


class PostgresResultCache:
    """The ``flowrt_step_cache`` table of a ``PostgresStore`` (its connection and transactions)."""

    _TABLE = ("CREATE TABLE IF NOT EXISTS flowrt_step_cache (key TEXT PRIMARY KEY, workflow TEXT NOT NULL, "
              "step TEXT NOT NULL, result TEXT NOT NULL, created DOUBLE PRECISION NOT NULL, "
              "expires DOUBLE PRECISION)")

    def __init__(self, store: Any) -> None:
        self.store = store
        self._ready = False

    def _ensure(self) -> None:
        if not self._ready:
            def go(c: Any) -> None:   # under the schema's advisory lock: processes creating it at once do not collide
                c.execute("SELECT pg_advisory_xact_lock(%s)", (_LOCK_KEY,))
                c.execute(self._TABLE)

            self.store._guard("creating the step cache", go)
            self._ready = True

    def get(self, key: str, now: float) -> CachedResult | None:
        self._ensure()

        def go(c: Any) -> CachedResult | None:
            row = c.execute("SELECT workflow, step, result, created, expires FROM flowrt_step_cache WHERE key = %s "
                            "AND (expires IS NULL OR expires > %s)", (key, now)).fetchone()
            return _entry(row) if row else None

        return self.store._guard("reading the step cache", go, writes=False)

    def put(self, key: str, entry: CachedResult) -> None:
        self._ensure()

        def go(c: Any) -> None:
            c.execute("DELETE FROM flowrt_step_cache WHERE expires <= %s", (entry.created,))
            c.execute("INSERT INTO flowrt_step_cache (key, workflow, step, result, created, expires) "
                      "VALUES (%s, %s, %s, %s, %s, %s) ON CONFLICT (key) DO UPDATE SET workflow = EXCLUDED.workflow, "
                      "step = EXCLUDED.step, result = EXCLUDED.result, created = EXCLUDED.created, "
                      "expires = EXCLUDED.expires",
                      (key, entry.workflow, entry.step, dumps(entry.result), entry.created, entry.expires))

        self.store._guard("writing the step cache", go)
