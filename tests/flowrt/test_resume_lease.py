"""Issue 27 items 1-2: a run is resumed by one holder at a time. Resuming claims the run in one atomic
transition of the store (interrupted or crashed -> running, with a lease naming its holder); a second resume
is refused (RunBusyError in Python, exit 2 on the CLI, 409 over HTTP), and a dead holder's lease is taken over.

No test orders events by sleeping: the winner's step blocks on an event (or a file) that the test opens only
after the loser's refusal has come back."""

from __future__ import annotations

import asyncio
import json
import os
import queue
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

import flowrt as fr
from flowrt.checkpoint import (LeaseLostError, RunBusyError, RunCheckpoint, RunNotResumableError, SQLiteStore,
                               UnknownRunError, open_store)
from flowrt.checkpoint.lease import Renewer, holder_is_dead, live_holder
from support import flowrt_cli

WAIT_S = 120   # a guard against a hang, never an ordering


@pytest.fixture(params=["sqlite", "memory", pytest.param("postgres", marks=pytest.mark.slow)])  # a server process
def store(request, tmp_path):
    """Every store: an SQLite file, SQLite in memory, and PostgreSQL (skipped, saying why, where no server can
    run: tests/pg_server.py)."""
    spec = {"sqlite": str(tmp_path / "runs.db"), "memory": ":memory:"}.get(request.param)
    s = open_store(spec or request.getfixturevalue("pg_url"))
    yield s
    s.close()


def _crashed_run(store, run_id: str = "r1") -> None:
    """A run that was running when its process died: status running, its lease given back or run out."""
    store.create_run(run_id, "wf", {}, holder="elsewhere:1:dead", ttl=-60)
    store.save(run_id, step="a", visit=1, step_status="done", result={"json": 1}, route=None, threads=[],
               state={"status": {"a": "done"}}, run_status="running")


# ---------------------------------------------------------------------------------------------- the store
def test_claim_is_one_atomic_transition_with_one_winner(store):
    _crashed_run(store)
    rec = store.claim_run("r1", "host:1:aaaa", 60)
    assert rec.status == "running" and rec.holder == "host:1:aaaa" and rec.state == {"status": {"a": "done"}}
    with pytest.raises(RunBusyError, match="held by host:1:aaaa") as e:
        store.claim_run("r1", "host:2:bbbb", 60)
    assert e.value.holder == "host:1:aaaa"
    assert store.claim_run("r1", "host:1:aaaa", 60).holder == "host:1:aaaa"   # the holder itself may again
    with pytest.raises(UnknownRunError):
        store.claim_run("nope", "host:2:bbbb", 60)


def test_renew_release_and_a_fenced_save(store):
    _crashed_run(store)
    store.claim_run("r1", "h:1:a", 60)
    assert store.renew_lease("r1", "h:1:a", 60) and not store.renew_lease("r1", "h:2:b", 60)
    store.claim_run("r1", "h:1:a", -1)   # its lease runs out (no renewal): another holder takes the run over
    store.claim_run("r1", "h:2:b", 60)
    assert not store.renew_lease("r1", "h:1:a", 60)
    with pytest.raises(LeaseLostError, match="no longer holds it"):   # the old holder cannot write any more
        store.save("r1", step="b", visit=1, step_status="done", result=None, route=None, threads=[], state={},
                   run_status="running", holder="h:1:a")
    assert store.get_run("r1").checkpoints == 1
    store.release_run("r1", "h:1:a")       # not the holder: no effect
    assert store.get_run("r1").holder == "h:2:b"
    store.save("r1", step=None, visit=0, step_status="done", result=None, route=None, threads=[], state={},
               run_status="done", holder="h:2:b")   # the last save gives the lease back
    rec = store.get_run("r1")
    assert rec.status == "done" and rec.holder is None
    with pytest.raises(RunNotResumableError, match="already finished"):
        store.claim_run("r1", "h:3:c", 60)


