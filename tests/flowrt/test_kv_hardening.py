"""Issue 39 items 1, 2, 4-8: a KV block directory that others can write (shared storage) never makes flowrt
delete a user's files or another database's blocks, follow a planted symlink, hang, run out of memory or fail
a run; a block that fails its checks is rejected, recomputed and replaced.

Fast tests drive ``KVCheckpoint`` with a stand-in engine (blocks of 4 tokens, 64 bytes); the runs use
stories260K in process; the mount tests (a 2 MiB tmpfs, a read-only bind mount, each in a private mount
namespace) run the CLI and are skipped, saying why, where mounting is not permitted."""

from __future__ import annotations

import errno
import hashlib
import io
import json
import logging
import os
import shutil
import stat
import subprocess
import sys
import threading
import time

import anyio
import pytest

import flowrt as fr
from flowrt.checkpoint import CheckpointError, open_store
from flowrt.checkpoint import kv_collect, kv_files
from flowrt.checkpoint.kv import KVCheckpoint
from flowrt.checkpoint.kv_blocks import MAGIC
from support import ROOT, STORIES

FP = "f" * 32
SIZE = 64
OLD = time.time() - 365 * 86400   # a year ago: past any grace period


class FakeEngine:
    """``KVTransfer`` without a model: full blocks of 4 tokens, each 64 bytes derived from its hash."""

    def __init__(self) -> None:
        self.imported: list[tuple[bytes, bytes]] = []

    def kv_fingerprint(self) -> str:
        return FP

    def kv_block_bytes(self) -> int:
        return SIZE

    def kv_export(self, token_ids, skip=None):
        out, parent = [], b""
        for i in range(len(token_ids) // 4):
            h = hashlib.blake2b(parent + bytes(token_ids[4 * i:4 * i + 4]), digest_size=16).digest()
            out.append((h, None) if skip is not None and skip(h) else (h, content(h)))
            parent = h
        return out

    def kv_import(self, blocks) -> int:
        blocks = list(blocks)
        self.imported += blocks
        return len(blocks)


class OsWith:
    """The ``os`` module with some functions replaced, for one module under test (``os`` itself untouched)."""

    def __init__(self, **replaced) -> None:
        self.__dict__.update(replaced)

    def __getattr__(self, name):
        return getattr(os, name)


def content(h: bytes) -> bytes:
    return (h * (SIZE // len(h) + 1))[:SIZE]


def kv_checkpoint(root, grace_s: float = 0.0) -> KVCheckpoint:
    """Blocks written on the caller (queue_bytes=0): these tests look at the files a save leaves."""
    kvc = KVCheckpoint(str(root), grace_s=grace_s, queue_bytes=0)
    kvc.bind(FakeEngine())
    return kvc


THREAD = list(range(1, 13))   # three full blocks


def block_files(root) -> set[str]:
    return {os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.endswith(".kv")}


def temp_files(root) -> list[str]:
    return [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.endswith(".tmp")]


# ------------------------------------------------------------------------ 1. only the store's own files
def plant_user_files(root) -> dict[str, bytes]:
    """A user's files, a year old: what ``--checkpoint-kv mydocs`` found in the probe."""
    files = {"README.md": b"# my project\n", "data.csv": b"a,b\n1,2\n", "notes/todo.txt": b"buy milk\n",
             "backup.db": b"SQLite format 3\x00" + bytes(100)}
    for name, body in files.items():
        p = os.path.join(root, name)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        with open(p, "wb") as f:
            f.write(body)
        os.utime(p, (OLD, OLD))
    return files


def assert_intact(root, files: dict[str, bytes]) -> None:
    for name, body in files.items():
        with open(os.path.join(root, name), "rb") as f:
            assert f.read() == body, name


def test_a_directory_holding_other_files_is_refused_and_left_as_it_is(tmp_path):
    docs = tmp_path / "mydocs"
    files = plant_user_files(docs)
    with pytest.raises(CheckpointError, match=r"mydocs holds files flowrt did not write \(README\.md, backup\.db, "
                                              r"data\.csv, notes/\).*mydocs/flowrt-kv"):
        fr.Runtime(checkpoint=":memory:", checkpoint_kv=str(docs))
    assert_intact(docs, files)
    assert sorted(os.listdir(docs)) == ["README.md", "backup.db", "data.csv", "notes"]
    rt = fr.Runtime(checkpoint=":memory:", checkpoint_kv=str(docs / "flowrt-kv"))   # what the error suggests
    assert rt.kv_checkpoint is not None


def test_collection_deletes_only_the_stores_own_block_files(tmp_path):
    """Files put into an accepted directory later, under the layout's names or not, a year old and referred to
    by no run: collection deletes the store's blocks and nothing else."""
    root = tmp_path / "kv"
    kvc = kv_checkpoint(root)
    ref = kvc.save([THREAD], owner="0" * 32, run_id="r").ref
    ours = block_files(root)
    assert len(ours) == 3
    shard = os.path.dirname(sorted(ours)[0])
    outside = tmp_path / "outside.txt"
    outside.write_bytes(b"not the store's")
    planted = {name: b"user data\n" for name in ("README.md", "data.csv", ".profile", "lost+found/x")}
    planted |= {os.path.join(FP, "notes.txt"): b"mine", os.path.join(shard, "data.csv"): b"mine",
                os.path.join(shard, "0" * 32 + ".kv"): b"a user's file named like a block",
                os.path.join(shard, "1" * 32 + ".kv.0123456789abcdef.tmp"): b"not a temp file of the store"}
    with open(sorted(ours)[0], "rb") as f:   # a block file of the store's, filed under another fingerprint
        planted[os.path.join("e" * 32, ref["threads"][0][0][:2], ref["threads"][0][0] + ".kv")] = f.read()
    for name, body in planted.items():
        p = os.path.join(root, name)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        with open(p, "wb") as f:
            f.write(body)
    link = os.path.join(shard, "2" * 32 + ".kv")
    os.symlink(outside, link)
    for d, _, fs in os.walk(root):
        for f in fs:
            os.utime(os.path.join(d, f), (OLD, OLD), follow_symlinks=False)
    kvc.release("0" * 32)
    assert kvc.collect(open_store(":memory:")) == 3
    assert not block_files(root) & ours
    assert_intact(root, planted)
    assert os.path.islink(link) and outside.read_bytes() == b"not the store's"


def test_user_files_survive_a_finished_runs_collection(tmp_path):
    """The probe: a run with KV checkpoints finishes while a user's files (a year old) are in the directory;
    its collection takes its blocks and leaves the files."""
    from flowrt.engine import AsyncLLM

    kv_dir, wf, files = tmp_path / "kv", two_steps(), {}

    async def go() -> fr.RunResult:
        eng = AsyncLLM(model=str(STORIES), dtype="float32", seed=0, num_kv_blocks=64)
        try:
            async with fr.Runtime(eng, checkpoint=str(tmp_path / "runs.db"), checkpoint_kv=str(kv_dir)) as rt:
                rt.kv_checkpoint.grace_s = 0
                files["placed"] = plant_user_files(kv_dir)   # after the directory was accepted (it was empty)
                return await rt.run(wf, start="Once upon a time")
        finally:
            eng.shutdown()

    r = anyio.run(go)
    assert r.status == "done"
    assert not block_files(kv_dir)   # the run's blocks were saved after step a, and collected at its end
    assert_intact(kv_dir, files["placed"])


def two_steps() -> fr.Workflow:
    wf = fr.Workflow("two_steps")

    @wf.step
    async def a(start: str, llm: fr.Model) -> dict:
        t = llm.thread(start)
        return {"text": await t.gen(max_tokens=40, temperature=0), "t": t}

    @wf.step
    async def b(a: dict) -> dict:
        if os.environ.get("KV_INTERRUPT"):
            await fr.interrupt("go on?")
        return {"text": await a["t"].gen(max_tokens=8, temperature=0), "tokens": len(a["t"].token_ids)}

    return wf


# ------------------------------------------------------------------------ 2. databases sharing a directory
def test_another_databases_interrupted_run_keeps_its_blocks(tmp_path, monkeypatch):
    """DB A's run waits at an interrupt; DB B's run finishes and collects (no grace period); A's resume in a
    fresh engine loads every block (none missing)."""
    from flowrt.engine import AsyncLLM

    kv_dir, wf = str(tmp_path / "shared-kv"), two_steps()

    async def run(db: str, start: str, **resume) -> fr.RunResult:
        eng = AsyncLLM(model=str(STORIES), dtype="float32", seed=0, num_kv_blocks=64)
        try:
            async with fr.Runtime(eng, checkpoint=db, checkpoint_kv=kv_dir) as rt:
                rt.kv_checkpoint.grace_s = 0
                if resume:
                    return await rt.resume(resume["run_id"], workflow=wf, answer="yes")
                return await rt.run(wf, start=start)
        finally:
            eng.shutdown()

    monkeypatch.setenv("KV_INTERRUPT", "1")
    a = anyio.run(run, str(tmp_path / "a.db"), "Once upon a time")
    assert a.status == "interrupted"
    a_blocks = block_files(kv_dir)
    assert len(a_blocks) >= 2
    for p in a_blocks:
        os.utime(p, (OLD, OLD))
    monkeypatch.delenv("KV_INTERRUPT")
    b = anyio.run(run, str(tmp_path / "b.db"), "One day a dog")
    assert b.status == "done"
    assert block_files(kv_dir) == a_blocks           # B's blocks collected, A's all kept
    resumed = anyio.run(lambda: run(str(tmp_path / "a.db"), "", run_id=a.run_id))
    assert resumed.status == "done"
    assert resumed.stats["kv_blocks_rejected"] == {} and resumed.stats["kv_blocks_loaded"] == len(a_blocks)


def test_a_block_a_save_renews_during_collection_is_put_back(tmp_path, monkeypatch):
    """The race collection is built for: a save keeps an old unreferenced block (renews its mtime) after the
    collection looked at it and before it renamed it away. The block stays."""
    root = tmp_path / "kv"
    kvc = kv_checkpoint(root)
    kvc.save([THREAD[:4]], owner="0" * 32, run_id="r")
    (block,) = block_files(root)
    os.utime(block, (OLD, OLD))
    kvc.release("0" * 32)
    def save_meanwhile(src, dst):
        assert kvc.blocks.fresh(FP, bytes.fromhex(os.path.basename(src)[:-3]))   # the other save's renewal
        os.rename(src, dst)

    monkeypatch.setattr(kv_collect, "os", OsWith(rename=save_meanwhile))
    kvc.grace_s = 60
    assert kvc.collect(open_store(":memory:")) == 0
    assert block_files(root) == {block} and not [f for _, _, fs in os.walk(root) for f in fs if ".del" in f]


def test_a_collection_that_stopped_half_way_puts_referenced_blocks_back(tmp_path):
    root = tmp_path / "kv"
    kvc = kv_checkpoint(root)
    ref = kvc.save([THREAD[:4]], owner="0" * 32, run_id="r").ref
    (block,) = block_files(root)
    os.rename(block, block + ".0123456789abcdef.del")   # a collection killed after its rename
    assert kvc.collect(open_store(":memory:")) == 0     # the run's reference file still names it
    assert block_files(root) == {block}
    assert kvc.load(ref).loaded == 1


def test_an_unreadable_reference_file_stops_collection(tmp_path, caplog):
    root = tmp_path / "kv"
    kvc = kv_checkpoint(root)
    kvc.save([THREAD], owner="0" * 32, run_id="r")
    kvc.release("0" * 32)
    bad = os.path.join(root, "runs", "1" * 32 + ".json")
    with open(bad, "w") as f:
        f.write("{not json")
    with caplog.at_level(logging.WARNING, logger="flowrt.checkpoint"):
        assert kvc.collect(open_store(":memory:")) == 0
    assert len(block_files(root)) == 3
    assert bad in caplog.text and "not collected" in caplog.text


# ------------------------------------------------------------------------ 4. a full or read-only file system
class FullDisk(io.FileIO):
    def write(self, b):
        raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("where", ["write", "create"])
def test_blocks_that_cannot_be_written_are_skipped_counted_and_warned_once(tmp_path, monkeypatch, caplog, where):
    """ENOSPC while writing a block, EROFS creating its temporary file (no mount needed): the save goes on,
    leaves no temporary file, counts the blocks and warns once naming the directory and the reason."""
    root = tmp_path / "kv"
    kvc = kv_checkpoint(root)
    if where == "write":
        monkeypatch.setattr(kv_files, "open", lambda fd, mode, closefd=True: FullDisk(fd, "wb", closefd=closefd),
                            raising=False)
        reason = "No space left on device"
    else:
        def read_only(path, flags, *a):
            if flags & os.O_CREAT:
                raise OSError(errno.EROFS, "Read-only file system", path)
            return os.open(path, flags, *a)

        monkeypatch.setattr(kv_files, "os", OsWith(open=read_only))
        reason = "Read-only file system"
    with caplog.at_level(logging.WARNING, logger="flowrt.checkpoint"):
        first = kvc.save([THREAD, THREAD[:8] + [99] * 4], owner="0" * 32, run_id="r")
        again = kvc.save([THREAD], owner="0" * 32, run_id="r")
    assert first.failed == 4 and first.ref["threads"] == [] and again.failed == 3   # 3 + 1 (shared prefix)
    assert not block_files(root) and not temp_files(root)
    warnings = [r for r in caplog.records if r.name == "flowrt.checkpoint"]
    assert len(warnings) == 1 and str(root) in warnings[0].getMessage() and reason in warnings[0].getMessage()


def _unshare_sh() -> list[str]:
    """``unshare -m sh -c``: mounts in a private namespace (they go with the process); skips where not permitted."""
    if shutil.which("unshare") is None or subprocess.run(
            ["unshare", "-m", "mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", "/mnt"],
            capture_output=True).returncode != 0:
        pytest.skip("mounting is not permitted here (needs root and unshare -m); the injected ENOSPC/EROFS "
                    "test covers the same code")
    return ["unshare", "-m", "sh", "-c"]


def _cli_run(tmp_path, setup: str, kv_dir, after: str = "true") -> tuple[dict, str, str]:
    """``flowrt run`` (to the end) in a private mount namespace after ``setup``, then ``after`` there."""
    wf_file = tmp_path / "wf.py"
    wf_file.write_text(WF_FILE)
    db = tmp_path / "runs.db"
    script = (f'{setup} && "{sys.executable}" -m flowrt.cli run "{wf_file}" --checkpoint "{db}" '
              f'--checkpoint-kv "{kv_dir}" --model "{STORIES}" --dtype float32 --input "start=Once upon a time" '
              f'--json --no-progress; echo rc=$? >&2; {after}')
    p = subprocess.run([*_unshare_sh(), script], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert p.returncode == 0 and "rc=0" in p.stderr, p.stderr
    return json.loads(p.stdout), p.stderr, open_store(str(db)).list_runs()[0].status


WF_FILE = '''
import flowrt as fr

wf = fr.Workflow("two_steps")


@wf.step
async def a(start: str, llm: fr.Model) -> dict:
    t = llm.thread(start)
    return {"text": await t.gen(max_tokens=60, temperature=0), "t": t}


@wf.step
async def b(a: dict) -> str:
    return await a["t"].gen(max_tokens=8, temperature=0)
'''


@pytest.mark.slow
def test_a_run_on_a_full_tmpfs_finishes(tmp_path):
    """The probe: a 2 MiB tmpfs nearly full. ``flowrt run`` finishes (done), warns once, leaves no temp file."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    setup = (f'mount -t tmpfs -o size=2m tmpfs "{mnt}" && mkdir "{mnt}/kv" && '
             f'dd if=/dev/zero of="{mnt}/filler" bs=4k count=508 2>/dev/null')   # 16 KiB left: no block fits
    out, err, status = _cli_run(tmp_path, setup, mnt / "kv",
                                after=f'echo temp_files=$(find "{mnt}" -name "*.tmp" | wc -l) >&2')
    assert status == "done" and out["stats"]["kv_blocks_save_failed"] > 0
    assert err.count("cannot write KV blocks") == 1 and "No space left on device" in err and f"{mnt}/kv" in err
    assert "temp_files=0" in err


@pytest.mark.slow
def test_a_run_on_a_read_only_kv_directory_finishes(tmp_path):
    kv_dir = tmp_path / "kv"
    kv_dir.mkdir()
    out, err, status = _cli_run(tmp_path, f'mount --bind -o ro "{kv_dir}" "{kv_dir}"', kv_dir)
    assert status == "done" and out["stats"]["kv_blocks_save_failed"] > 0
    # one warning (a save writes the run's reference file first, so it names that file; the blocks go unwarned)
    assert err.count(f"KV checkpoints in {kv_dir}: cannot write") == 1 and "Read-only file system" in err
    assert os.listdir(kv_dir) == []


# ------------------------------------------------------------------------ 5, 6. rejected blocks
def write_block(path: str, data: bytes, fp: str = FP) -> None:
    """A block file as the store writes it: valid header and checksum for ``data``, whatever its size."""
    h = os.path.basename(path)[:-3]
    header = json.dumps({"fingerprint": fp, "hash": h, "bytes": len(data),
                         "blake2b": hashlib.blake2b(data, digest_size=16).hexdigest()}).encode()
    with open(path, "wb") as f:
        f.write(MAGIC + header + b"\n" + data)


def test_a_block_of_the_wrong_size_is_rejected_as_corrupt(tmp_path):
    kvc = kv_checkpoint(tmp_path / "kv")
    ref = kvc.save([THREAD], owner="0" * 32, run_id="r").ref
    first = kvc.blocks.path(FP, bytes.fromhex(ref["threads"][0][1]))
    write_block(first, bytes(100))     # valid header and checksum, 100 bytes: not this engine's block
    got = kvc.load(ref)
    assert got.loaded == 1 and got.rejected == {"corrupt": 1}
    assert [len(d) for _, d in kvc._engine.imported] == [SIZE]


def test_a_wrong_size_block_does_not_stop_a_resume(tmp_path, monkeypatch):
    """The probe: a resume (fresh engine) finds a 100-byte block with a valid header; it recomputes it and
    finishes, and the run is not left ``running``."""
    from flowrt.engine import AsyncLLM

    kv_dir, db, wf = str(tmp_path / "kv"), str(tmp_path / "runs.db"), two_steps()

    async def run(**resume) -> fr.RunResult:
        eng = AsyncLLM(model=str(STORIES), dtype="float32", seed=0, num_kv_blocks=64)
        try:
            async with fr.Runtime(eng, checkpoint=db, checkpoint_kv=kv_dir) as rt:
                if resume:
                    return await rt.resume(resume["run_id"], workflow=wf, answer="yes")
                return await rt.run(wf, start="Once upon a time")
        finally:
            eng.shutdown()

    monkeypatch.setenv("KV_INTERRUPT", "1")
    paused = anyio.run(run)
    ref = open_store(db).get_run(paused.run_id).state["kv"]
    fp, first = ref["fingerprint"], ref["threads"][0][0]
    write_block(os.path.join(kv_dir, fp, first[:2], first + ".kv"), bytes(100), fp)
    r = anyio.run(lambda: run(run_id=paused.run_id))
    assert r.status == "done" and r.stats["kv_blocks_rejected"] == {"corrupt": 1} and r.stats["kv_blocks_loaded"] == 0
    assert open_store(db).get_run(paused.run_id).status == "done"


def test_a_block_that_failed_its_checks_is_replaced_by_the_next_save(tmp_path):
    kvc = kv_checkpoint(tmp_path / "kv")
    ref = kvc.save([THREAD], owner="0" * 32, run_id="r").ref
    h = bytes.fromhex(ref["threads"][0][0])
    p = kvc.blocks.path(FP, h)
    with open(p, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        f.write(b"\xff")
    assert kvc.load(ref).rejected == {"corrupt": 1}
    assert kvc.save([THREAD], owner="0" * 32, run_id="r").failed == 0
    assert kvc.blocks.read(FP, h, SIZE) == (content(h), None)
    fresh = kv_checkpoint(tmp_path / "kv")   # another process: all three load
    assert fresh.load(ref).loaded == 3


# ------------------------------------------------------------------------ 7. only regular files are read
@pytest.mark.timeout(20)
@pytest.mark.parametrize("kind", ["dev_zero", "fifo", "huge"])
def test_a_block_path_that_is_no_block_file_is_rejected_at_once(tmp_path, kind):
    """A symlink to /dev/zero (3 GiB RSS in the probe), a FIFO (a hang), a 1 GiB sparse file: rejected
    without reading more than a block's header and size."""
    kvc = kv_checkpoint(tmp_path / "kv")
    ref = kvc.save([THREAD], owner="0" * 32, run_id="r").ref
    p = kvc.blocks.path(FP, bytes.fromhex(ref["threads"][0][0]))
    os.unlink(p)
    if kind == "dev_zero":
        os.symlink("/dev/zero", p)
    elif kind == "fifo":
        os.mkfifo(p)
    else:
        with open(p, "wb") as f:
            f.write(MAGIC)
            f.truncate(1 << 30)
    result = {}
    t = threading.Thread(target=lambda: result.update(got=kvc.load(ref)), daemon=True)
    t.start()
    t.join(5)
    hung = t.is_alive()
    if hung and kind == "fifo":
        with open(p, "wb"):   # let a blocked open go
            pass
    assert not hung, "the resume hung on the block file"
    got = result["got"]
    assert got.loaded == 0 and got.rejected == ({"corrupt": 1} if kind == "huge" else {"not_a_file": 1})


# ------------------------------------------------------------------------ 8. temporary files
def test_a_symlink_planted_at_a_temp_name_is_not_followed(tmp_path, monkeypatch):
    """At the old predictable name ``<block>.kv.<pid>.tmp``, and at the random name itself (O_EXCL |
    O_NOFOLLOW): the file outside the directory is unchanged and the block path is a regular file."""
    kvc = kv_checkpoint(tmp_path / "kv")
    outside = tmp_path / "victim.txt"
    outside.write_bytes(b"precious")
    hashes = [h for h, _ in FakeEngine().kv_export(THREAD)]
    paths = [kvc.blocks.path(FP, h) for h in hashes]
    os.makedirs(os.path.dirname(paths[0]), exist_ok=True)
    os.symlink(outside, f"{paths[0]}.{os.getpid()}.tmp")
    monkeypatch.setattr(kv_files.secrets, "token_hex", lambda n: "ab" * n)
    os.makedirs(os.path.dirname(paths[1]), exist_ok=True)
    os.symlink(outside, f"{paths[1]}.{'ab' * 8}.tmp")
    saved = kvc.save([THREAD], owner="0" * 32, run_id="r")
    assert outside.read_bytes() == b"precious"
    assert stat.S_ISREG(os.lstat(paths[0]).st_mode)
    assert saved.failed == 2 and not os.path.lexists(paths[1])   # its temp name was taken: not written
    assert os.path.islink(f"{paths[1]}.{'ab' * 8}.tmp")


def test_symlinks_at_a_block_path_or_folder_are_not_written_through(tmp_path):
    kvc = kv_checkpoint(tmp_path / "kv")
    outside = tmp_path / "outside"
    outside.mkdir()
    victim = outside / "victim.txt"
    victim.write_bytes(b"precious")
    hashes = [h for h, _ in FakeEngine().kv_export(THREAD)]
    block, second = kvc.blocks.path(FP, hashes[0]), kvc.blocks.path(FP, hashes[1])
    assert os.path.dirname(block) != os.path.dirname(second)
    os.makedirs(os.path.dirname(block))
    os.symlink(victim, block)                            # at the block path: replaced by the block
    os.symlink(outside, os.path.dirname(second))         # a block folder: not written into
    saved = kvc.save([THREAD], owner="0" * 32, run_id="r")
    assert victim.read_bytes() == b"precious" and os.listdir(outside) == ["victim.txt"]
    assert stat.S_ISREG(os.lstat(block).st_mode) and kvc.blocks.read(FP, hashes[0], SIZE)[1] is None
    assert saved.ref["threads"] == [[hashes[0].hex()]] and saved.failed == 2
