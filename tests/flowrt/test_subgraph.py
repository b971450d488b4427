"""Subgraphs: a workflow as a step of another (``wf.step(sub)``) and ``fr.subflow`` inside a step. Their
steps run inside the parent run: events and traces carry the path, checkpoints nest (a resume continues
inside the subgraph), an interrupt inside pauses the parent (resumed in Python, from the CLI and over HTTP),
and ``flowrt graph`` draws the subgraph as a cluster."""

from __future__ import annotations

import json
import textwrap

import anyio
import httpx
import pytest

import flowrt as fr
from flowrt.cli.commands import EXIT_INTERRUPTED, main

SUBGRAPH_FILE = textwrap.dedent('''
    import flowrt as fr

    CALLS = []

    research = fr.Workflow("research")

    @research.step
    def search(topic: str) -> list:
        CALLS.append("search")
        return [topic, topic + "!"]

    @research.step
    async def pick(search: list) -> str:
        CALLS.append("pick")
        answer = await fr.interrupt({"options": search})
        return search[int(answer)]

    wf = fr.Workflow("report")

    @wf.step
    def topic(q: str) -> str:
        CALLS.append("topic")
        return q.upper()

    wf.step(research, name="findings")

    @wf.step
    def write(findings: str) -> str:
        CALLS.append("write")
        return "about " + findings
''')


def load(tmp_path):
    f = tmp_path / "report.py"
    f.write_text(SUBGRAPH_FILE)
    from flowrt.graph.loader import load_workflow

    wf = load_workflow(str(f))
    calls = wf.steps["topic"].fn.__globals__["CALLS"]
    return str(f), wf, calls


def test_subgraph_result_inputs_and_event_paths(tmp_path):
    _, wf, calls = load(tmp_path)

    async def go():
        seen = []
        async with fr.Runtime(checkpoint=":memory:") as rt:
            async for e in rt.stream(wf, q="kv"):
                seen.append(e)
            r1 = e.result
            r2 = await rt.resume(r1.run_id, answer="1", workflow=wf)
            history = rt.checkpointer.history(r1.run_id)
        return seen, r1, r2, history

    seen, r1, r2, history = anyio.run(go)
    steps = [(e.type, e.step) for e in seen if hasattr(e, "step")]
    assert steps == [("step_started", "topic"), ("step_finished", "topic"), ("step_started", "findings"),
                     ("step_started", "findings/search"), ("step_finished", "findings/search"),
                     ("step_started", "findings/pick"), ("interrupted", "findings/pick")]
    assert r1.status == "interrupted" and r1.interrupt["step"] == "findings/pick"
    assert r1.interrupt["payload"] == {"options": ["KV", "KV!"]}
    assert r2.status == "done" and r2.outputs == {"topic": "KV", "findings": "KV!", "write": "about KV!"}
    # the resume continued inside the subgraph: search ran once, pick again (it restarts with its answer)
    assert calls == ["topic", "search", "pick", "pick", "write"]
    assert [h["step"] for h in history if h["step"]] == ["topic", "findings/search", "findings/pick", "findings",
                                                         "findings/pick", "findings", "write"]
    spans = {s.name for s in r2.tracer.spans}
    assert {"findings", "findings/pick"} <= spans


class Crash(BaseException):
    """Stands for the process dying mid-step (no checkpoint is written for the step)."""


def leaves(e: BaseException) -> list[type]:
    if hasattr(e, "exceptions"):   # an exception group (the run's task groups wrap what escapes them)
        return [t for x in e.exceptions for t in leaves(x)]
    return [type(e)]


def test_a_resume_after_a_crash_continues_inside_the_subgraph(tmp_path):
    db = str(tmp_path / "runs.db")
    calls: list[str] = []
    crash = {"on": True}
    inner = fr.Workflow("inner")

    @inner.step
    def fetch(x: int) -> int:
        calls.append("fetch")
        return x + 1

    @inner.step
    def digest(fetch: int) -> int:
        calls.append("digest")
        if crash["on"]:
            raise Crash()
        return fetch * 10

    outer = fr.Workflow("outer")
    outer.step(inner, name="sub")

    @outer.step
    def done(sub: int) -> str:
        calls.append("done")
        return f"got {sub}"

    async def go():
        async with fr.Runtime(checkpoint=db) as rt:
            with pytest.raises(BaseException) as info:
                await rt.run(outer, x=1)
            assert leaves(info.value) == [Crash]
            (run,) = rt.checkpointer.list_runs()
            crash["on"] = False
            return await rt.resume(run.run_id, workflow=outer)

    r = anyio.run(go)
    assert r.status == "done" and r.outputs == {"sub": 20, "done": "got 20"}
    assert calls == ["fetch", "digest", "digest", "done"]   # fetch (inside the subgraph) did not run again


def test_subgraph_failure_fails_the_step_with_the_inner_path():
    inner = fr.Workflow("inner")

    @inner.step
    def boom(x: int) -> int:
        raise ValueError("bad x")

    outer = fr.Workflow("outer")
    outer.step(inner, name="sub")
    r = outer.run(x=1)
    assert r.status == "failed" and "'sub/boom' failed: ValueError: bad x" in r.errors["sub"].message