def test_a_lost_lease_names_who_took_the_run_over(store):
    """Issue 39 item 13: also once the new holder has finished and given the run back."""
    _crashed_run(store)
    store.claim_run("r1", "h:1:a", -1)   # its lease ran out (a SIGSTOP past the lease)
    store.claim_run("r1", "h:2:b", 60)
    with pytest.raises(LeaseLostError, match=r"\(h:2:b took it over after its lease ran out\)"):
        store.save("r1", step="b", visit=1, step_status="done", result=None, route=None, threads=[], state={},
                   run_status="running", holder="h:1:a")
    store.save("r1", step=None, visit=0, step_status="done", result=None, route=None, threads=[], state={},
               run_status="done", holder="h:2:b")
    assert store.get_run("r1").holder is None and not store.renew_lease("r1", "h:2:b", 60)
    with pytest.raises(LeaseLostError, match=r"h:2:b took it over .*, and has given it back since \(the run is done"):
        store.save("r1", step="b", visit=1, step_status="done", result=None, route=None, threads=[], state={},
                   run_status="running", holder="h:1:a")
    store.create_run("r2", "wf", {}, holder="h:1:a", ttl=60)
    store.release_run("r2", "h:1:a")
    with pytest.raises(LeaseLostError, match="no one holds it now"):   # given back by itself: no one took it
        store.save("r2", step="b", visit=1, step_status="done", result=None, route=None, threads=[], state={},
                   run_status="running", holder="h:1:a")
    rec = RunCheckpoint.resume(store, "r2")   # a lease given back is free
    assert store.get_run("r2").holder == rec.holder


def test_an_answer_claims_only_an_interrupted_run(store):
    _crashed_run(store)
    with pytest.raises(RunNotResumableError, match="not waiting for an answer"):
        store.claim_run("r1", "h:1:a", 60, waiting=True)
    assert store.get_run("r1").status == "running" and store.get_run("r1").holder == "elsewhere:1:dead"


def test_an_expired_lease_of_a_dead_holder_is_taken_over(store):
    _crashed_run(store)                      # another host's holder whose lease ran out
    run = RunCheckpoint.resume(store, "r1")
    assert store.get_run("r1").holder == run.holder

    # on this host a dead holder is seen at once, before its lease runs out
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_holder = f"{socket.gethostname()}:{int(dead.stdout)}:cafe"
    alive_holder = f"{socket.gethostname()}:{os.getppid()}:beef"
    assert holder_is_dead(dead_holder) and not holder_is_dead(alive_holder)
    assert not holder_is_dead(f"another-host:{int(dead.stdout)}:cafe")
    store.create_run("r2", "wf", {}, holder=alive_holder, ttl=60)
    with pytest.raises(RunBusyError, match=alive_holder):
        RunCheckpoint.resume(store, "r2")
    store.create_run("r3", "wf", {}, holder=dead_holder, ttl=60)
    assert live_holder(store.get_run("r3")) is None
    run = RunCheckpoint.resume(store, "r3")
    assert store.get_run("r3").holder == run.holder != dead_holder


def test_a_zombie_holder_is_dead(store):
    """Issue 39 item 14: right after a kill -9, the holder's pid exists until its parent reaps it (state Z)."""
    child = subprocess.Popen(["true"])
    try:
        deadline = time.monotonic() + WAIT_S
        while open(f"/proc/{child.pid}/stat").read().rpartition(")")[2].split()[0] != "Z":
            assert time.monotonic() < deadline, "the child never exited"
            time.sleep(0.01)
        zombie = f"{socket.gethostname()}:{child.pid}:dead"
        assert holder_is_dead(zombie)
        store.create_run("r1", "wf", {}, holder=zombie, ttl=60)
        run = RunCheckpoint.resume(store, "r1")   # taken over at once, not refused as "held by"
        assert store.get_run("r1").holder == run.holder != zombie
    finally:
        child.wait()


def test_the_renewer_renews_until_the_lease_is_lost():
    calls = []

    class Store:
        def renew_lease(self, run_id: str, holder: str, ttl: float) -> bool:
            calls.append((run_id, holder, ttl))
            return len(calls) < 2          # the second renewal finds the run taken over

    renewer = Renewer()
    renewer.hold(Store(), "r1", "h:1:a", 0.03)
    thread = renewer._thread
    thread.join(WAIT_S)                    # with no lease left to renew, its thread ends
    assert not thread.is_alive() and calls == [("r1", "h:1:a", 0.03)] * 2 and not renewer._held


