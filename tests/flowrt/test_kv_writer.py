"""Issue 34 item 2: KV blocks are written off the event loop by a writer thread behind a bounded queue (a save
never waits on a slow disk longer than its bound), a run's last checkpoint names only blocks on disk, a
checkpoint saved with blocks still queued says so (a resume after a crash reports them as ``unsaved``), a
disk budget evicts the least recently used unreferenced blocks, and ``flowrt runs gc`` shows and prunes.

Fast tests drive ``KVCheckpoint`` with a stand-in engine (blocks of 4 tokens, 64 bytes); the kill -9 test
runs the CLI on stories260K."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from flowrt.checkpoint import kv_blocks, open_store
from flowrt.checkpoint.kv import KVCheckpoint
from flowrt.checkpoint.kv_budget import parse_size
from flowrt.checkpoint.kv_collect import scan_blocks
from support import ROOT, STORIES, flowrt_cli

FP = "f" * 32
SIZE = 64


class FakeEngine:
    """``KVTransfer`` without a model: full blocks of 4 tokens, each 64 bytes derived from its hash."""

    def kv_fingerprint(self) -> str:
        return FP

    def kv_block_bytes(self) -> int:
        return SIZE

    def kv_export(self, token_ids, skip=None):
        out, parent = [], b""
        for i in range(len(token_ids) // 4):
            h = hashlib.blake2b(parent + bytes(token_ids[4 * i:4 * i + 4]), digest_size=16).digest()
            out.append((h, None) if skip is not None and skip(h) else (h, (h * 4)[:SIZE]))
            parent = h
        return out

    def kv_import(self, blocks) -> int:
        return len(list(blocks))


def kv_checkpoint(root, **kw) -> KVCheckpoint:
    kvc = KVCheckpoint(str(root), grace_s=0.0, **kw)
    kvc.bind(FakeEngine())
    return kvc


def thread(seed: int, blocks: int) -> list[int]:
    return [(seed * 31 + i) % 251 for i in range(4 * blocks)]


class SlowDisk:
    """Block writes that wait until ``go`` is set (a disk that does not keep up)."""

    def __init__(self, monkeypatch) -> None:
        self.go, self.started = threading.Event(), threading.Event()
        real = kv_blocks.KVBlockStore.write

        def write(store, fp, h, data):
            self.started.set()
            assert self.go.wait(30)
            return real(store, fp, h, data)

        monkeypatch.setattr(kv_blocks.KVBlockStore, "write", write)


def block_count(root) -> int:
    return len(scan_blocks(str(root)))


# ------------------------------------------------------------------------ the writer thread
def test_a_save_waits_for_a_slow_disk_at_most_its_bound(tmp_path, monkeypatch):
    """Writes stuck on the disk: the save returns within max_wait_s, the blocks that found no room in the queue
    are left unsaved (and counted), the ones queued are named as queued, and are on disk once written. Before
    the writer, the save waited for every write on the caller."""
    disk = SlowDisk(monkeypatch)
    kvc = kv_checkpoint(tmp_path / "kv", queue_bytes=3 * SIZE, max_wait_s=0.2)
    t0 = time.perf_counter()
    saved = kvc.save([thread(1, 8)], owner="0" * 32, run_id="r")
    took = time.perf_counter() - t0
    assert took < 1.5 and saved.blocked_s == pytest.approx(took, abs=0.05)
    assert disk.started.is_set()
    chain = saved.ref["threads"][0]
    assert len(chain) == 4 and saved.failed == 4   # one being written + three queued; the chain stops there
    assert saved.ref["queued"] == chain
    disk.go.set()
    kvc.writer.flush()
    assert block_count(tmp_path / "kv") == len(chain)
    again = kvc.save([thread(1, 8)], owner="0" * 32, run_id="r")   # room now: the rest is queued
    kvc.writer.flush()
    assert len(again.ref["threads"][0]) == 8 and block_count(tmp_path / "kv") == 8


def test_a_durable_save_names_only_blocks_on_disk(tmp_path, monkeypatch):
    """The run's last checkpoint (durable): it waits for the writes, and a block the disk refused cuts its
    chain there (counted), the earlier blocks kept."""
    kvc = kv_checkpoint(tmp_path / "kv")
    real, calls = kv_blocks.KVBlockStore.write, []

    def third_fails(store, fp, h, data):
        calls.append(h)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        return real(store, fp, h, data)

    monkeypatch.setattr(kv_blocks.KVBlockStore, "write", third_fails)
    saved = kvc.save([thread(1, 5)], owner="0" * 32, run_id="r", durable=True)
    assert saved.ref["threads"] == [[h.hex() for h in calls[:2]]] and saved.failed == 1
    assert "queued" not in saved.ref and block_count(tmp_path / "kv") == 4


def test_blocks_queued_when_the_process_died_are_reported_unsaved(tmp_path, monkeypatch):
    """A checkpoint saved while its blocks were queued; the process dies before they are written. A resume (a
    fresh store) loads the chain up to the first such block and reports it as unsaved, not as missing."""
    disk = SlowDisk(monkeypatch)
    kvc = kv_checkpoint(tmp_path / "kv")
    first = kvc.save([thread(1, 2)], owner="0" * 32, run_id="r")
    disk.go.set()
    kvc.writer.flush()
    disk.go.clear()
    ref = kvc.save([thread(1, 4), thread(2, 2)], owner="0" * 32, run_id="r").ref   # 4 new blocks, stuck
    assert first.ref["threads"][0] == ref["threads"][0][:2] and len(ref["queued"]) == 4
    monkeypatch.undo()
    fresh = kv_checkpoint(tmp_path / "kv")   # another process: the queue went with the first
    got = fresh.load(ref)
    assert got.loaded == 2 and got.rejected == {"unsaved": 2}
    disk.go.set()


# ------------------------------------------------------------------------ the disk budget
def test_the_budget_evicts_the_least_recently_used_unreferenced_blocks(tmp_path):
    """Room for 6 block files. A finished run's 3 blocks (unreferenced) and a waiting run's 3; a new run's 3
    blocks evict the finished run's oldest first, never the waiting run's; when only referenced blocks are
    left, a block that does not fit is not written and is counted."""
    root = tmp_path / "kv"
    probe = kv_checkpoint(tmp_path / "probe", queue_bytes=0)
    probe.save([thread(9, 1)], owner="9" * 32, run_id="probe")
    file = scan_blocks(str(tmp_path / "probe"))[0].size
    # six files fit: a write reserves its content and the largest header (512 bytes) before it knows its size
    kvc = kv_checkpoint(root, max_bytes=6 * file + 512 - SIZE, queue_bytes=0)
    done = kvc.save([thread(1, 3)], owner="1" * 32, run_id="done").ref
    kvc.release("1" * 32)
    old = time.time() - 100
    for i, x in enumerate(done["threads"][0]):   # the finished run's blocks: used 100, 99, 98 s ago
        os.utime(kvc.blocks.path(FP, bytes.fromhex(x)), (old + i, old + i))
    waiting = kvc.save([thread(2, 3)], owner="2" * 32, run_id="waiting").ref
    for x in waiting["threads"][0]:
        os.utime(kvc.blocks.path(FP, bytes.fromhex(x)), (old - 50, old - 50))   # older still, but referenced
    new = kvc.save([thread(3, 3)], owner="3" * 32, run_id="new")
    assert new.failed == 0 and len(new.ref["threads"][0]) == 3

    def on_disk(ref) -> list[bool]:
        return [os.path.exists(kvc.blocks.path(FP, bytes.fromhex(x))) for x in ref["threads"][0]]

    assert on_disk(waiting) == [True] * 3 and on_disk(new.ref) == [True] * 3 and on_disk(done) == [False] * 3
    over = kvc.save([thread(4, 2)], owner="4" * 32, run_id="over")
    assert over.failed == 2 and over.ref["threads"] == [] and block_count(root) == 6


def test_the_budget_evicts_oldest_first(tmp_path):
    """Six unreferenced blocks used in a known order, a budget they fill: the next block evicts the k least
    recently used (down to 90% of the budget), whatever their place in the chain."""
    kvc = kv_checkpoint(tmp_path / "kv", queue_bytes=0, max_bytes=0)
    ref = kvc.save([thread(1, 6)], owner="1" * 32, run_id="done").ref
    kvc.release("1" * 32)
    rank = [0, 5, 4, 3, 2, 1]   # block i was used rank[i]-th
    for x, r in zip(ref["threads"][0], rank):
        t = time.time() - 100 + r
        os.utime(kvc.blocks.path(FP, bytes.fromhex(x)), (t, t))
    kvc.budget.max_bytes = sum(f.size for f in scan_blocks(str(tmp_path / "kv")))
    assert kvc.save([thread(2, 1)], owner="2" * 32, run_id="new").failed == 0
    gone = {i for i, x in enumerate(ref["threads"][0]) if not os.path.exists(kvc.blocks.path(FP, bytes.fromhex(x)))}
    assert 1 <= len(gone) < 6 and gone == {i for i in range(6) if rank[i] < len(gone)}


def test_sizes_parse():
    assert parse_size("20G") == 20 << 30 and parse_size("512MiB") == 512 << 20 and parse_size("1000") == 1000
    assert parse_size("1.5k") == 1536 and parse_size("0") == 0
    with pytest.raises(ValueError):
        parse_size("lots")


# ------------------------------------------------------------------------ flowrt runs gc
def _gc(capsys, *args: str) -> subprocess.CompletedProcess:
    from flowrt.cli.commands import main

    code = main(["runs", "gc", *args])
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out, err)


def test_runs_gc_shows_what_is_kept_and_prunes(tmp_path, capsys):
    """A database with no runs; the directory holds a waiting run's blocks (its reference file) and a finished
    run's. --dry-run shows both and deletes nothing; gc deletes the unreferenced ones; with a budget smaller
    than what is kept, the referenced blocks stay."""
    db = str(tmp_path / "runs.db")
    open_store(db).close()
    kvc = kv_checkpoint(db + ".kv", queue_bytes=0)
    kvc.save([thread(1, 3)], owner="1" * 32, run_id="gone")
    kvc.release("1" * 32)
    kvc.save([thread(2, 2)], owner="2" * 32, run_id="waiting")
    young = _gc(capsys, "--checkpoint", db, "--dry-run")   # the default grace spares young unreferenced blocks
    assert young.returncode == 0 and "would prune: 0 blocks" in young.stdout, young.stderr
    dry = _gc(capsys, "--checkpoint", db, "--dry-run", "--grace", "0", "--json")
    assert dry.returncode == 0, dry.stderr
    u = json.loads(dry.stdout)
    assert (u["blocks"], u["referenced_blocks"], u["pruned_blocks"], u["dry_run"]) == (5, 2, 3, True)
    assert u["runs"] == [{"run_id": "waiting", "status": "(another database)", "blocks": 2,
                          "bytes": 2 * u["bytes"] // 5}]
    assert block_count(db + ".kv") == 5
    text = _gc(capsys, "--checkpoint", db, "--grace", "0", "--checkpoint-kv-max-bytes", "100")
    assert text.returncode == 0, text.stderr
    assert "5 blocks" in text.stdout and "waiting" in text.stdout and "pruned: 3 blocks" in text.stdout
    assert block_count(db + ".kv") == 2


# ------------------------------------------------------------------------ kill -9 during a KV write
TWO_THREADS = '''
import flowrt as fr

wf = fr.Workflow("two_threads")


@wf.step
async def s1(start: str, llm: fr.Model) -> dict:
    a, b = llm.thread(start), llm.thread(start + " and a dog")
    return {"a": await a.gen(max_tokens=60, temperature=0), "b": await b.gen(max_tokens=50, temperature=0),
            "ta": a, "tb": b}


@wf.step
async def s2(s1: dict) -> dict:
    a, b = s1["ta"], s1["tb"]
    return {"a": await a.gen(max_tokens=16, temperature=0), "b": await b.gen(max_tokens=16, temperature=0)}
'''

# flowrt run, its block writes patched: the first goes to disk, the second writes half a temporary file
# (after a pause, so that the checkpoint naming the blocks is in the database) and kills the process
KILLED_MID_WRITE = r'''
import os, secrets, signal, sys, time
from flowrt.checkpoint import kv_blocks
from flowrt.checkpoint.kv_blocks import MAGIC
real, calls = kv_blocks.write_atomic, []

def write_atomic(folder, name, parts, **kw):
    calls.append(name)
    if len(calls) == 2:
        time.sleep(1.0)
        head, data = list(parts)
        with open(os.path.join(folder, f"{name}.{secrets.token_hex(8)}.tmp"), "wb") as f:
            f.write(head + data[:len(data) // 2])
            f.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    return real(folder, name, parts, **kw)

kv_blocks.write_atomic = write_atomic
from flowrt.cli import main
sys.exit(main(sys.argv[1:]))
'''


@pytest.mark.slow
def test_kill_9_during_a_kv_write_then_resume(tmp_path):
    """Killed writing its second block: the half-written temporary file never loads as a block, the resume in a
    fresh process reports the blocks it could not use (unsaved) and gives an uninterrupted run's outputs."""
    wf_file = tmp_path / "two_threads.py"
    wf_file.write_text(TWO_THREADS)
    common = ["--model", str(STORIES), "--dtype", "float32", "--input", "start=Once upon a time", "--no-progress"]
    p = flowrt_cli("run", str(wf_file), "--json", *common)
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err
    expected = json.loads(out)["outputs"]["s2"]

    db = str(tmp_path / "runs.db")
    p = subprocess.run([sys.executable, "-c", KILLED_MID_WRITE, "run", str(wf_file), "--checkpoint", db,
                        "--checkpoint-kv", "--json", *common], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == -signal.SIGKILL, p.stderr
    run = open_store(db).list_runs()[0]
    assert run.status == "running" and open_store(db).get_run(run.run_id).state["kv"]["queued"]
    files = [os.path.join(d, f) for d, _, fs in os.walk(db + ".kv") for f in fs]
    assert len([f for f in files if f.endswith(".tmp")]) == 1 and len(scan_blocks(db + ".kv")) == 1

    p = flowrt_cli("resume", run.run_id, "--checkpoint", db, "--checkpoint-kv", "--json", "--no-progress")
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err
    got = json.loads(out)
    assert got["outputs"]["s2"] == expected
    assert got["stats"]["kv_blocks_loaded"] == 1 and set(got["stats"]["kv_blocks_rejected"]) == {"unsaved"}
    print(f"\nresume after kill -9 mid-write: {got['stats']['kv_blocks_rejected']} rejected, 1 loaded, "
          f"{got['stats']['prefill_tokens_computed']} prefill tokens computed")
