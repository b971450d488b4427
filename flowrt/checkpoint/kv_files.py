"""Files of a KV block directory, read and written so that what others put there cannot steer flowrt.

The directory is meant to be shared (several processes, machines, databases), so anyone who can write it may
plant a symlink, a FIFO or a device node at a block path or at a temporary name. Reads therefore open only
regular files, never through a symlink, without blocking on a FIFO, and read no more than a block can be;
writes create a temporary file of a random name that must not exist yet (never through a symlink), in the
block's own directory, and rename it over the block: a planted name is never written through.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from typing import Iterable, Iterator

__all__ = ["NotRegularFile", "TooLarge", "read_regular", "write_atomic", "real_dir", "TEMP_SUFFIX"]

TEMP_SUFFIX = ".tmp"
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class NotRegularFile(OSError):
    """The path is a symlink, a FIFO, a device or a directory: not a file flowrt wrote."""


class TooLarge(OSError):
    """The file holds more than the caller can use (a block is never larger than its header and content)."""


@contextlib.contextmanager
def _open_regular(path: str) -> Iterator[tuple[int, os.stat_result]]:
    try:
        fd = os.open(path, _READ_FLAGS)
    except OSError as e:
        if e.errno == errno.ELOOP:   # O_NOFOLLOW on a symlink
            raise NotRegularFile(errno.ELOOP, "a symlink, not a regular file", path) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegularFile(errno.EINVAL, "not a regular file", path)
        yield fd, st
    finally:
        os.close(fd)


def read_regular(path: str, limit: int, *, head: bool = False) -> bytes:
    """A regular file's content: all of it, which must be at most ``limit`` bytes (``TooLarge``), or with
    ``head`` only its first ``limit`` bytes. ``FileNotFoundError`` when absent, ``NotRegularFile``."""
    with _open_regular(path) as (fd, st):
        if st.st_size > limit and not head:
            raise TooLarge(errno.EFBIG, f"{st.st_size} bytes, more than the {limit} expected", path)
        parts, left = [], limit
        while left > 0:
            part = os.read(fd, min(left, 1 << 20))
            if not part:
                break
            parts.append(part)
            left -= len(part)
        if not head and left == 0 and os.read(fd, 1):   # it grew since fstat
            raise TooLarge(errno.EFBIG, f"more than the {limit} bytes expected", path)
        return b"".join(parts)


def write_atomic(folder: str, name: str, parts: Iterable[bytes], *, fsync: bool = False) -> None:
    """Write ``folder/name`` whole or not at all: a new temporary file of a random name beside it
    (``O_EXCL | O_NOFOLLOW``), renamed over it; with ``fsync`` its content is on disk before the rename (a
    power cut then leaves the old file or the whole new one, never an empty one). On any error the temporary
    file is removed and the error raised (a full or read-only file system: ``OSError`` ENOSPC, EROFS)."""
    tmp = os.path.join(folder, f"{name}.{secrets.token_hex(8)}{TEMP_SUFFIX}")
    fd = os.open(tmp, _CREATE_FLAGS, 0o666)
    try:
        with open(fd, "wb", closefd=True) as f:
            for part in parts:
                f.write(part)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, os.path.join(folder, name))
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def real_dir(root: str, *names: str) -> str:
    """``root/names...``, each level made if absent and checked to be a directory, not a symlink to one
    (``root`` itself may be a symlink: the user chose it). ``NotADirectoryError`` otherwise."""
    path = root
    for name in names:
        path = os.path.join(path, name)
        with contextlib.suppress(FileExistsError):
            os.mkdir(path)
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            raise NotADirectoryError(errno.ENOTDIR, "not a directory (a symlink?)", path)
    return path