def test_output_names_the_result_and_bad_subgraphs_are_refused():
    inner = fr.Workflow("inner")

    @inner.step
    def a(x: int, scale: int = 2) -> int:
        return x * scale

    @inner.step
    def b(x: int) -> int:
        return -x

    outer = fr.Workflow("outer")
    with pytest.raises(fr.WorkflowError, match="2 final steps"):
        outer.step(inner, name="sub")
    with pytest.raises(fr.WorkflowError, match="output='zz' is not one of its steps"):
        outer.step(inner, name="sub", output="zz")
    outer.step(inner, name="sub", output="a")
    assert outer.inputs["scale"].required is False and outer.inputs["x"].required is True
    assert outer.run(x=3).outputs == {"sub": 6}
    assert outer.run(x=3, scale=5).outputs == {"sub": 15}


def test_subflow_runs_a_variable_number_of_subagents_and_resumes_inside_them():
    calls: list[str] = []
    agent = fr.Workflow("agent")

    @agent.step
    def look(q: str) -> str:
        calls.append(f"look {q}")
        return q * 2

    @agent.step
    async def check(look: str) -> str:
        if look == "bb":
            ok = await fr.interrupt(f"keep {look}?")
            return look if ok == "yes" else "-"
        return look

    wf = fr.Workflow("fanout")

    @wf.step
    async def plan(qs: list) -> list:
        return await fr.gather(*(fr.subflow(agent, q=q) for q in qs))

    async def go():
        seen = []
        async with fr.Runtime(checkpoint=":memory:") as rt:
            r1 = await rt.run(wf, qs=["a", "b", "c"])
            async for e in rt.stream(wf, qs=["a"]):
                seen.append(e)
            r2 = await rt.resume(r1.run_id, answer="yes", workflow=wf)
        return r1, r2, seen

    r1, r2, seen = anyio.run(go)
    assert r1.status == "interrupted" and r1.interrupt["step"] == "plan/agent#2/check"
    assert r2.outputs == {"plan": ["aa", "bb", "cc"]}
    started = [e.step for e in seen if e.type == "step_started"]
    assert started == ["plan", "plan/agent/look", "plan/agent/check"]
    # on resume the plan step ran again, but each sub-agent continued from its checkpoint: no look ran twice
    assert sorted(calls) == ["look a", "look a", "look b", "look c"]   # the second "look a" is the stream run


def test_subflow_outside_a_step_is_a_clear_error():
    with pytest.raises(RuntimeError, match="inside a workflow step"):
        anyio.run(lambda: fr.subflow(fr.Workflow("x")))


def test_graph_draws_the_subgraph_as_a_cluster(tmp_path, capsys):
    f, wf, _ = load(tmp_path)
    text = wf.render("text")
    assert "findings (subgraph research)  <- topic" in text and "    |   pick (async)  <- search" in text
    mer = wf.render("mermaid")
    assert 'subgraph findings["findings (subgraph research)"]' in mer
    assert "topic --> findings__search" in mer and "findings__pick --> write" in mer
    dot = wf.render("dot")
    assert 'subgraph "cluster_findings" {' in dot and '"findings/pick" -> "write";' in dot
    assert main(["graph", f, "--format", "dot"]) == 0
    assert '"topic" -> "findings/search";' in capsys.readouterr().out


def test_cli_resumes_an_interrupt_inside_a_subgraph(tmp_path, capsys):
    f, _, _ = load(tmp_path)
    db = str(tmp_path / "runs.db")
    code = main(["run", f, "--input", "q=kv", "--checkpoint", db, "--no-progress"])
    out, err = capsys.readouterr()
    assert code == EXIT_INTERRUPTED
    assert json.loads(out[out.index("{"):]) == {"options": ["KV", "KV!"]}
    run_id = err.split("flowrt run: run ")[1].split(";")[0]
    code = main(["resume", run_id, "--checkpoint", db, "--answer", "0", "--json", "--no-progress"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert json.loads(out)["outputs"] == {"topic": "KV", "findings": "KV", "write": "about KV"}


def test_http_resumes_an_interrupt_inside_a_subgraph(tmp_path):
    from support import STORIES, serve_model

    from flowrt.server.workflows import load_workflows

    f, _, _ = load(tmp_path)
    for srv in serve_model(STORIES, workflows=load_workflows([f])):
        url = srv.url + "/v1/workflows/report/runs"
        body = httpx.post(url, json={"inputs": {"q": "kv"}}, timeout=60).json()
        assert body["status"] == "interrupted" and body["interrupt"]["step"] == "findings/pick"
        r = httpx.post(f"{url}/{body['run_id']}/resume", json={"answer": "1"}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["outputs"] == {"topic": "KV", "findings": "KV!", "write": "about KV!"}


def test_a_subgraph_inside_a_subgraph_interrupts_and_resumes_at_depth_two():
    calls: list[str] = []
    leaf = fr.Workflow("leaf")

    @leaf.step
    def l1(m1: int) -> int:
        calls.append("l1")
        return m1 + 1

    @leaf.step
    async def l2(l1: int) -> int:
        calls.append("l2")
        return l1 * int(await fr.interrupt("factor?"))

    mid = fr.Workflow("mid")

    @mid.step
    def m1(x: int) -> int:
        calls.append("m1")
        return x * 10

    mid.step(leaf, name="deep")
    top = fr.Workflow("top")
    top.step(mid, name="outer")

    async def go():
        async with fr.Runtime(checkpoint=":memory:") as rt:
            r1 = await rt.run(top, x=1)
            return r1, await rt.resume(r1.run_id, answer="3", workflow=top)

    r1, r2 = anyio.run(go)
    assert r1.interrupt["step"] == "outer/deep/l2" and r2.outputs == {"outer": 33}
    assert calls == ["m1", "l1", "l2", "l2"]
    dot = top.render("dot")
    assert 'subgraph "cluster_outer/deep" {' in dot and '"outer/m1" -> "outer/deep/l1";' in dot
