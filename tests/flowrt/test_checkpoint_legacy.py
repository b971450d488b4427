"""Issue 35 item 1: checkpoints written before the run state was typed (no format version; subgraph states
flat by path) still load, resume and fork. ``fixtures/legacy_runs.db`` was written by ``write_fixture``
on main at ecabb8b (``python tests/flowrt/test_checkpoint_legacy.py``): one run waiting at four interrupts
(two inside subgraphs, two inside subgraphs of subgraphs), after a loop route, with a failed step."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import anyio
import pytest

import flowrt as fr
from flowrt.checkpoint import open_store
from flowrt.checkpoint.state_codec import VERSION

FIXTURE = Path(__file__).parent / "fixtures" / "legacy_runs.db"
RUN_ID = "legacy00run00001"
PATHS = ["rev/legal", "rev/tech", "second/outer/inner/review/legal", "second/outer/inner/review/tech"]

CALLS: list[str] = []
FAIL = {"flaky": False}

review = fr.Workflow("review")


@review.step
async def legal(doc: str) -> str:
    CALLS.append("legal")
    return f"legal: {await fr.interrupt({'ask': 'legal ok?', 'doc': doc})}"


@review.step
async def tech(doc: str) -> str:
    CALLS.append("tech")
    return f"tech: {await fr.interrupt({'ask': 'tech ok?', 'doc': doc})}"


@review.step
def verdict(legal: str, tech: str) -> str:
    CALLS.append("verdict")
    return f"{legal}; {tech}"


outer = fr.Workflow("outer")


@outer.step
async def inner(doc: str) -> str:
    return await fr.subflow(review, doc=doc + "2")


wf = fr.Workflow("legacy")


@wf.step(routes=["tool", "doc"])
def agent(name: str, tool: list | None = None) -> fr.Goto:
    CALLS.append("agent")
    seen = tool or []
    return fr.goto("doc", "+".join(seen)) if len(seen) >= 2 else fr.goto("tool", seen)


@wf.step(routes=["agent"])
def tool(agent: list) -> fr.Goto:
    CALLS.append("tool")
    return fr.goto("agent", agent + [f"t{len(agent)}"])


@wf.step
def doc(agent: str, name: str) -> str:
    CALLS.append("doc")
    return name.upper()


wf.step(review, name="rev")


@wf.step
async def second(doc: str) -> str:
    return await fr.subflow(outer, doc=doc)


@wf.step
def flaky(doc: str, agent: str) -> tuple:
    CALLS.append("flaky")
    if FAIL["flaky"]:
        raise RuntimeError("flaky failed")
    return (agent, len(doc))


@wf.step
def report(rev: str, second: str, flaky: tuple) -> str:
    return f"{rev} | {second} | {flaky[0]}"


def write_fixture(db: Path) -> None:
    """The fixture's run, as the code of the day checkpoints it."""
    from flowrt.checkpoint import RunCheckpoint
    from flowrt.runner.executor import execute

    FAIL["flaky"] = True
    store = open_store(str(db))
    cp = RunCheckpoint.new(store, wf.name, {"name": "d"}, run_id=RUN_ID)
    try:
        with cp.held():
            r = anyio.run(lambda: execute(wf, {"name": "d"}, checkpoint=cp))
    finally:
        FAIL["flaky"] = False
        store.close()   # the database in one file (its write-ahead log merged)
    assert r.status == "interrupted" and sorted(i["step"] for i in r.interrupts) == PATHS, r
    assert r.errors["flaky"].kind == "failed"


def copy(tmp_path: Path) -> str:
    db = tmp_path / "runs.db"
    shutil.copy(FIXTURE, db)
    return str(db)


@pytest.fixture(params=["ecabb8b", "today"])
def db(request, tmp_path) -> str:
    """The run, as main at ecabb8b checkpointed it (the fixture) or as this code does."""
    if request.param == "ecabb8b":
        return copy(tmp_path)
    write_fixture(tmp_path / "runs.db")
    return str(tmp_path / "runs.db")


