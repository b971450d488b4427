"""Checkpoints in SQLite: the store (WAL, schema version, clear errors, concurrent writers), resume of a
run killed with SIGKILL (finished steps are not run again, outputs equal an uninterrupted run), and a
resume's prefill work with and without the engine's prefix cache."""

from __future__ import annotations

import json
import sqlite3
import threading

import anyio
import pytest

import flowrt as fr
from flowrt.checkpoint import SCHEMA_VERSION, CheckpointError, CheckpointStore, SQLiteStore, decode, encode, open_store
from support import MAYBE_HANG, flowrt_cli, kill_at



# ---------------------------------------------------------------------------------------------- the store
def _execute_sql(spec: str, stmt: str) -> None:
    """Run ``stmt`` on the store's database behind its back (tables named as SQLite names them)."""
    if spec.startswith("postgresql://"):
        import psycopg

        with psycopg.connect(spec, autocommit=True) as c:
            c.execute(stmt.replace("schema_version", "flowrt_schema_version"))
        return
    con = sqlite3.connect(spec)
    con.execute(stmt)
    con.commit()
    con.close()


def test_sqlite_store_wal_and_schema_version(tmp_path):
    db = tmp_path / "runs.db"
    SQLiteStore(db).close()
    con = sqlite3.connect(db)
    assert con.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert con.execute("SELECT version FROM schema_version").fetchone()[0] == SCHEMA_VERSION
    con.close()


def test_store_saves_reads_lists_and_deletes_runs(store_spec):
    store = open_store(store_spec)
    assert isinstance(store, CheckpointStore)
    store.create_run("r1", "wf", {"x": 1}, file="f.py", meta={"model": None})
    seq = store.save("r1", step="a", visit=1, step_status="done", result={"json": 2}, route=None, threads=[],
                     state={"status": {"a": "done"}}, run_status="running")
    assert seq == 1
    rec = store.get_run("r1")
    assert rec.status == "running" and rec.inputs == {"x": 1} and rec.state == {"status": {"a": "done"}}
    assert rec.file == "f.py" and rec.meta == {"model": None} and rec.checkpoints == 1
    assert [h["step"] for h in store.history("r1")] == ["a"]
    assert store.history("r1")[0]["result"] == {"json": 2}
    with pytest.raises(CheckpointError, match="no run 'nope'"):
        store.get_run("nope")
    with pytest.raises(CheckpointError, match="already exists"):
        store.create_run("r1", "wf", {})
    store.create_run("r2", "wf", {})
    assert store.save("r2", step=None, visit=0, step_status="failed", result=None, route=None, threads=[],
                      state={}, run_status="failed", interrupt=None) == 1
    assert [r.run_id for r in store.list_runs()] == ["r2", "r1"] and store.list_runs()[0].status == "failed"
    assert store.list_runs()[0].state is None and len(store.list_runs(1)) == 1
    store.delete_run("r1")
    assert [r.run_id for r in store.list_runs()] == ["r2"]
    store.close()
    reopened = open_store(store_spec)     # a second open finds the schema in place
    assert reopened.get_run("r2").status == "failed"
    reopened.close()


def test_a_store_of_a_newer_format_is_refused(store_spec):
    open_store(store_spec).close()
    _execute_sql(store_spec, f"UPDATE schema_version SET version = {SCHEMA_VERSION + 1}")
    with pytest.raises(CheckpointError, match="newer flowrt"):
        open_store(store_spec)


def test_postgres_store_unreachable_is_a_clear_error_without_the_password():
    with pytest.raises(CheckpointError, match="cannot connect") as e:
        open_store("postgresql://me:s3cret@127.0.0.1:1/db")
    assert "s3cret" not in str(e.value)


