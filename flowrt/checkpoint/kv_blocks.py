"""``KVBlockStore``: the block files of one KV directory (``DIR/<fingerprint>/<hash[:2]>/<hash>.kv``).

A file holds a header line (fingerprint, hash, size, BLAKE2b of the content) after a magic line, then the
content. A block that is missing, not a regular file, of the wrong size, corrupt or another's (fingerprint,
hash) is rejected, never used; the store remembers the rejected ones so that the next save replaces them
(a file that exists is otherwise not written again).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import stat
from enum import Enum

from .kv_files import NotRegularFile, TooLarge, read_regular, real_dir, write_atomic
from .kv_layout import foreign_entries
from .store import CheckpointError

__all__ = ["KVBlockStore", "Rejection", "MAGIC", "HEADER_MAX", "parse_header", "is_own"]

MAGIC = b"flowrt-kv 1\n"
HEADER_MAX = 512                          # magic and header line: ~170 bytes


class Rejection(str, Enum):
    """Why a saved block was not loaded (the keys of a resume's ``kv_blocks_rejected``)."""

    MISSING = "missing"
    CORRUPT = "corrupt"          # truncated, wrong size, bad checksum, not a block file
    FOREIGN = "foreign"          # another model's block (fingerprint), or filed under another hash
    NOT_A_FILE = "not_a_file"    # a symlink, FIFO, device or directory at the block's path
    UNREADABLE = "unreadable"    # the file system refused (permissions, I/O error)
    UNSAVED = "unsaved"          # still queued for writing when the checkpoint was saved, never written (a crash)


def parse_header(raw: bytes) -> dict | None:
    """The header of ``raw`` (a block file's first bytes), with ``offset`` where the content starts; None
    when it is not a block file's."""
    end = raw.find(b"\n", len(MAGIC))
    if not raw.startswith(MAGIC) or end < 0:
        return None
    try:
        meta = json.loads(raw[len(MAGIC):end])
    except ValueError:
        return None
    return {**meta, "offset": end + 1} if isinstance(meta, dict) else None


def is_own(meta: dict | None, fingerprint: str, hexhash: str) -> bool:
    """The header is of this block: the fingerprint and hash its path names."""
    return meta is not None and meta.get("fingerprint") == fingerprint and meta.get("hash") == hexhash


class KVBlockStore:
    """Block files under one directory (see the module docstring)."""

    def __init__(self, root: str) -> None:
        self.root = root
        self._dirs: set[str] = set()                 # folders made (or found) already
        self._bad: set[tuple[str, bytes]] = set()    # rejected on read: replaced by the next save
        try:
            os.makedirs(root, exist_ok=True)
        except OSError as e:
            raise CheckpointError(f"cannot create the KV block directory {root}: {e}") from None
        try:
            foreign = foreign_entries(root)
        except OSError as e:
            raise CheckpointError(f"cannot read the KV block directory {root}: {e}") from None
        if foreign:
            shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
            raise CheckpointError(
                f"the KV block directory {root} holds files flowrt did not write ({shown}); KV blocks are a "
                f"cache flowrt deletes from, so they need a directory of their own: give --checkpoint-kv "
                f"(checkpoint_kv=) a new or empty directory, e.g. {os.path.join(root, 'flowrt-kv')}")

    def path(self, fingerprint: str, h: bytes) -> str:
        x = h.hex()
        return os.path.join(self.root, fingerprint, x[:2], x + ".kv")

    def fresh(self, fingerprint: str, h: bytes) -> bool:
        """The block is on disk, a regular file not rejected since: it need not be written. Its mtime is
        renewed (collection spares young files); a file that cannot be touched is written again (it may
        be another user's, or be collected right now), except on a read-only file system."""
        if (fingerprint, h) in self._bad:
            return False
        p = self.path(fingerprint, h)
        try:
            if not stat.S_ISREG(os.lstat(p).st_mode):
                return False
            os.utime(p, follow_symlinks=False)
        except OSError as e:
            return e.errno == errno.EROFS
        return True

    def write(self, fingerprint: str, h: bytes, data: bytes) -> int:
        """Atomically (a new temporary file, fsync'd, renamed): a crash leaves the block whole or absent;
        returns the file's size. ``OSError`` when the file system refuses (full, read-only)."""
        x = h.hex()
        folder = os.path.join(self.root, fingerprint, x[:2])
        if folder not in self._dirs:
            real_dir(self.root, fingerprint, x[:2])
            self._dirs.add(folder)
        header = json.dumps({"fingerprint": fingerprint, "hash": x, "bytes": len(data),
                             "blake2b": hashlib.blake2b(data, digest_size=16).hexdigest()}).encode()
        head = MAGIC + header + b"\n"
        write_atomic(folder, x + ".kv", (head, data), fsync=True)
        self._bad.discard((fingerprint, h))
        return len(head) + len(data)

    def read(self, fingerprint: str, h: bytes, size: int) -> tuple[bytes | None, Rejection | None]:
        """The block's content (``size`` bytes, this engine's block), or None and why not. Reads at most
        the header and ``size`` bytes, from a regular file only. A block read is used: its mtime is renewed
        (the disk budget evicts the least recently used)."""
        data, why = self._read(fingerprint, h, size)
        if why is None:
            with contextlib.suppress(OSError):
                os.utime(self.path(fingerprint, h), follow_symlinks=False)
        elif why is not Rejection.MISSING:
            self._bad.add((fingerprint, h))
        return data, why

    def _read(self, fingerprint: str, h: bytes, size: int) -> tuple[bytes | None, Rejection | None]:
        try:
            raw = read_regular(self.path(fingerprint, h), HEADER_MAX + size)
        except FileNotFoundError:
            return None, Rejection.MISSING
        except NotRegularFile:
            return None, Rejection.NOT_A_FILE
        except TooLarge:
            return None, Rejection.CORRUPT
        except OSError:
            return None, Rejection.UNREADABLE
        meta = parse_header(raw)
        if meta is None:
            return None, Rejection.CORRUPT
        if not is_own(meta, fingerprint, h.hex()):
            return None, Rejection.FOREIGN
        data = raw[meta["offset"]:]
        if meta.get("bytes") != size or len(data) != size \
                or meta.get("blake2b") != hashlib.blake2b(data, digest_size=16).hexdigest():
            return None, Rejection.CORRUPT
        return data, None