def test_the_run_resumes_with_its_subgraph_states_and_answers(db):
    CALLS.clear()

    async def go() -> list:
        async with fr.Runtime(checkpoint=db) as rt:
            r2 = await rt.resume(RUN_ID, answers={"rev/tech": "fine", PATHS[2]: "ok2"}, workflow=wf)
            r3 = await rt.resume(RUN_ID, answers={"rev/legal": "signed", PATHS[3]: "fine2"}, workflow=wf)
            return [r2, r3]

    r2, r3 = anyio.run(go)
    assert r2.status == "interrupted" and sorted(i["step"] for i in r2.interrupts) == ["rev/legal", PATHS[3]]
    assert r2.outputs["flaky"] == ("t0+t1", 1) and "flaky" not in r2.errors   # the failed step ran again
    assert r3.status == "done", r3.errors
    assert r3.outputs["report"] == "legal: signed; tech: fine | legal: ok2; tech: fine2 | t0+t1"
    assert r3.visits == {"agent": 3, "tool": 2, "flaky": 2}
    assert [x["to"] for x in r3.routes] == [["tool"], ["agent"]] * 2 + [["doc"]]
    # the loop and doc finished before the checkpoint: not run again; each resume re-ran the waiting steps only
    assert "agent" not in CALLS and "tool" not in CALLS and "doc" not in CALLS
    assert CALLS.count("legal") == CALLS.count("tech") == 2 + 1 and CALLS.count("flaky") == 1


def test_a_legacy_run_forks_and_keeps_its_subgraph_states(tmp_path):
    db = copy(tmp_path)
    CALLS.clear()

    async def go() -> fr.RunResult:
        async with fr.Runtime(checkpoint=db) as rt:
            return await rt.fork(RUN_ID, at="flaky", workflow=wf)

    r = anyio.run(go)
    assert r.status == "interrupted" and sorted(i["step"] for i in r.interrupts) == PATHS
    assert {i["step"]: i["payload"]["doc"] for i in r.interrupts} == dict(zip(PATHS, ["D", "D", "D2", "D2"]))
    state = open_store(db).get_run(r.run_id).state
    assert state["version"] == VERSION and set(state["subruns"]) == {"rev", "second/outer"}   # now nested
    assert r.outputs["flaky"] == ("t0+t1", 1) and sorted(set(CALLS)) == ["flaky", "legal", "tech"]   # upstream: kept


def test_the_fixture_is_in_the_old_form_and_a_run_of_today_writes_the_current_one(tmp_path):
    (tmp_path / "old").mkdir()
    old = open_store(copy(tmp_path / "old"), readonly=True).get_run(RUN_ID).state   # opening it adds files
    assert "version" not in old and "second/outer/inner/review" in old["subruns"]   # version 1: flat
    write_fixture(tmp_path / "runs.db")
    new = open_store(str(tmp_path / "runs.db")).get_run(RUN_ID).state
    assert new["version"] == VERSION and set(new["subruns"]) == {"rev", "second/outer"}
    inner = new["subruns"]["second/outer"]["subruns"]["inner/review"]
    assert inner["status"] == {"legal": "interrupted", "tech": "interrupted", "verdict": "pending"}
    # the rest of the form is version 1's
    assert {k: v for k, v in new.items() if k not in ("version", "subruns", "timings", "errors")} == \
        {k: v for k, v in old.items() if k not in ("subruns", "timings", "errors")}
    assert new["subruns"]["rev"].keys() == old["subruns"]["rev"].keys()


if __name__ == "__main__":   # writes the fixture (on the code of the day: see the module's docstring)
    sys.path.insert(0, str(Path(__file__).parent))
    FIXTURE.parent.mkdir(exist_ok=True)
    FIXTURE.unlink(missing_ok=True)
    write_fixture(FIXTURE)