def test_corrupt_foreign_or_newer_database_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.db"
    bad.write_bytes(b"this is not sqlite at all" * 100)
    with pytest.raises(CheckpointError, match="not a flowrt checkpoint database, or it is corrupt"):
        SQLiteStore(bad)
    foreign = tmp_path / "foreign.db"
    con = sqlite3.connect(foreign)
    con.execute("CREATE TABLE users (id INTEGER)")
    con.commit()
    con.close()
    with pytest.raises(CheckpointError, match="not a flowrt checkpoint database"):
        SQLiteStore(foreign)
    newer = tmp_path / "newer.db"
    SQLiteStore(newer).close()
    con = sqlite3.connect(newer)
    con.execute("UPDATE schema_version SET version = ?", (SCHEMA_VERSION + 1,))
    con.commit()
    con.close()
    with pytest.raises(CheckpointError, match="newer flowrt"):
        SQLiteStore(newer)
    with pytest.raises(CheckpointError):   # and the runtime refuses it too, before anything runs
        fr.Runtime(checkpoint=str(newer))


def test_cli_refuses_a_bad_database(tmp_path, capsys):
    from flowrt.cli.commands import main

    f = tmp_path / "wf.py"
    f.write_text("import flowrt as fr\nwf = fr.Workflow('w')\n@wf.step\ndef a() -> int:\n    return 1\n")
    bad = tmp_path / "bad.db"
    bad.write_bytes(b"garbage" * 200)
    assert main(["run", str(f), "--checkpoint", str(bad), "--no-progress"]) == 2
    assert "corrupt" in capsys.readouterr().err
    assert bad.read_bytes() == b"garbage" * 200     # never replaced by a fresh database


def test_codec_round_trips_or_marks_a_placeholder():
    for v in [None, 1, 2.5, "s", [1, "a"], {"k": [1, 2]}, (1, (2, 3)), {"t": (1,)}]:
        assert decode(encode(v)) == v
    enc = encode(object())
    assert "placeholder" in enc and enc["type"] == "object"
    assert "placeholder" in encode(10 ** 5000) and "placeholder" in encode(float("nan"))


def test_concurrent_runs_write_to_one_database(store_spec):
    db = store_spec
    wf = fr.Workflow("many")

    @wf.step
    async def a(x: int) -> int:
        await anyio.sleep(0.001)
        return x

    @wf.step
    async def b(a: int) -> int:
        return a * 2

    @wf.step
    def c(b: int) -> int:
        return b + 1

    results: dict[int, fr.RunResult] = {}
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            async def go() -> None:
                async with fr.Runtime(checkpoint=db) as rt:   # each thread its own connection
                    for j in range(5):
                        results[i * 10 + j] = await rt.run(wf, x=i * 10 + j)
            anyio.run(go)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    store = open_store(db)
    runs = store.list_runs(100)
    assert len(runs) == 20 and all(r.status == "done" for r in runs)
    for r in results.values():
        assert [h["step"] for h in store.history(r.run_id)] == ["a", "b", "c", None]
        assert store.get_run(r.run_id).state["outputs"]["c"] == {"json": r.outputs["c"]}


def test_resume_after_a_failure_does_not_rerun_finished_steps(store_spec):
    db = store_spec
    calls: list[str] = []
    flaky = {"fail": True}
    wf = fr.Workflow("flaky")

    @wf.step
    def a(x: int) -> tuple:
        calls.append("a")
        return (x, x + 1)

    @wf.step
    def b(a: tuple) -> int:
        calls.append("b")
        if flaky["fail"]:
            raise RuntimeError("transient")
        return sum(a)

    @wf.step
    def c(b: int) -> int:
        calls.append("c")
        return b * 10

    async def go() -> tuple:
        async with fr.Runtime(checkpoint=db) as rt:
            r1 = await rt.run(wf, x=1)
            flaky["fail"] = False
            r2 = await rt.resume(r1.run_id, workflow=wf)
            return r1, r2

    r1, r2 = anyio.run(go)
    assert r1.status == "failed" and "transient" in r1.errors["b"].message
    assert r2.status == "done" and r2.outputs == {"a": (1, 2), "b": 3, "c": 30}   # the tuple came back
    assert calls == ["a", "b", "b", "c"]


