"""What in a KV directory is flowrt's: the names of its layout, and the check that a directory given for KV
blocks holds nothing else.

Layout: ``DIR/<fingerprint>/<hash[:2]>/<hash>.kv`` (blocks; ``.<random>.tmp`` while written, ``.<random>.del``
while collected) and ``DIR/runs/<owner>.json`` (each unfinished run's references, flowrt.checkpoint.kv_refs).
Fingerprints, hashes and owners are 128-bit hex. Collection deletes nothing outside these names.

A directory that holds anything else is refused rather than shared: KV blocks are a cache that flowrt deletes
from, and a user's files beside them are one mistake (a path typed wrong, a cleanup of "the cache") from
being lost with it. Dotfiles and ``lost+found`` (file-system and desktop bookkeeping) are tolerated; the
collection never looks at them.
"""

from __future__ import annotations

import os
import re

__all__ = ["HEX128", "REFS_DIR", "BLOCK_FILE", "REF_FILE", "foreign_entries"]

HEX128 = re.compile(r"[0-9a-f]{32}")
REFS_DIR = "runs"
# a block, a block being written (.tmp) or being collected (.del)
BLOCK_FILE = re.compile(r"(?P<hash>[0-9a-f]{32})\.kv(?:\.[0-9a-f]{16}\.(?P<kind>tmp|del))?")
REF_FILE = re.compile(r"(?P<owner>[0-9a-f]{32})\.json(?:\.[0-9a-f]{16}\.(?P<kind>tmp))?")
_TOLERATED = ("lost+found",)


def foreign_entries(root: str) -> list[str]:
    """The entries of ``root`` that are not flowrt's layout (sorted): a directory given for KV blocks must
    have none."""
    out = []
    with os.scandir(root) as it:
        for e in it:
            if e.name.startswith(".") or e.name in _TOLERATED:
                continue
            ours = (HEX128.fullmatch(e.name) or e.name == REFS_DIR) and e.is_dir(follow_symlinks=False)
            if not ours:
                out.append(e.name + ("/" if e.is_dir(follow_symlinks=False) else ""))
    return sorted(out)

