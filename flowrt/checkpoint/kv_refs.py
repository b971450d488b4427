"""Reference files: which blocks each unfinished run needs, kept in the KV directory itself
(``DIR/runs/<owner>.json``), so that every database sharing the directory sees what the others' runs need.

A run's checkpoint state names its owner (a random 128-bit token, kept by its resumes; a fork gets its own).
At every KV save the holder writes the blocks of this checkpoint and of the last one its database holds
(a crash between the two writes leaves the database's state covered), before it queues the blocks for
writing (flowrt.checkpoint.kv_writer: neither collection nor the disk budget takes them meanwhile) and before
the database's save; a run
that finishes removes its file. A database's collection also removes the files of its own finished runs
(a run finished without ``--checkpoint-kv``): a file whose owner and run a finished run of that database
names. A reference file that cannot be read stops the collection (nothing is deleted).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
from dataclasses import dataclass, field
from typing import Any

from .kv_files import read_regular, real_dir, write_atomic
from .kv_layout import HEX128, REF_FILE, REFS_DIR
from .store import CheckpointError

__all__ = ["RunRef", "RunRefs", "new_owner", "owner_of", "blocks_of"]

_REF_MAX = 256 << 20   # a million blocks' hashes


def new_owner() -> str:
    return secrets.token_hex(16)


def owner_of(kv: dict[str, Any] | None, run_id: str) -> str | None:
    """The owner a checkpoint state's ``kv`` names, when it is this run's (a fork's state is its source's)."""
    owner = (kv or {}).get("owner")
    if (kv or {}).get("run") != run_id or not isinstance(owner, str) or not HEX128.fullmatch(owner):
        return None
    return owner


def blocks_of(*kvs: dict[str, Any] | None) -> dict[str, set[str]]:
    """The block hashes that checkpoint states' ``kv`` refer to, by fingerprint."""
    out: dict[str, set[str]] = {}
    for kv in kvs:
        if kv and kv.get("threads"):
            keep = out.setdefault(kv.get("fingerprint", ""), set())
            for chain in kv["threads"]:
                keep.update(chain)
    return out


@dataclass
class RunRef:
    owner: str
    run_id: str
    blocks: dict[str, set[str]] = field(default_factory=dict)


class RunRefs:
    """The reference files of one KV directory."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.dir = os.path.join(root, REFS_DIR)

    def write(self, ref: RunRef) -> None:
        """``OSError`` when the file system refuses (full, read-only)."""
        real_dir(self.root, REFS_DIR)
        body = {"run": ref.run_id, "blocks": {fp: sorted(hs) for fp, hs in ref.blocks.items()}}
        write_atomic(self.dir, ref.owner + ".json", (json.dumps(body).encode(),))

    def remove(self, owner: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(self.dir, owner + ".json"))

    def read_all(self) -> dict[str, RunRef]:
        """Every run's references, by owner; ``CheckpointError`` naming a file that cannot be read."""
        try:
            names = os.listdir(self.dir)
        except FileNotFoundError:
            return {}
        except OSError as e:
            raise CheckpointError(f"cannot list the KV reference files in {self.dir}: {e}") from None
        out = {}
        for name in names:
            m = REF_FILE.fullmatch(name)
            if m is None or m["kind"]:
                continue
            path = os.path.join(self.dir, name)
            try:
                body = json.loads(read_regular(path, _REF_MAX))
                ref = RunRef(m["owner"], str(body["run"]), {str(fp): set(hs) for fp, hs in body["blocks"].items()})
            except FileNotFoundError:
                continue   # its run finished meanwhile
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
                raise CheckpointError(f"KV reference file {path} cannot be read ({e}); remove it if no run "
                                      f"needs its blocks") from None
            out[ref.owner] = ref
        return out