def test_unserializable_result_is_a_placeholder_and_its_step_reruns(store_spec):
    db = store_spec
    calls: list[str] = []
    gate = {"open": False}
    wf = fr.Workflow("opaque")

    class Box:
        def __init__(self, v: int) -> None:
            self.v = v

    @wf.step
    def make() -> Box:
        calls.append("make")
        return Box(3)

    @wf.step
    async def use(make: Box) -> int:
        calls.append("use")
        if not gate["open"]:
            await fr.interrupt("open the gate?")
        return make.v

    async def go() -> tuple:
        async with fr.Runtime(checkpoint=db) as rt:
            r1 = await rt.run(wf)
            gate["open"] = True
            return r1, await rt.resume(r1.run_id, workflow=wf, answer=True)

    r1, r2 = anyio.run(go)
    state = open_store(db).get_run(r1.run_id).state
    assert "placeholder" in state["outputs"]["make"]
    assert r2.outputs["use"] == 3 and calls == ["make", "use", "make", "use"]


def test_routes_and_loops_resume_mid_loop(store_spec):
    db = store_spec
    wf = fr.Workflow("loop")
    asked = {"n": 0}

    @wf.step(routes=["tool", "answer"])
    def agent(tool: list | None = None) -> fr.Goto:
        seen = tool or []
        return fr.goto("answer", seen) if len(seen) >= 3 else fr.goto("tool", seen)

    @wf.step(routes=["agent"])
    async def tool(agent: list) -> fr.Goto:
        if len(agent) == 1 and asked["n"] == 0:
            asked["n"] += 1
            await fr.interrupt("second call ok?")
        return fr.goto("agent", agent + [len(agent)])

    @wf.step
    def answer(agent: list) -> list:
        return agent

    async def go() -> tuple:
        async with fr.Runtime(checkpoint=db) as rt:
            r1 = await rt.run(wf)
            return r1, await rt.resume(r1.run_id, workflow=wf, answer="yes")

    r1, r2 = anyio.run(go)
    assert r1.status == "interrupted" and r1.interrupt["payload"] == "second call ok?"
    assert r2.outputs["answer"] == [0, 1, 2] and r2.visits == {"agent": 4, "tool": 3}


# ---------------------------------------------------------------------------------------------- crash + resume
CHAIN = '''
import os, pathlib, time
import flowrt as fr

wf = fr.Workflow("chain")


def mark(name):
    log = os.environ.get("CHAIN_LOG")
    if log:
        with open(log, "a") as f:
            f.write(name + "\\n")

''' + MAYBE_HANG + '''

@wf.step
async def s1(start: str, llm: fr.Model) -> dict:
    maybe_hang("s1"); mark("s1")
    t = llm.thread(start)
    return {"text": await t.gen(max_tokens=24, temperature=0), "t": t}


@wf.step
async def s2(s1: dict) -> dict:
    maybe_hang("s2"); mark("s2")
    t = s1["t"]
    t += " Then"
    return {"text": await t.gen(max_tokens=24, temperature=0), "t": t}


@wf.step
async def s3(s2: dict) -> dict:
    maybe_hang("s3"); mark("s3")
    t = s2["t"]
    t += " Later"
    return {"text": await t.gen(max_tokens=24, temperature=0), "t": t}


@wf.step
async def s4(s3: dict) -> str:
    maybe_hang("s4"); mark("s4")
    t = s3["t"]
    t += " In the end"
    await t.gen(max_tokens=16, temperature=0)
    return t.text
'''


def _texts(outputs: dict) -> dict:
    return {k: (v["text"] if isinstance(v, dict) else v) for k, v in outputs.items()}