def test_runs_list_and_show_name_a_live_holder(tmp_path, capsys):
    from flowrt.cli.commands import main

    db = str(tmp_path / "runs.db")
    store = SQLiteStore(db)
    alive = f"{socket.gethostname()}:{os.getppid()}:beef"
    store.create_run("held", "wf", {}, holder=alive, ttl=60)
    store.create_run("crashed", "wf", {}, holder="elsewhere:1:dead", ttl=-60)
    store.close()
    assert main(["runs", "list", "--checkpoint", db]) == 0
    lines = {ln.split()[0]: ln for ln in capsys.readouterr().out.splitlines()}
    assert lines["held"].endswith(f"held by {alive}") and "held by" not in lines["crashed"]
    assert main(["runs", "show", "crashed", "--checkpoint", db]) == 0
    assert json.loads(capsys.readouterr().out)["holder"] is None
    assert main(["resume", "held", "--checkpoint", db]) == 2   # refused before anything loads
    assert f"run held is held by {alive}" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- Python
def _chain(calls: list[str], gate: asyncio.Event, started: asyncio.Event | None = None) -> fr.Workflow:
    """first -> slow -> last. ``slow`` blocks until ``gate`` opens (the first run: forever, it is cancelled)."""
    wf = fr.Workflow("chain")

    @wf.step
    def first() -> int:
        calls.append("first")
        return 1

    @wf.step
    async def slow(first: int) -> int:
        calls.append("slow-start")
        if started is not None and not started.is_set():
            started.set()
            await asyncio.Event().wait()   # the "crash": cancelled here
        await asyncio.wait_for(gate.wait(), WAIT_S)
        calls.append("slow-end")
        return 2

    @wf.step
    def last(slow: int) -> int:
        calls.append("last")
        return 3

    return wf


async def _refused_opens(gate: asyncio.Event, coro) -> object:
    """``coro``'s result; when it is refused, open ``gate`` (the winner's step waits on it)."""
    try:
        return await coro
    except BaseException:
        gate.set()
        raise


def test_gather_two_resumes_of_a_crashed_run(tmp_path):
    calls: list[str] = []

    async def go():
        gate, started = asyncio.Event(), asyncio.Event()
        wf = _chain(calls, gate, started)
        async with fr.Runtime(checkpoint=str(tmp_path / "runs.db")) as rt:
            task = asyncio.create_task(rt.run(wf))
            await started.wait()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            (crashed,) = rt.checkpointer.list_runs()
            assert crashed.status == "running" and live_holder(crashed) is None
            results = await asyncio.gather(_refused_opens(gate, rt.resume(crashed.run_id, workflow=wf)),
                                           _refused_opens(gate, rt.resume(crashed.run_id, workflow=wf)),
                                           return_exceptions=True)
            return crashed.run_id, results, rt.checkpointer.history(crashed.run_id)

    run_id, results, history = asyncio.run(go())
    done = [r for r in results if isinstance(r, fr.RunResult)]
    refused = [r for r in results if isinstance(r, BaseException)]
    assert len(done) == 1 and len(refused) == 1, results
    assert done[0].status == "done" and done[0].outputs["last"] == 3
    assert isinstance(refused[0], RunBusyError)
    assert f"run {run_id} is held by {socket.gethostname()}:" in str(refused[0])
    assert calls == ["first", "slow-start", "slow-start", "slow-end", "last"]
    assert [h["step"] for h in history] == ["first", "slow", "last", None]


def _approval(calls: list[str], gate: asyncio.Event) -> fr.Workflow:
    wf = fr.Workflow("approve")

    @wf.step
    async def ask() -> str:
        return await fr.interrupt("yes or no?")

    @wf.step
    async def act(ask: str) -> str:
        calls.append(f"act:{ask}")
        await asyncio.wait_for(gate.wait(), WAIT_S)
        return f"did {ask}"

    return wf


def test_gather_two_answers_to_one_interrupt(tmp_path):
    calls: list[str] = []

    async def go():
        gate = asyncio.Event()
        wf = _approval(calls, gate)
        async with fr.Runtime(checkpoint=str(tmp_path / "runs.db")) as rt:
            r = await rt.run(wf)
            assert r.status == "interrupted"
            return await asyncio.gather(_refused_opens(gate, rt.resume(r.run_id, answer="A", workflow=wf)),
                                        _refused_opens(gate, rt.resume(r.run_id, answer="B", workflow=wf)),
                                        return_exceptions=True)

    results = asyncio.run(go())
    done = [r for r in results if isinstance(r, fr.RunResult)]
    refused = [r for r in results if isinstance(r, BaseException)]
    assert len(done) == 1 and isinstance(refused[0], RunBusyError), results
    assert calls == [f"act:{done[0].outputs['ask']}"] and done[0].outputs["act"] == f"did {done[0].outputs['ask']}"


