"""Time travel: ``flowrt runs history`` lists a run's checkpoints, ``flowrt runs fork RUN --at STEP`` /
``rt.fork(run_id, at=...)`` start a new run from the state before STEP with changed inputs: STEP and its
downstream steps run again, nothing upstream; on a warm engine the restored threads' KV comes from the
prefix cache, so the fork computes no prefill for the unchanged prefix."""

from __future__ import annotations

import json
import textwrap

import anyio
import pytest

import flowrt as fr
from flowrt.checkpoint import CheckpointError
from flowrt.checkpoint.fork import fork_state
from flowrt.cli.commands import main
from support import load_workflow_source

PIPELINE = textwrap.dedent('''
    import flowrt as fr

    CALLS = []
    wf = fr.Workflow("pipeline")

    @wf.step
    def load(n: int) -> list:
        CALLS.append("load")
        return list(range(n))

    @wf.step
    def side(load: list) -> int:
        CALLS.append("side")
        return len(load)

    @wf.step
    def scale(load: list, factor: int = 2) -> list:
        CALLS.append("scale")
        return [x * factor for x in load]

    @wf.step
    def total(scale: list, side: int) -> int:
        CALLS.append("total")
        return sum(scale) + side
''')


def load(tmp_path):
    return load_workflow_source(tmp_path, "pipeline.py", PIPELINE, "load")


def test_fork_reruns_the_step_and_downstream_only(tmp_path):
    _, wf, calls = load(tmp_path)
    db = str(tmp_path / "runs.db")

    async def go():
        async with fr.Runtime(checkpoint=db) as rt:
            first = await rt.run(wf, n=4)
            calls.clear()
            forked = await rt.fork(first.run_id, at="scale", workflow=wf, factor=10)
            again = await rt.fork(forked.run_id, at="scale", workflow=wf)   # a fork of a fork
            source = rt.checkpointer.get_run(first.run_id)
            return first, forked, again, source, rt.checkpointer.get_run(forked.run_id)

    first, forked, again, source, record = anyio.run(go)
    assert first.outputs == {"load": [0, 1, 2, 3], "side": 4, "scale": [0, 2, 4, 6], "total": 16}
    assert forked.status == "done" and forked.run_id != first.run_id
    assert forked.outputs == {"load": [0, 1, 2, 3], "side": 4, "scale": [0, 10, 20, 30], "total": 64}
    assert again.outputs["total"] == 64
    assert calls == ["scale", "total", "scale", "total"]       # load and side (upstream, parallel) never again
    assert record.inputs == {"n": 4, "factor": 10} and record.meta["forked_from"]["run_id"] == first.run_id
    assert source.status == "done" and source.inputs == {"n": 4}   # the source run is unchanged


def test_fork_errors_name_the_problem(tmp_path):
    _, wf, _ = load(tmp_path)

    async def go():
        async with fr.Runtime(checkpoint=":memory:") as rt:
            r = await rt.run(wf, n=2)
            with pytest.raises(CheckpointError, match="no step 'nope' to fork at"):
                await rt.fork(r.run_id, at="nope", workflow=wf)
            with pytest.raises(fr.WorkflowError, match="unknown input"):
                await rt.fork(r.run_id, at="scale", workflow=wf, bogus=1)
            with pytest.raises(CheckpointError):
                await rt.fork("missing", at="scale", workflow=wf)

    anyio.run(go)


def test_fork_state_drops_route_choices_loop_values_and_answers_downstream():
    wf = fr.Workflow("loop")

    @wf.step
    def a(x: int) -> int:
        return x

    @wf.step(routes=["b", "c"])
    def b(a: int, c: int = 0):
        return fr.goto("c", a)

    @wf.step(routes=["b"])
    def c(b: int):
        return fr.goto("b", b)

    state = {"status": {"a": "done", "b": "done", "c": "done"}, "visits": {"a": 1, "b": 2, "c": 2},
             "outputs": {"a": {"json": 1}, "b": {"json": 1}, "c": {"json": 1}}, "errors": {}, "not_routed": {},
             "chosen": {"b": {"c": {"json": 1}}}, "loop_values": {"b": {"c": {"json": 1}}},
             "routes": [{"step": "b", "visit": 1, "to": ["c"]}, {"step": "c", "visit": 1, "to": ["b"]}],
             "timings": {"a": 0.1, "b": 0.1, "c": 0.1}, "interrupt": {"step": "c", "index": 0, "payload": None},
             "answers": {"c": ["yes"], "a": ["kept"]}}
    out = fork_state(state, wf, "b")
    assert out["status"] == {"a": "done", "b": "pending", "c": "pending"}
    assert out["visits"] == {"a": 1, "b": 0, "c": 0} and out["outputs"] == {"a": {"json": 1}}
    assert out["chosen"] == {} and out["loop_values"] == {} and out["routes"] == []
    assert out["answers"] == {"a": ["kept"]} and out["interrupt"] is None
    assert state["status"]["b"] == "done"   # the source state is not changed


