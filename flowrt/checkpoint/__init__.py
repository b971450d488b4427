"""Checkpoints: a run's state saved after every step, so that it can resume after a crash or an interrupt.

* ``CheckpointStore`` is the interface (a Protocol): SQLite through the standard library is the default
  (``SQLiteStore``; ``":memory:"`` for a store that lives as long as the process); ``PostgresStore``
  (a ``postgresql://`` URL; psycopg 3) shares runs between processes on several machines.
* ``RunCheckpoint`` binds a store to one run for the executor: it encodes the state (flowrt.checkpoint.codec)
  after every step, and restores it when the run resumes.
* Leases (flowrt.checkpoint.lease): one holder executes a run at a time. Resuming claims the run in one
  atomic transition of the store (``claim_run``); a second resume gets ``RunBusyError`` naming the holder.

What a checkpoint holds: the inputs (with the run), each finished step's result (JSON; a result JSON cannot
hold exactly is stored as a marked placeholder and its step runs again on resume), the routes taken, the
interrupt answers given, and for every live thread of the run its token ids and text (not its KV: a thread
restored from its token ids gets its blocks back from the engine's prefix cache when they are still there,
and recomputes the rest).
"""

from .codec import decode, encode
from .postgres import PostgresStore
from .run import RunCheckpoint, open_store
from .sqlite import SCHEMA_VERSION, SQLiteStore
from .store import (CheckpointError, CheckpointStore, LeaseLostError, ReadOnlyStoreError, RunBusyError,
                    RunNotResumableError, RunRecord, UnknownRunError)

__all__ = ["CheckpointStore", "CheckpointError", "RunRecord", "SQLiteStore", "PostgresStore", "RunCheckpoint",
           "open_store", "encode", "decode", "SCHEMA_VERSION", "UnknownRunError", "RunNotResumableError",
           "RunBusyError", "LeaseLostError", "ReadOnlyStoreError"]
