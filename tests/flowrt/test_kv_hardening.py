"""Issue 39 items 5, 7, 8: a KV block directory that others can write (shared storage) never makes flowrt
follow a planted symlink, hang or run out of memory; a block of the wrong size is rejected and recomputed.

Fast tests drive ``KVCheckpoint`` with a stand-in engine (blocks of 4 tokens, 64 bytes); the runs use
stories260K in process."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import threading

import anyio
import pytest

import flowrt as fr
from flowrt.checkpoint import kv_files, open_store
from flowrt.checkpoint.kv import KVCheckpoint
from flowrt.checkpoint.kv_blocks import MAGIC
from support import STORIES

FP = "f" * 32
SIZE = 64


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


def content(h: bytes) -> bytes:
    return (h * (SIZE // len(h) + 1))[:SIZE]


def kv_checkpoint(root, grace_s: float = 0.0) -> KVCheckpoint:
    kvc = KVCheckpoint(str(root), grace_s=grace_s)
    kvc.bind(FakeEngine())
    return kvc


THREAD = list(range(1, 13))   # three full blocks


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
    ref = kvc.save([THREAD])
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


# ------------------------------------------------------------------------ 7. only regular files are read
@pytest.mark.timeout(20)
@pytest.mark.parametrize("kind", ["dev_zero", "fifo", "huge"])
def test_a_block_path_that_is_no_block_file_is_rejected_at_once(tmp_path, kind):
    """A symlink to /dev/zero (3 GiB RSS in the probe), a FIFO (a hang), a 1 GiB sparse file: rejected
    without reading more than a block's header and size."""
    kvc = kv_checkpoint(tmp_path / "kv")
    ref = kvc.save([THREAD])
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
    with pytest.raises(FileExistsError):   # its temp name was taken: not written
        kvc.save([THREAD])
    assert outside.read_bytes() == b"precious"
    assert stat.S_ISREG(os.lstat(paths[0]).st_mode)
    assert not os.path.lexists(paths[1]) and os.path.islink(f"{paths[1]}.{'ab' * 8}.tmp")
