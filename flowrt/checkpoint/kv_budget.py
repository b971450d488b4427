"""``KVBudget``: a cap on the bytes of a KV directory's block files (``checkpoint_kv_max_bytes``,
``--checkpoint-kv-max-bytes``; default 20 GiB, 0: no cap).

Before a block is written, a directory that would go over its budget loses its least recently used blocks
(by mtime: a save renews each block it keeps, a resume each block it loads) that no unfinished run refers to
(the reference files, flowrt.checkpoint.kv_refs, which name the blocks of every waiting or running run of
every database sharing the directory), down to 90% of the budget. A block that still does not fit (the
runs' own blocks fill the budget) is not written: it is counted with the blocks not saved, and computed
again by a resume. The bytes in use are scanned once, then counted as blocks are written; a full directory
is scanned again at most once a second (other processes may have freed room).
"""

from __future__ import annotations

import argparse
import errno
import re
import time
from typing import Any

from .kv_collect import evict_lru, scan_blocks
from .kv_refs import RunRefs
from .store import CheckpointError

__all__ = ["KVBudget", "OverBudget", "DEFAULT_MAX_BYTES", "parse_size", "add_kv_budget"]

DEFAULT_MAX_BYTES = 20 << 30
_LOW_WATER = 0.9
_RESCAN_S = 1.0
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*", re.IGNORECASE)


def parse_size(text: str) -> int:
    """``"20G"``, ``"512MiB"``, ``"1.5T"``, ``"1000000"`` as bytes (powers of 1024); ``ValueError`` else."""
    m = _SIZE.fullmatch(str(text))
    if m is None:
        raise ValueError(f"not a size: {text!r} (bytes, or with K, M, G, T: 20G, 512M)")
    return int(float(m[1]) * 1024 ** " kmgt".index(m[2].lower() or " "))


class OverBudget(OSError):
    """The block does not fit in the disk budget, even after evicting every unreferenced block."""


class KVBudget:
    """The budget of one KV directory (see the module docstring); used by one writer thread."""

    def __init__(self, root: str, refs: RunRefs, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.root, self.refs, self.max_bytes = root, refs, max_bytes
        self.used: int | None = None     # bytes of block files, None before the first scan
        self._next_scan = 0.0

    def reserve(self, nbytes: int) -> None:
        """Make room for a block file of ``nbytes``: ``OverBudget`` when there is none."""
        if self.max_bytes <= 0:
            return
        if self.used is None or (self.used + nbytes > self.max_bytes and time.monotonic() >= self._next_scan):
            self._evict(nbytes)
        assert self.used is not None   # _evict scans the directory
        if self.used + nbytes > self.max_bytes:
            raise OverBudget(errno.ENOSPC, f"over the KV disk budget of {self.max_bytes} bytes "
                                           f"(--checkpoint-kv-max-bytes), every block in use by a run", self.root)
        self.used += nbytes

    def wrote(self, reserved: int, actual: int) -> None:
        if self.used is not None and self.max_bytes > 0:
            self.used += actual - reserved

    def _evict(self, nbytes: int) -> None:
        files = scan_blocks(self.root)
        self.used = sum(f.size for f in files)
        if self.used + nbytes <= self.max_bytes:
            return
        try:
            referenced = referenced_by_refs(self.refs)
        except CheckpointError:
            referenced = None   # a reference file that cannot be read: evict nothing (as collection)
        if referenced is not None:
            _, freed = evict_lru(files, referenced, self.used + nbytes - int(self.max_bytes * _LOW_WATER))
            self.used -= freed
        if self.used + nbytes > self.max_bytes:
            self._next_scan = time.monotonic() + _RESCAN_S


def referenced_by_refs(refs: RunRefs) -> dict[str, set[str]]:
    """Every block some unfinished run's reference file names, by fingerprint."""
    out: dict[str, set[str]] = {}
    for ref in refs.read_all().values():
        for fp, hashes in ref.blocks.items():
            out.setdefault(fp, set()).update(hashes)
    return out


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_kv_budget(p: Any) -> None:
    """``--checkpoint-kv-max-bytes`` on a parser (flowrt run / resume / runs and flowrt serve)."""
    p.add_argument("--checkpoint-kv-max-bytes", type=_size, default=None, metavar="BYTES",
                   help="disk budget of the KV blocks (20G, 512M, bytes; default 20G; 0: none): the least recently "
                        "used blocks no unfinished run refers to are evicted to stay within it")
