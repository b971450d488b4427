"""Issue 34 item 3, nested fork: ``rt.fork(run_id, at="outer/inner")`` and ``flowrt runs fork RUN_ID --at
outer/inner`` re-run a step inside a subgraph step (at any depth) and what depends on it, inside and outside;
the subgraph's other steps keep their results."""

from __future__ import annotations

import anyio
import pytest

import flowrt as fr
from flowrt.checkpoint import CheckpointError
from flowrt.cli.commands import main

CALLS: list[str] = []


def _workflows() -> fr.Workflow:
    inner = fr.Workflow("inner")

    @inner.step
    def a(x: int) -> int:
        CALLS.append("a")
        return x + 1

    @inner.step
    def b(a: int, k: int = 1) -> int:
        CALLS.append("b")
        return a * k

    @inner.step
    def c(b: int) -> int:
        CALLS.append("c")
        return b + 100

    mid = fr.Workflow("mid")

    @mid.step
    def m(x: int) -> int:
        CALLS.append("m")
        return x * 2

    mid.step(inner, name="deep")

    top = fr.Workflow("top")

    @top.step
    def x(n: int) -> int:
        CALLS.append("x")
        return n

    top.step(inner, name="outer")
    top.step(mid, name="two", output="deep")

    @top.step
    def report(outer: int, two: int) -> str:
        CALLS.append("report")
        return f"{outer} {two}"

    return top


def test_fork_inside_a_subgraph_reruns_the_step_and_its_downstream_only(tmp_path):
    wf = _workflows()

    async def go() -> list:
        async with fr.Runtime(checkpoint=str(tmp_path / "runs.db")) as rt:
            first = await rt.run(wf, n=1, k=2)
            CALLS.clear()
            one = await rt.fork(first.run_id, at="outer/b", workflow=wf, k=10)
            calls_one = sorted(CALLS)
            CALLS.clear()
            two = await rt.fork(first.run_id, at="two/deep/b", workflow=wf, k=3)
            return [first, one, calls_one, two, sorted(CALLS)]

    first, one, calls_one, two, calls_two = anyio.run(go)
    assert first.outputs["report"] == "104 104"         # (1 + 1) * 2 + 100, twice
    assert one.status == "done" and one.outputs["outer"] == 120 and one.outputs["report"] == "120 104"
    # outer's b and c ran again, its a kept its result; report ran again, x and the other subgraph did not
    assert calls_one == ["b", "c", "report"]
    assert two.outputs["two"] == 106 and two.outputs["report"] == "104 106"
    assert calls_two == ["b", "c", "report"]            # two's m and deep's a kept


def test_nested_fork_errors_name_the_problem(tmp_path):
    wf = _workflows()

    async def go() -> None:
        async with fr.Runtime(checkpoint=str(tmp_path / "runs.db")) as rt:
            r = await rt.run(wf, n=1)
            with pytest.raises(CheckpointError, match="step 'x' of workflow 'top' runs no subgraph"):
                await rt.fork(r.run_id, at="x/a", workflow=wf)
            with pytest.raises(CheckpointError, match="workflow 'inner' has no step 'z'"):
                await rt.fork(r.run_id, at="outer/z", workflow=wf)

    anyio.run(go)


def test_cli_forks_inside_a_subgraph(tmp_path, capsys):
    f = tmp_path / "nested.py"
    f.write_text("import sys\nsys.path.insert(0, %r)\nfrom test_fork_nested import _workflows\nwf = _workflows()\n"
                 % str(__import__("pathlib").Path(__file__).parent))
    db = str(tmp_path / "runs.db")
    assert main(["run", str(f), "--input", "n=1", "--input", "k=2", "--checkpoint", db, "--no-progress"]) == 0
    capsys.readouterr()
    from flowrt.checkpoint import open_store

    run_id = open_store(db).list_runs()[0].run_id
    code = main(["runs", "fork", run_id, "--at", "outer/b", "--input", "k=10", "--checkpoint", db, "--json",
                 "--no-progress"])
    out = capsys.readouterr().out
    assert code == 0 and '"report": "120 104"' in out
