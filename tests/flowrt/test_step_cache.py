"""Issue 34 item 5, the step result cache: ``@wf.step(cache=fr.Cache(ttl=..., key=...))`` keeps a step's result in
the checkpoint store, keyed by workflow, step, a hash of its inputs and (steps that use the model) the model's
fingerprint; a later run with the same inputs, in any process using the store, takes it without running the
step. Hits and misses are in the stats, the trace and the progress display; ``--no-cache`` /
``fr.Runtime(cache=False)`` bypass it; a failure is never kept."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import types

import anyio
import pytest

import flowrt as fr
from flowrt.cli.commands import main
from flowrt.graph.loader import load_workflow
from support import ROOT, STORIES, flowrt_cli

CALLS: list[str] = []


def _workflow() -> fr.Workflow:
    wf = fr.Workflow("cached")

    @wf.step(cache=fr.Cache(ttl=60))
    def double(x: int) -> int:
        CALLS.append(f"double {x}")
        return 2 * x

    @wf.step(cache=fr.Cache(key=lambda q: q.strip().lower()))
    def shout(q: str = "hi") -> str:
        CALLS.append(f"shout {q}")
        return q.upper()

    @wf.step
    def total(double: int, shout: str) -> str:
        CALLS.append("total")
        return f"{double} {shout}"

    return wf


def _run(db, wf, cache: bool = True, **inputs) -> fr.RunResult:
    async def go():
        async with fr.Runtime(checkpoint=db, cache=cache) as rt:   # a runtime, and a store connection, per run
            return await rt.run(wf, **inputs)

    return anyio.run(go)


@pytest.fixture(autouse=True)
def _clear():
    CALLS.clear()


@pytest.fixture
def clock(monkeypatch):
    """The step cache's clock, moved by hand (``clock.now``)."""
    from flowrt.runner import step_cache

    clock = types.SimpleNamespace(now=1_000_000.0)
    monkeypatch.setattr(step_cache, "time", types.SimpleNamespace(time=lambda: clock.now))
    return clock


def test_a_hit_takes_the_kept_result_without_running_the_step(tmp_path, clock):
    db, wf = str(tmp_path / "runs.db"), _workflow()
    first = _run(db, wf, x=3, q="Hi")
    assert first.outputs["total"] == "6 HI" and CALLS == ["double 3", "shout Hi", "total"]
    assert (first.stats["run"]["cache_hits"], first.stats["run"]["cache_misses"]) == (0, 2)
    CALLS.clear()
    again = _run(db, wf, x=3, q="  hI ")   # key=: the same key for this q
    assert again.outputs == {"double": 6, "shout": "HI", "total": "6 HI"} and CALLS == ["total"]
    assert (again.stats["run_cache_hits"], again.stats["run_cache_misses"]) == (2, 0)
    CALLS.clear()
    other = _run(db, wf, x=4, q="hi")   # different inputs: a miss
    assert other.outputs["double"] == 8 and CALLS == ["double 4", "total"]
    assert (other.stats["run_cache_hits"], other.stats["run_cache_misses"]) == (1, 1)


def test_a_result_expires_after_its_ttl(tmp_path, clock):
    db, wf = str(tmp_path / "runs.db"), _workflow()
    _run(db, wf, x=1)
    clock.now += 59.9
    CALLS.clear()
    _run(db, wf, x=1)
    assert CALLS == ["total"]   # both still kept (shout has no TTL)
    clock.now += 0.2   # 60.1 s after double's result was kept
    CALLS.clear()
    late = _run(db, wf, x=1)
    assert CALLS == ["double 1", "total"] and late.stats["run_cache_misses"] == 1
    CALLS.clear()
    _run(db, wf, x=1)
    assert CALLS == ["total"]   # kept again, from the new run


def test_a_failure_is_never_kept(tmp_path):
    wf = fr.Workflow("flaky")
    fail = [True]

    @wf.step(cache=fr.Cache())
    def flaky(x: int) -> int:
        CALLS.append("flaky")
        if fail[0]:
            raise RuntimeError("not today")
        return x

    db = str(tmp_path / "runs.db")
    assert "not today" in _run(db, wf, x=1).errors["flaky"].message
    assert "not today" in _run(db, wf, x=1).errors["flaky"].message   # not kept: it ran (and failed) again
    fail[0] = False
    assert _run(db, wf, x=1).outputs["flaky"] == 1
    assert _run(db, wf, x=1).outputs["flaky"] == 1
    assert CALLS == ["flaky"] * 3


