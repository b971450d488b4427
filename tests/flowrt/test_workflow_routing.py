"""Conditional routing (fr.goto), skipped branches, bounded loops and how graphs draw routes."""

from __future__ import annotations

import pytest

import flowrt as fr
from flowrt.graph.workflow import WorkflowError
from support import ROOT


def agent_loop(max_visits: int = 25, done_after: int = 3) -> fr.Workflow:
    wf = fr.Workflow("agent")

    @wf.step(routes=["tool", "answer"], max_visits=max_visits)
    def agent(question: str, tool: list | None = None) -> fr.Goto:
        seen = tool or []
        if len(seen) >= done_after:
            return fr.goto("answer", f"{question}: {'+'.join(seen)}")
        return fr.goto("tool", seen)

    @wf.step(routes=["agent"])
    def tool(agent: list) -> fr.Goto:
        return fr.goto("agent", agent + [f"call{len(agent)}"])

    @wf.step
    def answer(agent: str) -> str:
        return agent.upper()

    return wf


def test_agent_loop_calls_tool_until_done():
    r = agent_loop().run(question="q")
    assert r.ok and r.status == "done"
    assert r.outputs["answer"] == "Q: CALL0+CALL1+CALL2"
    assert r.output == "Q: CALL0+CALL1+CALL2"         # the only sink: tool routes, so it is none
    assert r.visits == {"agent": 4, "tool": 3}
    assert [x["to"] for x in r.routes] == [["tool"], ["agent"]] * 3 + [["answer"]]
    assert r.skipped == {} and r.errors == {}


def test_loop_past_max_visits_is_a_clear_error():
    r = agent_loop(max_visits=3, done_after=10).run(question="q")
    assert not r.ok
    msg = r.errors["agent"].message
    assert "max_visits=3" in msg and "4th time" in msg
    assert r.errors["answer"].kind == "skipped"


def test_unchosen_branch_is_skipped_not_failed_and_joins_take_defaults():
    wf = fr.Workflow("branch")

    @wf.step(routes=["small", "big"])
    def classify(n: int) -> fr.Goto:
        return fr.goto("big" if n > 10 else "small", n)

    @wf.step
    def small(classify: int) -> str:
        return f"small {classify}"

    @wf.step
    def big(classify: int) -> str:
        return f"big {classify}"

    @wf.step
    def after_big(big: str) -> str:
        return big + "!"

    @wf.step
    def join(small: str | None = None, big: str | None = None) -> str:
        return small or big or ""

    r = wf.run(n=3)
    assert r.ok and r.status == "done"
    assert r.outputs == {"classify": 3, "small": "small 3", "join": "small 3"}
    assert set(r.skipped) == {"big", "after_big"}
    assert "not routed" in r.skipped["big"].message
    assert r.errors == {}
    d = r.to_dict()
    assert set(d["skipped"]) == {"big", "after_big"} and d["errors"] == {}
    r = wf.run(n=30)
    assert r.outputs["after_big"] == "big 30!" and set(r.skipped) == {"small"}


def test_fan_out_to_several_routes():
    wf = fr.Workflow("fan")

    @wf.step(routes=["a", "b", "c"])
    def pick() -> list:
        return [fr.goto("a", 1), fr.goto("c", 3)]

    @wf.step
    def a(pick: int) -> int:
        return pick * 10

    @wf.step
    def b(pick: int) -> int:
        return pick * 10

    @wf.step
    def c(pick: int) -> int:
        return pick * 10

    r = wf.run()
    assert r.outputs == {"pick": [1, 3], "a": 10, "c": 30} and set(r.skipped) == {"b"}


def test_bad_routes_are_errors():
    wf = fr.Workflow("bad")

    @wf.step(routes=["nowhere"])
    def a() -> fr.Goto:
        return fr.goto("nowhere")

    with pytest.raises(WorkflowError, match="route 'nowhere' is not a step"):
        wf.validate()
    with pytest.raises(WorkflowError, match="not a step name"):
        wf.step(lambda: 1, name="b", routes=["not a name"])
    with pytest.raises(WorkflowError, match="max_visits"):
        wf.step(lambda: 1, name="c", max_visits=0)

    wf2 = fr.Workflow("wrong")

    @wf2.step(routes=["x"])
    def r1() -> str:
        return fr.goto("y")

    @wf2.step
    def x(r1: str) -> str:
        return r1

    @wf2.step
    def y() -> str:
        return "y"

    res = wf2.run()
    assert "not one of its routes" in res.errors["r1"].message
    assert res.errors["x"].kind == "skipped"


