"""``flowrt runs gc --checkpoint DB [--checkpoint-kv DIR] [--dry-run] [--json]``: what a KV block directory
keeps (blocks, bytes, the runs referring to them) and pruning it: the blocks no unfinished run refers to
(older than ``--grace``), then, over the disk budget (``--checkpoint-kv-max-bytes``), the least recently
used unreferenced ones of any age. Also the ``--checkpoint-kv-max-bytes`` option of run, resume, serve."""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["cmd_gc", "KVUsage", "RunUsage"]

EXIT_OK, EXIT_USAGE = 0, 2


@dataclass
class RunUsage:
    run_id: str
    status: str
    blocks: int
    bytes: int


@dataclass
class KVUsage:
    """A KV directory's blocks, who refers to them, and what pruning deletes (or would: ``dry_run``)."""

    directory: str
    blocks: int
    bytes: int
    max_bytes: int
    referenced_blocks: int
    referenced_bytes: int
    runs: list[RunUsage] = field(default_factory=list)
    pruned_blocks: int = 0
    pruned_bytes: int = 0
    dry_run: bool = False


def _mib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def usage_and_prune(kvc: Any, store: Any, *, dry_run: bool) -> KVUsage:
    """Collect (unreferenced blocks older than the grace period), then evict down to the budget."""
    import time

    from ..checkpoint.kv import merged
    from ..checkpoint.kv_collect import collect_blocks, evict_lru, scan_blocks

    by_run = kvc.referenced(store, release=not dry_run)
    referenced = merged(by_run.values())
    files = scan_blocks(kvc.blocks.root)
    sizes = {(f.fingerprint, f.hexhash): f.size for f in files}
    status = {r.run_id: r.status for r in store.list_runs(limit=2**31 - 1)}
    runs = []
    for run_id, blocks in sorted(by_run.items()):
        keys = [(fp, h) for fp, hs in blocks.items() for h in hs if (fp, h) in sizes]
        runs.append(RunUsage(run_id, status.get(run_id, "(another database)"), len(keys),
                             sum(sizes[k] for k in keys)))
    kept = {f.path for f in files if f.hexhash in referenced.get(f.fingerprint, ())}
    out = KVUsage(kvc.blocks.root, len(files), sum(f.size for f in files), kvc.budget.max_bytes, len(kept),
                  sum(f.size for f in files if f.path in kept), runs, dry_run=dry_run)
    now = time.time()
    old = {f.path for f in files if f.path not in kept and now - f.mtime >= kvc.grace_s}
    if dry_run:
        out.pruned_blocks, out.pruned_bytes = len(old), sum(f.size for f in files if f.path in old)
        left = [f for f in files if f.path not in old]
    else:
        collect_blocks(kvc.blocks.root, referenced, kvc.grace_s)
        left = scan_blocks(kvc.blocks.root)
        out.pruned_blocks, out.pruned_bytes = len(files) - len(left), out.bytes - sum(f.size for f in left)
    over = sum(f.size for f in left) - kvc.budget.max_bytes
    if kvc.budget.max_bytes > 0 and over > 0:
        if dry_run:
            for f in sorted((f for f in left if f.path not in kept), key=lambda f: f.mtime):
                if over <= 0:
                    break
                out.pruned_blocks, out.pruned_bytes, over = out.pruned_blocks + 1, out.pruned_bytes + f.size, \
                    over - f.size
        else:
            n, freed = evict_lru(left, referenced, over)
            out.pruned_blocks, out.pruned_bytes = out.pruned_blocks + n, out.pruned_bytes + freed
    return out


def cmd_gc(args: argparse.Namespace) -> int:
    from ..checkpoint import CheckpointError, open_store
    from ..checkpoint.kv import DEFAULT_MAX_BYTES, KVCheckpoint, kv_dir_for

    try:
        store = open_store(args.checkpoint, readonly=True, create=False)   # the database is only read
        root = kv_dir_for(getattr(store, "path", args.checkpoint), args.checkpoint_kv or True)
        if not os.path.isdir(root):
            print(f"no KV blocks in {root}", file=sys.stderr)
            return EXIT_OK
        kvc = KVCheckpoint(root, grace_s=args.grace, max_bytes=DEFAULT_MAX_BYTES if args.checkpoint_kv_max_bytes
                           is None else args.checkpoint_kv_max_bytes)
        u = usage_and_prune(kvc, store, dry_run=args.dry_run)
    except CheckpointError as e:
        print(f"flowrt runs gc: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    if args.json:
        print(json.dumps(asdict(u), indent=2))
        return EXIT_OK
    budget = _mib(u.max_bytes) if u.max_bytes > 0 else "none"
    print(f"KV blocks in {u.directory}: {u.blocks} blocks, {_mib(u.bytes)} (budget {budget})")
    print(f"kept for {len(u.runs)} unfinished run(s): {u.referenced_blocks} blocks, {_mib(u.referenced_bytes)}")
    for r in u.runs:
        print(f"  {r.run_id}  {r.status:<11}  {r.blocks} blocks  {_mib(r.bytes)}")
    verb = "would prune" if u.dry_run else "pruned"
    print(f"{verb}: {u.pruned_blocks} blocks, {_mib(u.pruned_bytes)}")
    return EXIT_OK