def test_cli_history_and_fork(tmp_path, capsys):
    f, _, _ = load(tmp_path)
    db = str(tmp_path / "runs.db")
    assert main(["run", f, "--input", "n=3", "--checkpoint", db, "--no-progress", "--json"]) == 0
    run_id = capsys.readouterr().err.split("flowrt run: run ")[1].split(";")[0]

    assert main(["runs", "history", run_id, "--checkpoint", db]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert [r.split()[3] for r in rows] == ["load", "side", "scale", "total", "(run)"]
    assert rows[2].endswith("scale  done  [0, 2, 4]")   # columns as wide as their widest cell
    assert rows[3].split()[4:] == ["done", "9"]

    assert main(["runs", "fork", run_id, "--at", "scale", "--input", "factor=5", "--checkpoint", db,
                 "--no-progress"]) == 0
    out, err = capsys.readouterr()
    new_id = out.strip().splitlines()[-1]
    assert new_id != run_id and f"flowrt runs fork: run {new_id} (forked)" in err
    assert main(["runs", "show", new_id, "--checkpoint", db]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["outputs"]["total"] == 18 and info["inputs"] == {"n": 3, "factor": 5}
    assert [s["step"] for s in info["steps"] if s["step"]] == ["scale", "total"]

    assert main(["runs", "fork", run_id, "--at", "nope", "--checkpoint", db, "--no-progress"]) == 2
    assert "no step 'nope' to fork at" in capsys.readouterr().err
    assert main(["runs", "fork", run_id, "--checkpoint", db]) == 2
    assert "which run and step" in capsys.readouterr().err


CHAIN = textwrap.dedent('''
    import flowrt as fr

    CALLS = []
    wf = fr.Workflow("chain")

    @wf.step
    async def s1(start: str, llm: fr.Model) -> dict:
        CALLS.append("s1")
        t = llm.thread(start)
        return {"text": await t.gen(max_tokens=40, temperature=0), "t": t}

    @wf.step
    async def s2(s1: dict) -> dict:
        CALLS.append("s2")
        t = s1["t"] + " Then"
        return {"text": await t.gen(max_tokens=40, temperature=0), "t": t}

    @wf.step
    async def s3(s2: dict, twist: str = " Later") -> dict:
        CALLS.append("s3")
        t = s2["t"] + twist
        return {"text": await t.gen(max_tokens=16, temperature=0), "t": t}

    @wf.step
    async def s4(s3: dict) -> str:
        CALLS.append("s4")
        t = s3["t"] + " In the end"
        return await t.gen(max_tokens=8, temperature=0)
''')


def test_warm_fork_at_a_middle_step_computes_no_prefill_for_the_prefix(tmp_path, stories_path):
    from flowrt.engine import AsyncLLM
    from flowrt.graph.loader import load_workflow

    f = tmp_path / "chain.py"
    f.write_text(CHAIN)
    wf = load_workflow(str(f))
    calls = wf.steps["s1"].fn.__globals__["CALLS"]

    async def go():
        engine = AsyncLLM(model=stories_path, dtype="float32", seed=0)
        try:
            async with fr.Runtime(engine, checkpoint=str(tmp_path / "runs.db")) as rt:
                first = await rt.run(wf, start="Once upon a time")
                prefix = len(first.outputs["s2"]["t"].token_ids)
                calls.clear()
                before = engine.stats()
                forked = await rt.fork(first.run_id, at="s3", workflow=wf, twist=" Suddenly")
                after = engine.stats()
        finally:
            engine.shutdown()
        return first, forked, prefix, before, after

    first, forked, prefix, before, after = anyio.run(go)
    assert forked.status == "done" and calls == ["s3", "s4"]
    assert forked.outputs["s1"]["text"] == first.outputs["s1"]["text"]
    assert forked.outputs["s3"]["text"] != first.outputs["s3"]["text"]
    computed = after["prefill_tokens_computed"] - before["prefill_tokens_computed"]
    run = forked.stats["run"]
    # s3 and s4 prefill only their own text (" Suddenly", s3's output, " In the end") and at most the last
    # partial block of the restored s2 thread; the prefix of `prefix` tokens comes from the cache
    added = len(forked.outputs["s3"]["t"].token_ids) - prefix + 8
    print(f"\nfork prefill: prefix {prefix} tokens, computed {computed}, run cached {run['cached_tokens']}")
    assert computed <= added + 16
    assert run["cached_tokens"] >= prefix - 16