@pytest.mark.slow
def test_sigkill_after_step_k_then_resume_matches_an_uninterrupted_run(tmp_path, stories_path, store_spec):
    wf_file = tmp_path / "chain.py"
    wf_file.write_text(CHAIN)
    db, log, ready = store_spec, tmp_path / "calls.log", tmp_path / "ready"
    common = ["--model", stories_path, "--dtype", "float32", "--input", "start=Once upon a time",
              "--no-progress"]

    ref = flowrt_cli("run", str(wf_file), "--json", *common)
    out, err = ref.communicate(timeout=300)
    assert ref.returncode == 0, err
    expected = _texts(json.loads(out)["outputs"])

    # killed mid-run: s1 and s2 finished, s3 is running
    kill_at("s3", ready, "run", str(wf_file), "--checkpoint", str(db), *common, env={"CHAIN_LOG": str(log)})
    assert log.read_text().split() == ["s1", "s2"]
    runs = open_store(db).list_runs()
    assert len(runs) == 1 and runs[0].status == "running"
    run_id = runs[0].run_id

    r = flowrt_cli("resume", run_id, "--checkpoint", str(db), "--json", "--no-progress", env={"CHAIN_LOG": str(log)})
    out, err = r.communicate(timeout=300)
    assert r.returncode == 0, err
    assert f"run {run_id} (resumed)" in err
    assert log.read_text().split() == ["s1", "s2", "s3", "s4"]    # s1, s2 were not run again
    assert _texts(json.loads(out)["outputs"]) == expected
    assert open_store(db).get_run(run_id).status == "done"

    show = flowrt_cli("runs", "show", run_id, "--checkpoint", str(db))
    out, _ = show.communicate(timeout=60)
    info = json.loads(out)
    assert info["status"] == "done" and info["outputs"]["s4"] == expected["s4"]


# ---------------------------------------------------------------------------------------------- prefix cache
PAUSED = CHAIN.replace('''    maybe_hang("s3"); mark("s3")''', '''    maybe_hang("s3"); mark("s3")
    await fr.interrupt("go on?")''')


def test_resume_recomputes_only_what_the_cache_lacks(tmp_path, stories_path):
    """Two runs paused at s3 (after s1 and s2); one resumes on the same engine (its thread's blocks are in
    the prefix cache), one on a fresh engine (cold): the warm resume's prefill is only the uncached tail."""
    from flowrt.engine import AsyncLLM
    from flowrt.graph.loader import load_workflow

    f = tmp_path / "paused.py"
    f.write_text(PAUSED)
    wf = load_workflow(f)
    db = str(tmp_path / "runs.db")
    kw = dict(model=stories_path, dtype="float32", seed=0)

    async def go() -> dict:
        e1 = AsyncLLM(**kw)
        try:
            async with fr.Runtime(e1, checkpoint=db) as rt:
                a = await rt.run(wf, start="Once upon a time")
                b = await rt.run(wf, start="Once upon a time")
                assert a.status == b.status == "interrupted"
                thread_tokens = len(a.outputs["s2"]["t"].token_ids)
                before = e1.stats()["prefill_tokens_computed"]
                warm = await rt.resume(a.run_id, workflow=wf, answer="yes")
                warm_prefill = e1.stats()["prefill_tokens_computed"] - before
        finally:
            e1.shutdown()
        e2 = AsyncLLM(**kw)
        try:
            async with fr.Runtime(e2, checkpoint=db) as rt:
                cold = await rt.resume(b.run_id, workflow=wf, answer="yes")
                cold_prefill = e2.stats()["prefill_tokens_computed"]
        finally:
            e2.shutdown()
        return dict(warm=warm, cold=cold, warm_prefill=warm_prefill, cold_prefill=cold_prefill,
                    thread_tokens=thread_tokens)

    r = anyio.run(go)
    assert r["warm"].outputs["s4"] == r["cold"].outputs["s4"]
    block = 16
    print(f"\nresume prefill: thread of {r['thread_tokens']} tokens; warm {r['warm_prefill']} tokens computed, "
          f"cold {r['cold_prefill']}")
    # cold recomputes the whole restored thread; warm only its last partial block plus the appended text
    assert r["cold_prefill"] >= r["thread_tokens"]
    assert r["warm_prefill"] <= r["cold_prefill"] - (r["thread_tokens"] // block - 1) * block


def test_many_openers_of_a_new_database_all_succeed(tmp_path):
    """Threads opening one new database at once: SQLite does not wait out a lock for the switch to WAL, which
    made some openers fail with "database is locked" (about one trial in seven with four openers)."""
    from flowrt.checkpoint.sqlite import SQLiteStore

    def opener(path, start: threading.Barrier, errors: list) -> None:
        start.wait()
        try:
            SQLiteStore(path).close()
        except BaseException as e:  # noqa: BLE001 - collected and asserted below
            errors.append(e)

    for trial in range(30):
        start, errors = threading.Barrier(6), []
        args = (tmp_path / f"new{trial}.db", start, errors)
        threads = [threading.Thread(target=opener, args=args) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
