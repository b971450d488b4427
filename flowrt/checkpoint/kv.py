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
* Saving is an optimisation: a block that cannot be written (a full or read-only file system, the disk
  budget) is skipped with one warning, counted in the run's ``kv_blocks_save_failed``, and the run goes on.
* Blocks are written off the event loop (flowrt.checkpoint.kv_writer): a save copies its new blocks out of
  the engine and queues them; a step waits at most ``max_wait_s`` for room in the queue (the time is the
  run's ``kv_save_blocked_s``). A checkpoint saved at a step's end names the blocks still queued
  (``state["kv"]["queued"]``): after a crash before they were written, a resume reports them as ``unsaved``
  in ``kv_blocks_rejected`` and computes them. The run's last checkpoint (it waits, stops, fails) is saved
  once its blocks are on disk, naming only those that are (``durable=True``).
* A disk budget (``max_bytes``, flowrt.checkpoint.kv_budget) evicts the least recently used blocks that no
  unfinished run refers to.
* A checkpoint's state refers to its blocks (``state["kv"]``: fingerprint, each live thread's chain of
  hashes, and the run's owner token), and so does the run's reference file in the directory
  (flowrt.checkpoint.kv_refs), which every database sharing the directory sees. ``collect`` deletes the
  store's files that no unfinished run of any of them refers to, sparing files younger than ``grace_s``
  (flowrt.checkpoint.kv_collect); a directory holding other files is refused (kv_layout).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterable

from .kv_blocks import HEADER_MAX, KVBlockStore, Rejection
from .kv_budget import DEFAULT_MAX_BYTES, KVBudget
from .kv_collect import collect_blocks
from .kv_refs import RunRef, RunRefs, blocks_of, owner_of
from .kv_writer import MAX_WAIT_S, QUEUE_BYTES, KVWriter, Submitted
from .store import CheckpointError, UnknownRunError

__all__ = ["KVBlockStore", "KVCheckpoint", "KVLoad", "KVSaved", "kv_dir_for", "owner_of", "DEFAULT_MAX_BYTES"]

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
    """What a save wrote: the reference the checkpoint state keeps, how many blocks could not be written, and
    how long the caller waited (copying blocks out of the engine, room in the queue, the reference file, and
    for a durable save the writes)."""

    ref: dict[str, Any]
    failed: int = 0   # distinct blocks
    blocked_s: float = 0.0


class KVCheckpoint:
    """KV checkpoints of a runtime's runs: one block store, bound to the engine on a run's first use."""

    def __init__(self, root: str, *, grace_s: float = 600.0, max_bytes: int = DEFAULT_MAX_BYTES,
                 queue_bytes: int = QUEUE_BYTES, max_wait_s: float = MAX_WAIT_S) -> None:
        self.blocks = KVBlockStore(root)
        self.refs = RunRefs(root)
        self.budget = KVBudget(root, self.refs, max_bytes)
        self.writer = KVWriter(self.blocks, self._store, self._write_failed, queue_bytes=queue_bytes,
                               max_wait_s=max_wait_s)
        self.grace_s = grace_s
        self._engine: Any = None
        self.fingerprint = ""
        self.block_bytes = 0
        self._warned: set[str] = set()   # reasons a write failed, each warned about once
        self._queued: dict[str, set[tuple[str, bytes]]] = {}   # by run: blocks queued since its last settle
        self._lock = threading.Lock()

    def bind(self, engine: Any) -> None:
        if self._engine is engine:
            return
        from ..engine.interfaces import KVTransfer

        if not isinstance(engine, KVTransfer):
            raise CheckpointError(f"checkpoint_kv needs an engine that exports its KV blocks (AsyncLLM); "
                                  f"{type(engine).__name__} does not")
        self._engine, self.fingerprint, self.block_bytes = engine, engine.kv_fingerprint(), engine.kv_block_bytes()

    @property
    def bound(self) -> bool:
        return self._engine is not None

    def save(self, threads: Iterable[list[int]], *, owner: str, run_id: str,
             kept: dict[str, Any] | None = None, durable: bool = False) -> KVSaved:
        """Copy the new full blocks of each thread out of the engine, write the run's reference file (these
        blocks and ``kept``'s, the state its database holds until this checkpoint is saved: so neither
        collection nor the budget takes them while they are written), then queue the blocks for writing.
        ``durable``: wait until they are on disk, and name only those that are."""
        t0 = time.perf_counter()
        fp, deadline = self.fingerprint, self.writer.deadline()
        exported = [self._engine.kv_export(ids, skip=lambda h: self._kept(fp, h)) for ids in threads]
        named = {"fingerprint": fp, "threads": [[h.hex() for h, _ in blocks] for blocks in exported]}
        try:
            self.refs.write(RunRef(owner, run_id, blocks_of(named, kept)))
        except OSError as e:
            self._warn(e, "write the run's KV reference file")
        chains, failed = [], set()
        for blocks in exported:
            chain, broken = [], False
            for h, data in blocks:
                if not broken and (data is None or (h not in failed and self._submit(run_id, h, data, deadline))):
                    chain.append(h.hex())
                    continue
                broken = True   # the chain's later blocks are unusable without this one
                if data is not None:
                    failed.add(h)
            if chain:
                chains.append(chain)
        ref = {"fingerprint": fp, "threads": chains, "owner": owner, "run": run_id}
        written_failed = 0
        if durable:
            written_failed = self.settle(run_id)
            ref["threads"] = self._durable(chains)
        else:
            queued = [x for x in dict.fromkeys(x for c in chains for x in c)
                      if self.writer.pending((fp, bytes.fromhex(x)))]
            if queued:
                ref["queued"] = queued
        return KVSaved(ref, len(failed) + written_failed, time.perf_counter() - t0)

    def _submit(self, run_id: str, h: bytes, data: bytes, deadline: float) -> bool:
        key = (self.fingerprint, h)
        got = self.writer.submit(key, data, deadline)
        if got is Submitted.QUEUED:
            with self._lock:
                self._queued.setdefault(run_id, set()).add(key)
        return got is not Submitted.DROPPED

    def settle(self, run_id: str) -> int:
        """Wait until the blocks queued so far are on disk; how many of those the run queued could not be
        written (each counted once: the run's ``kv_blocks_save_failed``)."""
        self.writer.flush()
        with self._lock:
            keys = self._queued.pop(run_id, set())
        return len(keys & self.writer.failed)

    def _kept(self, fp: str, h: bytes) -> bool:
        """The block need not be copied out of the engine: queued already, or on disk (renewed there)."""
        return self.writer.pending((fp, h)) or self.blocks.fresh(fp, h)

    def _durable(self, chains: list[list[str]]) -> list[list[str]]:
        """The chains up to their first block the writer could not write."""
        out = []
        for chain in chains:
            for i, x in enumerate(chain):
                if (self.fingerprint, bytes.fromhex(x)) in self.writer.failed:
                    chain = chain[:i]
                    break
            if chain:
                out.append(chain)
        return out

    def _store(self, key: tuple[str, bytes], data: bytes) -> None:
        """Write one block (the writer thread), within the disk budget."""
        estimate = len(data) + HEADER_MAX
        self.budget.reserve(estimate)
        try:
            self.budget.wrote(estimate, self.blocks.write(*key, data))
        except BaseException:
            self.budget.wrote(estimate, 0)
            raise

    def _write_failed(self, e: OSError) -> None:
        self._warn(e, "write KV blocks")

    def close(self) -> None:
        """Write what is queued and stop the writer thread."""
        self.writer.close()

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
        queued = set(ref.get("queued", ()))   # not yet written when the checkpoint was saved
        blocks = []   # every chain's usable blocks in chain order, imported at once (the engine's budget)
        for chain in ref.get("threads", []):
            for x in chain:
                if x in seen:
                    continue   # loaded with an earlier chain (a shared prefix)
                h = bytes.fromhex(x)
                data, why = self.blocks.read(self.fingerprint, h, self.block_bytes)
                if data is None:
                    assert why is not None   # read gives a reason with no data
                    why = Rejection.UNSAVED if why is Rejection.MISSING and x in queued else why
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
            by_run = self.referenced(store)
        except CheckpointError as e:
            logger.warning("%s; KV blocks are not collected", e)
            return 0
        return collect_blocks(self.blocks.root, merged(by_run.values()), self.grace_s)

    def referenced(self, store: Any, *, release: bool = True) -> dict[str, dict[str, set[str]]]:
        """The blocks each unfinished run refers to (its reference file, its state in ``store``), by run id
        and fingerprint; with ``release`` the reference files of ``store``'s finished runs are removed.
        ``CheckpointError`` when a reference file cannot be read."""
        refs = self.refs.read_all()
        by_run: dict[str, dict[str, set[str]]] = {}
        with_refs = {r.run_id for r in refs.values()}
        for rec in store.list_runs(limit=2**31 - 1):
            if rec.status == "done" and rec.run_id not in with_refs:
                continue
            try:
                kv = (store.get_run(rec.run_id).state or {}).get("kv")
            except UnknownRunError:
                continue   # deleted meanwhile
            if rec.status != "done":
                _merge(by_run.setdefault(rec.run_id, {}), blocks_of(kv))
                continue
            owner = owner_of(kv, rec.run_id)
            if owner in refs and refs[owner].run_id == rec.run_id:
                if release:
                    self.release(owner)
                del refs[owner]
        for ref in refs.values():
            _merge(by_run.setdefault(ref.run_id, {}), ref.blocks)
        return by_run


def merged(parts: Iterable[dict[str, set[str]]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for p in parts:
        _merge(out, p)
    return out


def _merge(into: dict[str, set[str]], more: dict[str, set[str]]) -> None:
    for fp, hashes in more.items():
        into.setdefault(fp, set()).update(hashes)