def test_no_cache_runs_every_step_and_keeps_nothing(tmp_path, capsys):
    db, wf = str(tmp_path / "runs.db"), _workflow()
    off = _run(db, wf, cache=False, x=5)
    assert "run_cache_hits" not in off.stats and "cache_hits" not in off.stats["run"]
    CALLS.clear()
    assert _run(db, wf, x=5).stats["run_cache_misses"] == 2   # nothing was kept
    f = tmp_path / "wf.py"
    f.write_text(textwrap.dedent('''
        import flowrt as fr

        wf = fr.Workflow("cli")

        @wf.step(cache=fr.Cache())
        def double(x: int) -> int:
            return 2 * x
    '''))
    cli = ["run", str(f), "--input", "x=2", "--checkpoint", db, "--json"]
    for argv, hits in ((cli, 0), (cli, 1), (cli + ["--no-cache"], None)):
        capsys.readouterr()
        assert main(argv) == 0
        stats = json.loads(capsys.readouterr().out)["stats"]
        assert stats.get("run_cache_hits") == hits
    capsys.readouterr()
    assert main(cli[:-1]) == 0
    err = capsys.readouterr().err
    assert "1 step done, 1 from the step cache, 0 missed" in err
    rid = err.split("flowrt run: run ")[1].split(";")[0]
    fork = ["runs", "fork", rid, "--at", "double", "--checkpoint", db, "--json"]
    for argv, hits in ((fork, 1), (fork + ["--no-cache"], None)):   # resume and runs fork take --no-cache too
        capsys.readouterr()
        assert main(argv) == 0
        assert json.loads(capsys.readouterr().out)["stats"].get("run_cache_hits") == hits


@pytest.mark.slow   # a server process
def test_serve_no_cache(tmp_path):
    import httpx

    f, log, db = tmp_path / "wf.py", tmp_path / "calls.log", str(tmp_path / "runs.db")
    f.write_text(textwrap.dedent(f'''
        import flowrt as fr

        wf = fr.Workflow("kept")

        @wf.step(cache=fr.Cache())
        def double(x: int) -> int:
            with open({str(log)!r}, "a") as f:
                f.write("double\\n")
            return 2 * x
    '''))
    assert _run(db, load_workflow(str(f)), x=1).stats["run_cache_misses"] == 1   # kept
    for flags, calls in (([], 1), (["--no-cache"], 2)):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        p = flowrt_cli("serve", "--model", str(STORIES), "--dtype", "float32", "--port", str(port), "--workflow",
                       str(f), "--checkpoint", db, *flags)
        try:
            deadline = time.time() + 120
            while True:
                assert p.poll() is None and time.time() < deadline, p.communicate()
                try:
                    httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
                    break
                except httpx.HTTPError:
                    time.sleep(0.2)
            r = httpx.post(f"http://127.0.0.1:{port}/v1/workflows/kept/runs", json={"inputs": {"x": 1}}, timeout=60)
            assert r.status_code == 200 and r.json()["outputs"] == {"double": 2}
            assert r.json()["stats"].get("run_cache_hits") == (None if flags else 1)
        finally:
            p.send_signal(signal.SIGTERM)
            p.communicate(timeout=60)
        assert log.read_text().split() == ["double"] * calls


def test_a_step_that_asked_for_an_answer_is_not_kept(tmp_path):
    wf = fr.Workflow("ask")

    @wf.step(cache=fr.Cache())
    async def ask(q: str) -> str:
        return await fr.interrupt(q)

    db = str(tmp_path / "runs.db")

    async def go():
        async with fr.Runtime(checkpoint=db) as rt:
            first = await rt.run(wf, q="ok?")
            assert first.interrupted
            done = await rt.resume(first.run_id, answer="yes", workflow=wf)
            assert done.outputs["ask"] == "yes"
            return await rt.run(wf, q="ok?")   # its result came from the answer: asked again

    assert anyio.run(go).interrupted


def test_definition_errors_name_the_step():
    wf = fr.Workflow("bad")
    with pytest.raises(fr.WorkflowError, match="step 'r': a routing step cannot be cached"):
        wf.step(lambda: fr.goto("s", 1), name="r", routes=["s"], cache=fr.Cache())
    with pytest.raises(fr.WorkflowError, match=r"step 'x': cache= takes an fr.Cache"):
        wf.step(lambda: 1, name="x", cache=3600)
    with pytest.raises(ValueError, match="positive number of seconds"):
        fr.Cache(ttl=0)
    with pytest.raises(TypeError, match="must be a function"):
        fr.Cache(key="q")


def test_trace_and_progress_show_hits_and_misses(tmp_path):
    from rich.console import Console

    from flowrt.cli.progress import ProgressDisplay
    from flowrt.runner.executor import RunObserver

    db, wf = str(tmp_path / "runs.db"), _workflow()
    _run(db, wf, x=1)

    async def go(observer):
        async with fr.Runtime(checkpoint=db) as rt:
            return await rt.execute(wf, {"x": 1, "q": "new"}, observer=observer)

    observer = RunObserver(wf)
    result = anyio.run(go, observer)
    lookups = {s.name: s.args["result"] for s in result.tracer.spans if s.cat == "cache"}
    assert lookups == {"double": "hit", "shout": "miss"}
    assert [s.args["status"] for s in result.tracer.step_spans() if s.name == "double"] == ["cached"]
    chrome = result.tracer.to_chrome()["traceEvents"]
    assert {"name": "process_name", "ph": "M", "pid": 3, "tid": 0, "args": {"name": "step cache"}} in chrome
    console = Console(record=True, width=100)
    console.print(ProgressDisplay(observer, dict, console=console).render())
    text = console.export_text()
    assert "1 cached" in text
    assert [line.split()[-1] for line in text.splitlines() if line.split()[1:2] in (["double"], ["shout"])] == \
        ["cached", "miss"]