def test_loop_value_parameter_needs_a_default():
    wf = fr.Workflow("nodefault")

    @wf.step(routes=["b"])
    def a(b: int) -> fr.Goto:
        return fr.goto("b", 1)

    with pytest.raises(WorkflowError, match="give it a default"):
        @wf.step(routes=["a"])
        def b(a: int) -> fr.Goto:
            return fr.goto("a", a)


def test_graphs_draw_conditional_edges_dashed():
    wf = agent_loop()
    text = wf.render("text")
    assert "agent -.-> tool" in text and "agent -.-> answer" in text and "tool -.-> agent (loop)" in text
    mer = wf.render("mermaid")
    assert "agent -. route .-> tool" in mer and "tool -. loop .-> agent" in mer
    dot = wf.render("dot")
    assert '"agent" -> "tool" [style=dashed, label="route"]' in dot
    assert '"tool" -> "agent" [style=dashed, label="loop"' in dot


def test_cli_graph_shows_routes(tmp_path, capsys):
    from flowrt.cli.commands import main

    f = tmp_path / "wf.py"
    f.write_text("import flowrt as fr\nwf = fr.Workflow('r')\n"
                 "@wf.step(routes=['b'])\ndef a():\n    return fr.goto('b', 1)\n"
                 "@wf.step\ndef b(a: int) -> int:\n    return a\n")
    assert main(["graph", str(f), "--format", "mermaid"]) == 0
    assert "a -. route .-> b" in capsys.readouterr().out


def test_workflow_without_routes_is_unchanged():
    wf = fr.Workflow("plain")

    @wf.step
    def a(x: int) -> int:
        return x + 1

    @wf.step
    def b(a: int) -> int:
        return a * 2

    r = wf.run(x=1)
    assert r.outputs == {"a": 2, "b": 4} and r.status == "done" and r.routes == [] and r.skipped == {}
    assert set(r.to_dict()) == {"outputs", "errors", "stats"}
    assert "steps_not_routed" not in r.stats


def test_readme_routed_agent_loop_runs_as_is(tmp_path, stories_path):
    """The README's routing block: the agent loops through the tool twice, then interrupts for approval;
    resuming with "yes" sends the thought."""
    import re

    import anyio

    from flowrt.engine import AsyncLLM
    from flowrt.graph.loader import load_workflow

    text = (ROOT / "README.md").read_text()
    start = text.index("## Routing, checkpoints, interrupts and streaming")
    src = re.search(r"```python\n(.*?)```", text[start:], re.S).group(1)
    f = tmp_path / "agent.py"
    f.write_text(src)
    wf = load_workflow(f)
    assert "tool -.-> agent (loop)" in wf.render("text")

    async def go() -> tuple:
        eng = AsyncLLM(model=stories_path, dtype="float32", seed=0, num_kv_blocks=256)
        try:
            async with fr.Runtime(eng, checkpoint=str(tmp_path / "runs.db")) as rt:
                r1 = await rt.run(wf, question="Who wrote Dune?")
                r2 = await rt.resume(r1.run_id, answer="yes")
                return r1, r2
        finally:
            eng.shutdown()

    r1, r2 = anyio.run(go)
    assert r1.status == "interrupted" and r1.interrupt["payload"]["question"] == "send it?"
    assert r1.visits.get("tool", 1) <= 2 and r1.visits.get("agent", 1) <= 3
    assert r2.status == "done" and r2.output == r1.interrupt["payload"]["draft"]


def test_a_step_not_routed_in_an_early_pass_is_not_shown_skipped_later():
    import anyio

    wf = fr.Workflow("loop-then-ask")

    @wf.step(routes=["tool", "ask"])
    def agent(tool: int = 0) -> fr.Goto:
        return fr.goto("ask", tool) if tool >= 2 else fr.goto("tool", tool)

    @wf.step(routes=["agent"])
    def tool(agent: int) -> fr.Goto:
        return fr.goto("agent", agent + 1)

    @wf.step
    async def ask(agent: int) -> str:
        return await fr.interrupt(agent)   # not routed on passes 1-2, routed (and waiting) on pass 3

    async def go() -> fr.RunResult:
        async with fr.Runtime(checkpoint=":memory:") as rt:
            return await rt.run(wf)

    r = anyio.run(go)
    assert r.status == "interrupted" and r.interrupt["payload"] == 2 and r.skipped == {}
