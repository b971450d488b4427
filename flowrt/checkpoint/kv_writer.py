"""``KVWriter``: KV blocks written to disk off the event loop, by one thread behind a bounded queue.

A checkpoint's save copies its new blocks out of the engine (memory, fast) and hands them here; writing
them (a file each, fsync'd, renamed into place) is what took the event loop about 1 s per 150 MB. The queue
holds at most ``queue_bytes`` of block content: a save that finds it full waits for room until its
deadline (``max_wait_s``) and then leaves the blocks that do not fit unsaved, so a step never waits on disk
longer than that. ``queue_bytes=0`` writes on the caller instead (the synchronous baseline).

What is queued or being written is ``pending`` (a later save does not copy it again); what the disk refused
is ``failed`` until a later write of it succeeds. ``flush`` waits until everything handed over is on disk or
failed, and fsyncs the folders written to, so a run's last checkpoint names only durable blocks.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import threading
import time
from collections import deque
from typing import Callable

from .kv_blocks import KVBlockStore

__all__ = ["KVWriter", "Submitted", "QUEUE_BYTES", "MAX_WAIT_S"]

logger = logging.getLogger("flowrt.checkpoint")

QUEUE_BYTES = 256 << 20   # block content waiting to be written, at most
MAX_WAIT_S = 0.5          # the longest a save waits for room in the queue

Key = tuple[str, bytes]   # (fingerprint, hash)


class Submitted(enum.Enum):
    QUEUED = "queued"       # the writer thread writes it
    WRITTEN = "written"     # on disk already (queue_bytes=0)
    DROPPED = "dropped"     # not saved: the queue stayed full, or the disk refused (queue_bytes=0)


class KVWriter:
    """One writer thread for a block store (see the module docstring). ``write(key, data)`` does the work
    and raises ``OSError`` for a block the disk (or the budget) refuses; ``on_error`` hears of each."""

    def __init__(self, blocks: KVBlockStore, write: Callable[[Key, bytes], None],
                 on_error: Callable[[OSError], None], *, queue_bytes: int = QUEUE_BYTES,
                 max_wait_s: float = MAX_WAIT_S) -> None:
        self.blocks = blocks
        self.queue_bytes = queue_bytes
        self.max_wait_s = max_wait_s
        self._write, self._on_error = write, on_error
        self._cv = threading.Condition()
        self._queue: deque[tuple[Key, bytes]] = deque()
        self._queued = 0                 # bytes in the queue
        self._writing: Key | None = None
        self._pending: set[Key] = set()
        self.failed: set[Key] = set()
        self._folders: set[str] = set()  # written to since the last flush: fsync'd by it
        self._thread: threading.Thread | None = None
        self._closed = False

    def deadline(self) -> float:
        """When a save that starts now stops waiting for room."""
        return time.monotonic() + self.max_wait_s

    def pending(self, key: Key) -> bool:
        with self._cv:
            return key in self._pending

    def submit(self, key: Key, data: bytes, deadline: float) -> Submitted:
        if self.queue_bytes <= 0:
            return Submitted.WRITTEN if self._write_one(key, data) else Submitted.DROPPED
        with self._cv:
            if key in self._pending:
                return Submitted.QUEUED
            # a block larger than the whole queue still goes in, alone
            while self._queue and self._queued + len(data) > self.queue_bytes:
                left = deadline - time.monotonic()
                if left <= 0:
                    return Submitted.DROPPED
                self._cv.wait(left)
            self._queue.append((key, data))
            self._queued += len(data)
            self._pending.add(key)
            self._start()
            self._cv.notify_all()
        return Submitted.QUEUED

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every block handed over is written or failed, then fsync the folders written to;
        False when ``timeout`` ran out first."""
        end = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while self._queue or self._writing is not None:
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cv.wait(left)
            folders, self._folders = self._folders, set()
        for folder in folders:
            _fsync_dir(folder)
        return True

    def close(self) -> None:
        """Write what is queued, then stop the thread (a later ``submit`` starts another)."""
        self.flush()
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join()
        with self._cv:
            self._closed, self._thread = False, None

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="flowrt-kv-writer", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if not self._queue:
                    return
                key, data = self._queue.popleft()
                self._queued -= len(data)
                self._writing = key
                self._cv.notify_all()   # room in the queue
            try:
                self._write_one(key, data)
            except Exception:  # noqa: BLE001 - a bug must not stop the thread (flush would wait forever)
                logger.exception("KV block %s not saved", key[1].hex())
            finally:
                with self._cv:
                    self._writing = None
                    self._pending.discard(key)
                    self._cv.notify_all()

    def _write_one(self, key: Key, data: bytes) -> bool:
        try:
            self._write(key, data)
        except OSError as e:
            with self._cv:
                self.failed.add(key)
            self._on_error(e)
            return False
        except BaseException:
            with self._cv:
                self.failed.add(key)
            raise
        with self._cv:
            self.failed.discard(key)
            self._folders.add(os.path.dirname(self.blocks.path(*key)))
        return True


def _fsync_dir(folder: str) -> None:
    """The renames into ``folder`` survive a power cut (the files themselves were fsync'd before)."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
