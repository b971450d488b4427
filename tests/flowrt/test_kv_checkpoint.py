"""KV saved with checkpoints (flowrt.checkpoint.kv, --checkpoint-kv): a resume in a fresh process loads the
live threads' full blocks into the prefix cache and computes only each thread's last partial block, with the
same greedy outputs; a missing, corrupt or foreign block is computed again, never used; blocks that no
unfinished run refers to are collected."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import anyio
import pytest

import flowrt as fr
from flowrt.checkpoint import CheckpointError, open_store
from flowrt.checkpoint.kv import KVBlockStore
from support import MAYBE_HANG, flowrt_cli, kill_at

BLOCK = 16

TWO_THREADS = '''
import os, pathlib, time
import flowrt as fr

wf = fr.Workflow("two_threads")

''' + MAYBE_HANG + '''

@wf.step
async def s1(start: str, llm: fr.Model) -> dict:
    a, b = llm.thread(start), llm.thread(start + " and a dog")
    return {"a": await a.gen(max_tokens=60, temperature=0), "b": await b.gen(max_tokens=50, temperature=0),
            "ta": a, "tb": b}


@wf.step
async def s2(s1: dict) -> dict:
    maybe_hang("s2")
    if os.environ.get("KV_INTERRUPT"):
        await fr.interrupt("go on?")
    a, b = s1["ta"], s1["tb"]
    return {"a": await a.gen(max_tokens=16, temperature=0), "b": await b.gen(max_tokens=16, temperature=0),
            "tokens": [len(a.token_ids), len(b.token_ids)]}
'''


@pytest.fixture
def wf_file(tmp_path):
    f = tmp_path / "two_threads.py"
    f.write_text(TWO_THREADS)
    return f


# ---------------------------------------------------------------------------------------------- block files
def test_block_files_are_verified_by_hash_fingerprint_and_checksum(tmp_path):
    store = KVBlockStore(str(tmp_path / "kv"))
    fp, fp2 = "a" * 32, "b" * 32
    h, data = b"\x01" * 16, bytes(range(256)) * 4
    store.write(fp, h, data)
    assert store.read(fp, h, len(data)) == (data, None)
    assert store.read(fp, b"\x02" * 16, len(data)) == (None, "missing")
    assert store.read(fp2, h, len(data)) == (None, "missing")
    p = store.path(fp, h)
    raw = open(p, "rb").read()
    open(p, "wb").write(raw[:-1] + bytes([raw[-1] ^ 1]))      # one bit of the content
    assert store.read(fp, h, len(data)) == (None, "corrupt")
    open(p, "wb").write(raw[:-10])                             # truncated
    assert store.read(fp, h, len(data)) == (None, "corrupt")
    store.write(fp, h, data)
    for f, other in ((fp2, h), (fp, b"\x03" * 16)):   # another model's block; a file under another hash
        os.makedirs(os.path.dirname(store.path(f, other)), exist_ok=True)
        shutil.copy(store.path(fp, h), store.path(f, other))
        assert store.read(f, other, len(data)) == (None, "foreign")


def test_checkpoint_kv_needs_a_place_for_blocks(tmp_path):
    with pytest.raises(CheckpointError, match="needs checkpoint="):
        fr.Runtime(checkpoint_kv=True)
    with pytest.raises(CheckpointError, match="give it a directory"):
        fr.Runtime(checkpoint=":memory:", checkpoint_kv=True)
    rt = fr.Runtime(checkpoint=":memory:", checkpoint_kv=str(tmp_path / "blocks"))
    assert os.path.isdir(tmp_path / "blocks") and rt.kv_checkpoint is not None


# ---------------------------------------------------------------------------------------------- in process
def _engine(stories_path):
    from flowrt.engine import AsyncLLM

    return AsyncLLM(model=stories_path, dtype="float32", seed=0, num_kv_blocks=256)


def test_cold_resume_loads_blocks_and_old_blocks_are_collected(tmp_path, wf_file, stories_path, monkeypatch,
                                                               store_spec):
    """Two runs paused at s2 on one engine; each resumes on a fresh engine (a cold resume), one with its KV
    blocks and one without. Then blocks no unfinished run refers to are collected. On SQLite (blocks beside
    the file) and PostgreSQL (blocks in a given directory)."""
    from flowrt.graph.loader import load_workflow

    monkeypatch.setenv("KV_INTERRUPT", "1")
    wf = load_workflow(wf_file)
    db = store_spec
    kv_dir = db + ".kv" if "://" not in db else str(tmp_path / "blocks")
    kv_opt = True if "://" not in db else kv_dir

    async def paused() -> list[str]:
        eng = _engine(stories_path)
        try:
            async with fr.Runtime(eng, checkpoint=db, checkpoint_kv=kv_opt) as rt:
                a = await rt.run(wf, start="Once upon a time")
                b = await rt.run(wf, start="One day")
                assert a.status == b.status == "interrupted"
                return [a.run_id, b.run_id]
        finally:
            eng.shutdown()

    async def resume(run_id: str, kv: bool) -> tuple[fr.RunResult, int, object]:
        eng = _engine(stories_path)
        try:
            async with fr.Runtime(eng, checkpoint=db, checkpoint_kv=kv_opt if kv else False) as rt:
                if kv:
                    rt.kv_checkpoint.grace_s = 0   # collect at once (no other process writes here)
                r = await rt.resume(run_id, workflow=wf, answer="yes")
                return r, eng.stats()["prefill_tokens_computed"], rt.kv_checkpoint
        finally:
            eng.shutdown()

    a_id, b_id = anyio.run(paused)
    files = lambda: set(os.path.join(d, f) for d, _, fs in os.walk(kv_dir) for f in fs  # noqa: E731
                        if not d.endswith(os.sep + "runs"))
    refs = lambda: os.listdir(os.path.join(kv_dir, "runs"))  # noqa: E731
    both = files()
    assert both and all(f.endswith(".kv") for f in both)
    assert len(refs()) == 2                           # each paused run's reference file

    a, computed_with, kvc = anyio.run(resume, a_id, True)
    b, computed_without, _ = anyio.run(resume, b_id, False)
    assert a.status == b.status == "done"
    print(f"\ncold resume prefill: {computed_with} tokens with KV blocks, {computed_without} without "
          f"(threads of {a.outputs['s2']['tokens']} and {b.outputs['s2']['tokens']} tokens after s2)")
    assert computed_with <= BLOCK * 2                 # each thread's last (partial) block
    assert a.stats["kv_blocks_loaded"] > 0 and a.stats["kv_blocks_rejected"] == {}
    assert "kv_blocks_loaded" not in b.stats
    assert computed_without >= sum(b.outputs["s2"]["tokens"]) - 2 * 16   # both threads' whole context
    monkeypatch.delenv("KV_INTERRUPT")
    ref = anyio.run(_plain_run, stories_path, wf, "Once upon a time")
    assert {k: a.outputs["s2"][k] for k in ("a", "b")} == {k: ref.outputs["s2"][k] for k in ("a", "b")}
    # a finished: its blocks were collected; b (paused, referring to its own) kept its blocks until it
    # finished without KV, which dropped its references: the next collect takes them
    left = files()
    assert left and left < both and len(refs()) == 1
    store = open_store(db)
    assert kvc.collect(store) == len(left) and not files() and not refs()   # b's file went with its blocks
    store.close()


async def _plain_run(stories_path: str, wf, start: str) -> fr.RunResult:
    eng = _engine(stories_path)
    try:
        async with fr.Runtime(eng) as rt:
            return await rt.run(wf, start=start)
    finally:
        eng.shutdown()


# ---------------------------------------------------------------------------------------------- kill -9
def _finish(p: subprocess.Popen) -> dict:
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err
    return json.loads(out)


def _written(db: str) -> bool:
    """The blocks the run's last checkpoint names are on disk (the writer thread writes them after the save)."""
    store = open_store(db, readonly=True)
    kv = (store.get_run(store.list_runs()[0].run_id).state or {}).get("kv") or {}
    store.close()
    root = os.path.join(db + ".kv", kv.get("fingerprint", "-"))
    return bool(kv.get("threads")) and all(os.path.exists(os.path.join(root, x[:2], x + ".kv"))
                                           for chain in kv["threads"] for x in chain)