def test_a_running_run_holds_its_lease(tmp_path):
    async def go():
        gate, started = asyncio.Event(), asyncio.Event()
        wf = _chain([], gate)

        @wf.step
        async def watch(first: int) -> int:
            started.set()
            await asyncio.wait_for(gate.wait(), WAIT_S)
            return 0

        async with fr.Runtime(checkpoint=str(tmp_path / "runs.db")) as rt:
            task = asyncio.create_task(rt.run(wf))
            await started.wait()
            (rec,) = rt.checkpointer.list_runs()
            holder = live_holder(rec)
            assert holder and holder.startswith(f"{socket.gethostname()}:{os.getpid()}:")
            with pytest.raises(RunBusyError, match=holder):
                await rt.resume(rec.run_id, workflow=wf)
            gate.set()
            result = await task
            assert result.ok and rt.checkpointer.get_run(rec.run_id).holder is None

    asyncio.run(go())


def test_a_run_taken_over_stops_at_its_next_checkpoint(tmp_path):
    calls: list[str] = []

    async def go():
        stolen, started = asyncio.Event(), asyncio.Event()
        wf = fr.Workflow("stolen")

        @wf.step
        async def a() -> int:
            started.set()
            await asyncio.wait_for(stolen.wait(), WAIT_S)
            return 1

        @wf.step
        def b(a: int) -> int:
            calls.append("b")
            return 2

        async with fr.Runtime(checkpoint=str(tmp_path / "runs.db")) as rt:
            task = asyncio.create_task(rt.run(wf))
            await started.wait()
            (rec,) = rt.checkpointer.list_runs()
            rt.checkpointer.claim_run(rec.run_id, "thief:1:x", 60, take_over=rec.holder)   # as after an expiry
            stolen.set()
            with pytest.raises(LeaseLostError, match="thief:1:x took it over"):
                await task
            assert rt.checkpointer.get_run(rec.run_id).holder == "thief:1:x"
            assert rt.checkpointer.get_run(rec.run_id).checkpoints == 0   # nothing written after the takeover

    asyncio.run(go())
    assert calls == []


# ---------------------------------------------------------------------------------------------- CLI
CHAIN_FILE = '''
import os, pathlib, sys, time
import flowrt as fr

GATE = pathlib.Path(os.environ["LEASE_GATE"])
wf = fr.Workflow("ck")


def mark(what):
    with open(os.environ["LEASE_LOG"], "a") as f:
        f.write(what + "\\n")


@wf.step
def first() -> int:
    mark("first")
    return 1


@wf.step
def slow(first: int) -> int:
    mark("slow-start")
    print("slow-start", file=sys.stderr, flush=True)
    deadline = time.monotonic() + float(os.environ["LEASE_WAIT_S"])
    while not GATE.exists():     # blocks until the test creates the gate file
        assert time.monotonic() < deadline, "the gate never opened"
        time.sleep(0.02)
    mark("slow-end")
    return 2


@wf.step
def last(slow: int) -> int:
    mark("last")
    return 3
'''


@pytest.mark.slow   # three CLI processes, each loading the engine's option list (torch): ~15 s on 2 cores
def test_two_cli_resumes_of_a_killed_run(tmp_path):
    f = tmp_path / "ck.py"
    f.write_text(CHAIN_FILE)
    db, log, gate = tmp_path / "ck.db", tmp_path / "steps.log", tmp_path / "gate"
    env = {"LEASE_LOG": str(log), "LEASE_GATE": str(gate), "LEASE_WAIT_S": str(WAIT_S)}
    p = flowrt_cli("run", str(f), "--checkpoint", str(db), "--no-progress", env=env)
    for line in p.stderr:            # blocks until the step says it started (or the process ends)
        if line.strip() == "slow-start":
            break
    else:
        pytest.fail(f"the run ended before its slow step: {p.wait()}")
    p.kill()                          # SIGKILL mid-step
    p.wait()
    (rec,) = SQLiteStore(db, readonly=True).list_runs()
    assert rec.status == "running"

    done: queue.Queue = queue.Queue()
    resumes = [flowrt_cli("resume", rec.run_id, "--checkpoint", str(db), "--no-progress", env=env) for _ in range(2)]
    try:
        def finish(r: subprocess.Popen) -> None:
            _, err = r.communicate()
            done.put((r.returncode, err))

        for r in resumes:
            threading.Thread(target=finish, args=(r,), daemon=True).start()
        code, err = done.get(timeout=WAIT_S)   # the loser: the winner waits on the gate until it is refused
        assert code == 2, err
        assert f"run {rec.run_id} is held by {socket.gethostname()}:" in err
        gate.touch()
        code, err = done.get(timeout=WAIT_S)
        assert code == 0, err
    finally:
        for r in resumes:
            r.kill()
    assert log.read_text().split() == ["first", "slow-start", "slow-start", "slow-end", "last"]
    store = SQLiteStore(db, readonly=True)
    assert [h["step"] for h in store.history(rec.run_id)] == ["first", "slow", "last", None]
    assert store.get_run(rec.run_id).status == "done"


