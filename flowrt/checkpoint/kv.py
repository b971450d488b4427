"""KV saved with checkpoints (``fr.Runtime(checkpoint=..., checkpoint_kv=True)``, ``--checkpoint-kv``): at
every checkpoint the full KV blocks of the run's live threads go to a directory beside the database, and a
resume in a fresh process loads them into the engine's prefix cache before any prefill, so it computes
what a warm resume computes (each thread's last partial block).

* Blocks are content-addressed: ``DIR/<model fingerprint>/<hash[:2]>/<hash>.kv``, the hash being the
  engine's prefix hash (the token ids of the whole prefix), so a prompt that a thousand runs share is
  stored once, and a block is written once however many checkpoints refer to it (flowrt.checkpoint.kv_blocks:
  files, checks; kv_files: reading and writing a shared directory safely).
* A block that is missing, not a regular file, of the wrong size, corrupt or of another model is not
  loaded: the engine computes it, as it would without KV checkpoints, and the next save replaces it.
* Saving is an optimisation: a block that cannot be written (a full or read-only file system) is skipped
  with one warning, counted in the run's ``kv_blocks_save_failed``, and the run goes on.
* A checkpoint's state refers to its blocks (``state["kv"]``: fingerprint, each live thread's chain of
  hashes, and the run's owner token), and so does the run's reference file in the directory
  (flowrt.checkpoint.kv_refs), which every database sharing the directory sees. ``collect`` deletes the
  store's files that no unfinished run of any of them refers to, sparing files younger than ``grace_s``
  (flowrt.checkpoint.kv_collect); a directory holding other files is refused (kv_layout).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any, Iterable

from .kv_blocks import KVBlockStore
from .kv_collect import collect_blocks
from .kv_refs import RunRef, RunRefs, blocks_of, owner_of
from .store import CheckpointError, UnknownRunError

__all__ = ["KVBlockStore", "KVCheckpoint", "KVLoad", "KVSaved", "kv_dir_for", "owner_of"]

logger = logging.getLogger("flowrt.checkpoint")


def kv_dir_for(spec: Any, kv: Any) -> str:
    """The block directory for ``checkpoint=spec, checkpoint_kv=kv``: a directory path as given, or for
    True ``<database file>.kv`` beside an SQLite file."""
    if isinstance(kv, (str, bytes, os.PathLike)):
        return os.fsdecode(kv)
    path = os.fsdecode(spec) if isinstance(spec, (str, bytes, os.PathLike)) else None
    if path is None or path == ":memory:" or "://" in path:
        raise CheckpointError("checkpoint_kv=True keeps KV blocks beside an SQLite database file; with "
                              f"{'an in-memory store' if path == ':memory:' else 'this store'} give it a directory "
                              "(--checkpoint-kv DIR; shared storage for several machines)")
    return path + ".kv"


@dataclass
class KVLoad:
    """What a resume loaded: blocks put into the prefix cache, and those not used (and why)."""

    loaded: int = 0
    rejected: dict[str, int] = field(default_factory=dict)


@dataclass
class KVSaved:
    """What a save wrote: the reference the checkpoint state keeps, and how many blocks could not be written."""

    ref: dict[str, Any]
    failed: int = 0   # distinct blocks


class KVCheckpoint:
    """KV checkpoints of a runtime's runs: one block store, bound to the engine on a run's first use."""

    def __init__(self, root: str, *, grace_s: float = 600.0) -> None:
        self.blocks = KVBlockStore(root)
        self.refs = RunRefs(root)
        self.grace_s = grace_s
        self._engine: Any = None
        self.fingerprint = ""
        self.block_bytes = 0
        self._warned: set[str] = set()   # reasons a write failed, each warned about once

    def bind(self, engine: Any) -> None:
        if self._engine is engine:
            return
        from ..engine.protocol import KVTransfer

        if not isinstance(engine, KVTransfer):
            raise CheckpointError(f"checkpoint_kv needs an engine that exports its KV blocks (AsyncLLM); "
                                  f"{type(engine).__name__} does not")
        self._engine, self.fingerprint, self.block_bytes = engine, engine.kv_fingerprint(), engine.kv_block_bytes()

    @property
    def bound(self) -> bool:
        return self._engine is not None

    def save(self, threads: Iterable[list[int]], *, owner: str, run_id: str,
             kept: dict[str, Any] | None = None) -> KVSaved:
        """Write the new full blocks of each thread, then the run's reference file (these blocks and
        ``kept``'s, the state its database holds until this checkpoint is saved)."""
        fp, chains, failed = self.fingerprint, [], set()
        for token_ids in threads:
            chain, broken = [], False
            for h, data in self._engine.kv_export(token_ids, skip=lambda h: self.blocks.fresh(fp, h)):
                if not broken and (data is None or (h not in failed and self._write(h, data))):
                    chain.append(h.hex())
                    continue
                broken = True   # the chain's later blocks are unusable without this one
                if data is not None:
                    failed.add(h)
            if chain:
                chains.append(chain)
        ref = {"fingerprint": fp, "threads": chains, "owner": owner, "run": run_id}
        try:
            self.refs.write(RunRef(owner, run_id, blocks_of(ref, kept)))
        except OSError as e:
            self._warn(e, "write the run's KV reference file")
        return KVSaved(ref, len(failed))

    def _write(self, h: bytes, data: bytes) -> bool:
        try:
            self.blocks.write(self.fingerprint, h, data)
            return True
        except OSError as e:
            self._warn(e, "write KV blocks")
            return False

    def _warn(self, e: OSError, action: str) -> None:
        """Once per reason (a full disk, a read-only file system): KV saving is an optimisation."""
        reason = e.strerror or str(e)
        if reason not in self._warned:
            self._warned.add(reason)
            logger.warning("KV checkpoints in %s: cannot %s (%s); the run goes on (kv_blocks_save_failed in its "
                           "stats counts the blocks not saved)", self.blocks.root, action, reason)

    def load(self, ref: dict[str, Any] | None) -> KVLoad:
        """Load a checkpoint's blocks into the prefix cache, each chain up to its first unusable block."""
        out = KVLoad()
        if not ref or not ref.get("threads") or not self.bound:
            return out
        if ref.get("fingerprint") != self.fingerprint:
            out.rejected["foreign"] = sum(len(c) for c in ref.get("threads", []))
            return out
        seen: set[str] = set()
        blocks = []   # every chain's usable blocks in chain order, imported at once (the engine's budget)
        for chain in ref.get("threads", []):
            for x in chain:
                if x in seen:
                    continue   # loaded with an earlier chain (a shared prefix)
                h = bytes.fromhex(x)
                data, why = self.blocks.read(self.fingerprint, h, self.block_bytes)
                if data is None:
                    out.rejected[why.value] = out.rejected.get(why.value, 0) + 1
                    break
                seen.add(x)
                blocks.append((h, data))
        out.loaded = self._engine.kv_import(blocks)
        return out

    def release(self, owner: str) -> None:
        """A finished run's references go (its blocks are collected unless another run refers to them)."""
        try:
            self.refs.remove(owner)
        except OSError as e:
            self._warn(e, "remove the run's KV reference file")

    def collect(self, store: Any) -> int:
        """Delete the blocks that no unfinished run refers to: of ``store`` (its checkpoint states) or of
        any database sharing the directory (the reference files). The reference files of ``store``'s
        finished runs go first (a run that finished without KV checkpoints left its own)."""
        try:
            refs = self.refs.read_all()
        except CheckpointError as e:
            logger.warning("%s; KV blocks are not collected", e)
            return 0
        referenced: dict[str, set[str]] = {}
        with_refs = {r.run_id for r in refs.values()}
        for rec in store.list_runs(limit=2**31 - 1):
            if rec.status == "done" and rec.run_id not in with_refs:
                continue
            try:
                kv = (store.get_run(rec.run_id).state or {}).get("kv")
            except UnknownRunError:
                continue   # deleted meanwhile
            if rec.status != "done":
                _merge(referenced, blocks_of(kv))
                continue
            owner = owner_of(kv, rec.run_id)
            if owner in refs and refs[owner].run_id == rec.run_id:
                self.release(owner)
                del refs[owner]
        for ref in refs.values():
            _merge(referenced, ref.blocks)
        return collect_blocks(self.blocks.root, referenced, self.grace_s)


def _merge(into: dict[str, set[str]], more: dict[str, set[str]]) -> None:
    for fp, hashes in more.items():
        into.setdefault(fp, set()).update(hashes)