@pytest.mark.slow
def test_sigkill_then_cold_resume_with_kv_computes_one_block_per_thread(tmp_path, wf_file, stories_path):
    common = ["--model", stories_path, "--dtype", "float32", "--input", "start=Once upon a time", "--no-progress"]
    expected = _finish(flowrt_cli("run", str(wf_file), "--json", *common))["outputs"]["s2"]

    run_dir, ready = tmp_path / "a", tmp_path / "ready"
    run_dir.mkdir()
    db = str(run_dir / "runs.db")
    # killed with s1 finished (two threads of ~65 and ~60 tokens), its KV blocks written, and s2 running
    kill_at("s2", ready, "run", str(wf_file), "--checkpoint", db, "--checkpoint-kv", *common,
            until=lambda: _written(db))
    run_id = open_store(db).list_runs()[0].run_id
    blocks = sorted(os.path.join(d, f) for d, _, fs in os.walk(db + ".kv") for f in fs if f.endswith(".kv"))
    assert len(blocks) >= 6

    shutil.copytree(run_dir, tmp_path / "b")          # the same crashed run, to resume with a corrupt block
    corrupt_db = str(tmp_path / "b" / "runs.db")
    victim = os.path.join(corrupt_db + ".kv", os.path.relpath(blocks[0], db + ".kv"))
    raw = open(victim, "rb").read()
    open(victim, "wb").write(raw[:-3] + bytes(b ^ 0xFF for b in raw[-3:]))

    clean = _finish(flowrt_cli("resume", run_id, "--checkpoint", db, "--checkpoint-kv", "--json", "--no-progress"))
    bad = _finish(flowrt_cli("resume", run_id, "--checkpoint", corrupt_db, "--checkpoint-kv", "--json",
                             "--no-progress"))
    assert clean["outputs"]["s2"] == expected and bad["outputs"]["s2"] == expected
    computed, recomputed = clean["stats"]["prefill_tokens_computed"], bad["stats"]["prefill_tokens_computed"]
    print(f"\nresume after kill -9: {computed} prefill tokens computed with KV blocks, {recomputed} with one "
          f"corrupt block (threads of {expected['tokens']} tokens)")
    assert computed <= BLOCK * 2
    assert recomputed > computed      # the corrupt block and the rest of its chain were computed again
    assert clean["stats"]["kv_blocks_rejected"] == {} and clean["stats"]["kv_blocks_loaded"] == len(blocks)
    assert bad["stats"]["kv_blocks_rejected"] == {"corrupt": 1}
    assert bad["stats"]["kv_blocks_loaded"] < len(blocks)


def test_serve_checkpoint_kv_without_a_place_for_blocks_is_a_usage_error(tmp_path, wf_file, stories_path, capsys):
    from flowrt.server.cli import main

    assert main(["--model", stories_path, "--workflow", str(wf_file), "--checkpoint-kv"]) == 2
    assert "give it a directory" in capsys.readouterr().err
