"""The writer lock of an index directory: one writer at a time, readers never wait.

Every write (build, add, delete, save) holds an exclusive ``flock`` on ``.<name>.lock`` beside the index
directory ``<name>``. Beside, not inside, because the first save of an index creates the directory by renaming
a temporary one into place, and two first builds must take the same lock. The holder writes its pid into the
file so that a writer that gives up waiting can say who holds it. The kernel drops a flock when its process
dies, so a crashed writer never leaves a stale lock; the holder removes the file on release, and a waiter that
locked a file removed meanwhile tries again on the new one.

The lock is re-entrant within a thread (``Retriever.updating`` holds it around ``save``, which takes it too);
other threads and processes wait.
"""

from __future__ import annotations

import fcntl
import os
import threading
import time
from pathlib import Path

from .errors import IndexLockedError, IndexNotFoundError

__all__ = ["IndexLock", "DEFAULT_LOCK_TIMEOUT", "lock_path"]

DEFAULT_LOCK_TIMEOUT = 120.0  #: seconds a writer waits for another (embedding a large add takes a while)

_registry = threading.Lock()
_held: dict[str, tuple[int, int, int]] = {}  # lock file -> (owner thread id, depth, fd)


def lock_path(index_dir: str | os.PathLike) -> Path:
    """The lock file of an index directory (which need not exist yet)."""
    d = Path(index_dir).resolve()
    return d.parent / f".{d.name}.lock"


def _same_file(fd: int, path: Path) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


def _holder(path: Path) -> int | None:
    try:
        return int(path.read_text(encoding="utf-8").strip())
    except (OSError, ValueError):
        return None


class IndexLock:
    """``with IndexLock(index_dir, timeout=60): ...`` holds the index's writer lock (waits up to ``timeout`` s)."""

    def __init__(self, index_dir: str | os.PathLike, *, timeout: float = DEFAULT_LOCK_TIMEOUT):
        self.index_dir = Path(index_dir)
        self.path = lock_path(index_dir)
        self.timeout = float(timeout)

    def __enter__(self) -> "IndexLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def acquire(self) -> None:
        key, me = str(self.path), threading.get_ident()
        with _registry:
            owner = _held.get(key)
            if owner is not None and owner[0] == me:
                _held[key] = (me, owner[1] + 1, owner[2])
                return
        fd = self._wait()
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        with _registry:
            _held[key] = (me, 1, fd)

    def _wait(self) -> int:
        deadline = time.monotonic() + self.timeout
        delay = 0.01
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except FileNotFoundError:
                raise IndexNotFoundError(
                    f"no index at {self.index_dir}: the directory {self.path.parent} does not exist") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise self._locked_error() from None
                time.sleep(min(delay, left))
                delay = min(delay * 2, 0.2)
                continue
            if _same_file(fd, self.path):  # else the previous holder removed it while we waited: retry
                return fd
            os.close(fd)

    def _locked_error(self) -> IndexLockedError:
        pid = _holder(self.path)
        who = f"pid {pid}" if pid is not None else "another process"
        return IndexLockedError(
            f"index {self.index_dir} is locked by {who} (another build, add or delete is writing it); "
            f"gave up after waiting {self.timeout:g}s. Wait for it to finish and retry, or allow a longer wait "
            f"(--lock-timeout SECONDS). The lock file is {self.path}",
            pid=pid,
        )

    def release(self) -> None:
        key = str(self.path)
        with _registry:
            owner = _held.get(key)
            if owner is None or owner[0] != threading.get_ident():
                raise RuntimeError(f"release of {self.path}, which this thread does not hold")
            if owner[1] > 1:
                _held[key] = (owner[0], owner[1] - 1, owner[2])
                return
            del _held[key]
        fd = owner[2]
        try:
            self.path.unlink(missing_ok=True)  # while still locked: a waiter on this file sees it went and retries
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
