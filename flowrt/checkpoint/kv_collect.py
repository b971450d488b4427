"""Collection: delete the block files no run refers to, and only files this store wrote.

A file is deleted only when its name is of the layout (flowrt.checkpoint.kv_layout), it is a regular file
(not a symlink), older than the grace period, and starts with the store's header for the fingerprint and
hash its path names (a temporary file: with the store's magic, or empty). Anything else is left alone.

Under concurrency (other processes and databases saving into the directory while it runs), a block is not
deleted from under a run that starts using it: a save renews the mtime of each block it keeps (failing if
the block is gone, and then writing it again) before it publishes its references. Collection renames a
candidate to a private ``.del`` name, then looks at its mtime again: renewed meanwhile, it is put back;
else deleted. So a block a save kept is either seen young (kept) or was gone before the save renewed it
(written again by the save). The grace period covers the time from a save's renewal to its published
references (milliseconds; 10 minutes by default).

Eviction (the disk budget, flowrt.checkpoint.kv_budget) deletes the least recently used unreferenced blocks
whatever their age, with the same rename-and-look-again: a block whose mtime changed since the scan (a save
renewed it) is put back.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import stat
import time
from dataclasses import dataclass
from typing import Iterator

from .kv_blocks import HEADER_MAX, MAGIC, is_own, parse_header
from .kv_files import read_regular
from .kv_layout import BLOCK_FILE, HEX128, REF_FILE, REFS_DIR

__all__ = ["collect_blocks", "BlockFile", "scan_blocks", "evict_lru"]

_SHARD = re.compile(r"[0-9a-f]{2}")
_REF_START = b'{"run": '


def collect_blocks(root: str, referenced: dict[str, set[str]], grace_s: float) -> int:
    """Delete the store's files under ``root`` that ``referenced`` (hashes by fingerprint) does not name
    and that are older than ``grace_s``; returns how many blocks were deleted."""
    removed = 0
    for fp in _subdirs(root, HEX128):
        keep = referenced.get(fp, set())
        for shard in _subdirs(os.path.join(root, fp), _SHARD):
            folder = os.path.join(root, fp, shard)
            for name in _names(folder):
                m = BLOCK_FILE.fullmatch(name)
                if m is None or m["hash"][:2] != shard:
                    continue
                with contextlib.suppress(OSError):
                    removed += _visit(folder, name, fp, m["hash"], m["kind"], keep, grace_s)
    refs = os.path.join(root, REFS_DIR)
    for name in _names(refs):
        m = REF_FILE.fullmatch(name)
        if m is not None and m["kind"] == "tmp":
            with contextlib.suppress(OSError):
                _remove_temp(os.path.join(refs, name), _REF_START, grace_s)
    return removed


def _visit(folder: str, name: str, fp: str, hexhash: str, kind: str | None, keep: set[str],
           grace_s: float) -> int:
    """One file of the layout: a temporary file, a block or a block being collected (``.del``)."""
    path, block = os.path.join(folder, name), os.path.join(folder, hexhash + ".kv")
    if kind == "tmp":
        _remove_temp(path, MAGIC, grace_s)
        return 0
    if hexhash in keep:
        if kind == "del" and _own_block(path, fp, hexhash):   # a collection stopped half-way: put it back
            if os.path.lexists(block):
                os.unlink(path)
            else:
                os.replace(path, block)
        return 0
    if not _old(path, grace_s) or not _own_block(path, fp, hexhash):
        return 0
    return _remove_block(path, block, kind == "del", grace_s)


def _remove_block(path: str, block: str, tombstone: bool, grace_s: float) -> int:
    if not tombstone:
        dead = f"{block}.{secrets.token_hex(8)}.del"
        os.rename(path, dead)
        if not _old(dead, grace_s):   # a save renewed it between the look and the rename: still in use
            os.replace(dead, block)
            return 0
        path = dead
    os.unlink(path)
    return 1


def _remove_temp(path: str, start: bytes, grace_s: float) -> None:
    """A temporary file its writer left (it crashed): old, and empty or beginning as the store's files do."""
    if _old(path, grace_s):
        head = read_regular(path, len(start), head=True)
        if start.startswith(head):
            os.unlink(path)


def _own_block(path: str, fp: str, hexhash: str) -> bool:
    return is_own(parse_header(read_regular(path, HEADER_MAX, head=True)), fp, hexhash)


def _old(path: str, grace_s: float) -> bool:
    st = os.lstat(path)
    return stat.S_ISREG(st.st_mode) and time.time() - st.st_mtime >= grace_s


def _names(folder: str) -> list[str]:
    try:
        return os.listdir(folder)
    except OSError:
        return []


def _subdirs(folder: str, pattern: re.Pattern[str]) -> Iterator[str]:
    try:
        with os.scandir(folder) as it:
            entries = [e for e in it if pattern.fullmatch(e.name) and e.is_dir(follow_symlinks=False)]
    except OSError:
        return
    for e in entries:
        yield e.name


@dataclass
class BlockFile:
    """A block file of the layout, as a scan found it."""

    fingerprint: str
    hexhash: str
    path: str
    size: int
    mtime: float


def scan_blocks(root: str) -> list[BlockFile]:
    """The block files under ``root`` (regular files of the layout's names; not temporary or collected ones)."""
    out = []
    for fp in _subdirs(root, HEX128):
        for shard in _subdirs(os.path.join(root, fp), _SHARD):
            folder = os.path.join(root, fp, shard)
            for name in _names(folder):
                m = BLOCK_FILE.fullmatch(name)
                if m is None or m["kind"] or m["hash"][:2] != shard:
                    continue
                path = os.path.join(folder, name)
                try:
                    st = os.lstat(path)
                except OSError:
                    continue
                if stat.S_ISREG(st.st_mode):
                    out.append(BlockFile(fp, m["hash"], path, st.st_size, st.st_mtime))
    return out


def evict_lru(files: list[BlockFile], referenced: dict[str, set[str]], need: int) -> tuple[int, int]:
    """Delete the least recently used of ``files`` that ``referenced`` does not name (and that are the
    store's), oldest first, until ``need`` bytes are freed; returns (blocks, bytes) deleted."""
    blocks = freed = 0
    for f in sorted(files, key=lambda f: f.mtime):
        if freed >= need:
            break
        if f.hexhash in referenced.get(f.fingerprint, ()):
            continue
        with contextlib.suppress(OSError):
            if not _own_block(f.path, f.fingerprint, f.hexhash):
                continue
            dead = f"{f.path}.{secrets.token_hex(8)}.del"
            os.rename(f.path, dead)
            if os.lstat(dead).st_mtime != f.mtime:   # a save renewed it since the scan: in use
                os.replace(dead, f.path)
                continue
            os.unlink(dead)
            blocks, freed = blocks + 1, freed + f.size
    return blocks, freed