# ---------------------------------------------------------------------------------------------- HTTP
class _NoEngine:
    """The server's engine, for workflows of plain Python steps (no model)."""

    def stats(self) -> dict:
        return {}


@pytest.fixture
def approval_server(request):
    """A server of workflow ``agent`` (ask: interrupts; act: waits on ``srv.gate``), its runs checkpointed in
    memory, or in the database given as the fixture's parameter."""
    from flowrt.server.app import create_app
    from flowrt.server.background import BackgroundServer

    gate, calls = threading.Event(), []
    wf = fr.Workflow("agent")

    @wf.step
    async def ask() -> str:
        return await fr.interrupt("yes or no?")

    @wf.step
    def act(ask: str) -> str:
        calls.append(ask)
        assert gate.wait(WAIT_S)
        return f"did {ask}"

    db = getattr(request, "param", None)
    rt = fr.Runtime(checkpoint=str(request.getfixturevalue("tmp_path") / db) if db else ":memory:")   # no model
    srv = BackgroundServer(create_app(_NoEngine(), workflows={"agent": wf}, workflow_runtime=rt)).start()
    srv.gate, srv.calls = gate, calls
    try:
        yield srv
    finally:
        gate.set()
        srv.stop()


def test_two_http_resumes_with_different_answers(approval_server):
    url = approval_server.url + "/v1/workflows/agent/runs"
    rid = httpx.post(url, json={"inputs": {}}, timeout=WAIT_S).json()["run_id"]
    done: queue.Queue = queue.Queue()

    def resume(answer: str) -> None:
        done.put(httpx.post(f"{url}/{rid}/resume", json={"answer": answer}, timeout=WAIT_S))

    for answer in ("yes", "no"):
        threading.Thread(target=resume, args=(answer,), daemon=True).start()
    refused = done.get(timeout=WAIT_S)     # the winner waits on the gate until the loser is answered
    assert refused.status_code == 409, refused.text
    assert f"run {rid} is held by {socket.gethostname()}:" in refused.json()["error"]["message"]
    approval_server.gate.set()
    ok = done.get(timeout=WAIT_S)
    assert ok.status_code == 200, ok.text
    (answer,) = approval_server.calls
    assert ok.json()["outputs"] == {"ask": answer, "act": f"did {answer}"}


def test_http_resume_of_an_interrupted_run_needs_an_answer(approval_server):
    """Item 4: ``{}`` used to resume with ``answer = null``."""
    url = approval_server.url + "/v1/workflows/agent/runs"
    rid = httpx.post(url, json={"inputs": {}}, timeout=WAIT_S).json()["run_id"]
    r = httpx.post(f"{url}/{rid}/resume", json={}, timeout=WAIT_S)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "answer" and "answer" in r.json()["error"]["message"]
    assert approval_server.calls == []
    approval_server.gate.set()
    r = httpx.post(f"{url}/{rid}/resume", json={"answer": None}, timeout=WAIT_S)   # null, said explicitly
    assert r.status_code == 200 and r.json()["outputs"]["act"] == "did None"


@pytest.mark.parametrize("approval_server", ["crashed.db"], indirect=True)
def test_http_resume_of_a_crashed_run_needs_no_answer(approval_server):
    store = approval_server.app.state.flowrt.workflow_runtime.checkpointer
    store.create_run("c1", "agent", {}, holder="elsewhere:1:dead", ttl=-60)   # its server died, its lease ran out
    url = approval_server.url + "/v1/workflows/agent/runs/c1/resume"
    r = httpx.post(url, json={"answer": "yes"}, timeout=WAIT_S)
    assert r.status_code == 409 and "not waiting for an answer" in r.json()["error"]["message"]
    r = httpx.post(url, json={}, timeout=WAIT_S)
    assert r.status_code == 200 and r.json()["status"] == "interrupted", r.text