def test_a_step_that_uses_the_model_is_keyed_by_its_fingerprint(tmp_path, engine, monkeypatch):
    wf = fr.Workflow("gen")

    @wf.step(cache=fr.Cache())
    async def story(start: str, llm: fr.Model) -> str:
        return await llm.thread(start).gen(max_tokens=6, temperature=0)

    db = str(tmp_path / "runs.db")

    async def go():
        async with fr.Runtime(model=engine, checkpoint=db) as rt:
            return await rt.run(wf, start="Once upon a time")

    first, again = anyio.run(go), anyio.run(go)
    assert first.stats["run_llm_calls"] == 1 and again.stats["run_llm_calls"] == 0
    assert again.outputs == first.outputs and again.stats["run_cache_hits"] == 1
    monkeypatch.setattr(engine, "kv_fingerprint", lambda: "another model")
    other = anyio.run(go)
    assert other.stats["run_llm_calls"] == 1 and other.stats["run_cache_misses"] == 1


# ---------------------------------------------------------------------------------------------- two processes
CHILD = textwrap.dedent('''
    """A process running the workflow of STEP_CACHE_WF for each x given, printing each result as a JSON line."""
    import json, sys

    import anyio
    import flowrt as fr
    from flowrt.graph.loader import load_workflow

    wf = load_workflow(sys.argv[1])

    async def go():
        async with fr.Runtime(checkpoint=sys.argv[2]) as rt:
            for x in sys.argv[3:]:
                print(json.dumps((await rt.run(wf, x=int(x))).to_dict()), flush=True)

    anyio.run(go)
''')

WORKFLOW = textwrap.dedent('''
    import os

    import flowrt as fr

    wf = fr.Workflow("shared")
    LOG = os.environ["STEP_CACHE_LOG"]


    def called(what):
        with open(LOG, "a") as f:
            f.write(what + "\\n")


    @wf.step(cache=fr.Cache())
    def double(x: int) -> int:
        called(f"double {x}")
        return 2 * x


    @wf.step(cache=fr.Cache(ttl=1.0))
    def brief(x: int) -> int:
        called(f"brief {x}")
        return x + 1


    @wf.step(cache=fr.Cache())
    def flaky(x: int) -> int:
        called(f"flaky {x}")
        if os.path.exists(os.environ["STEP_CACHE_FAIL"]):
            raise RuntimeError("flag is up")
        return -x
''')


@pytest.mark.slow   # two Python processes
def test_the_step_cache_is_shared_between_processes(tmp_path, store_spec):
    (tmp_path / "child.py").write_text(CHILD)
    (tmp_path / "shared.py").write_text(WORKFLOW)
    log, flag = tmp_path / "calls.log", tmp_path / "fail"
    env = {**os.environ, "STEP_CACHE_LOG": str(log), "STEP_CACHE_FAIL": str(flag),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}

    def process(*xs: int) -> list[dict]:
        out = subprocess.run([sys.executable, str(tmp_path / "child.py"), str(tmp_path / "shared.py"), store_spec,
                              *map(str, xs)], env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        return [json.loads(line) for line in out.stdout.splitlines()]

    def calls() -> list[str]:
        text = log.read_text() if log.exists() else ""
        log.write_text("")
        return text.splitlines()

    flag.touch()
    (first,) = process(1)
    kept = time.time()
    assert first["errors"]["flaky"].startswith("RuntimeError: flag is up")
    # the three steps are independent and run concurrently: their calls are compared as a set
    assert sorted(calls()) == ["brief 1", "double 1", "flaky 1"] and first["stats"]["run_cache_misses"] == 3
    flag.unlink()
    time.sleep(max(0.0, kept + 1.1 - time.time()))   # brief's TTL (1 s) has run out
    same, other, again = process(1, 2, 1)
    # double: kept by the first process; brief: expired; flaky: its failure was not kept, it ran again
    assert same["outputs"] == {"double": 2, "brief": 2, "flaky": -1} and same["errors"] == {}
    assert (same["stats"]["run_cache_hits"], same["stats"]["run_cache_misses"]) == (1, 2)
    assert other["outputs"] == {"double": 4, "brief": 3, "flaky": -2} and other["stats"]["run_cache_hits"] == 0
    assert again["outputs"] == same["outputs"] and again["stats"]["run_cache_hits"] == 3
    assert sorted(calls()) == ["brief 1", "brief 2", "double 2", "flaky 1", "flaky 2"]
