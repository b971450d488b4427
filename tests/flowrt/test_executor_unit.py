"""The executor's run object, method by method, with plain Python steps (no engine, no runtime)."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

import flowrt as fr
from flowrt import events as ev
from flowrt.events import EventSink
from flowrt.runner.executor import StepError, WorkflowRun


def chain() -> fr.Workflow:
    wf = fr.Workflow("chain")

    @wf.step
    def a(x: int) -> int:
        return x + 1

    @wf.step
    def b(a: int, scale: int = 10) -> int:
        return a * scale

    return wf


class FakeCheckpoint:
    """Records what the run asks of its checkpoint."""

    run_id = "run-1"

    def __init__(self) -> None:
        self.saved: list[tuple[str | None, dict[str, str]]] = []
        self.recorded: dict[str, Any] = {}
        self.recorded_in: list[Any] = []   # the run states the results were recorded in

    def start(self, st: Any, scope: Any, model: Any) -> bool:
        st.outputs["a"] = 5
        st.status["a"] = "done"
        return True

    def record_output(self, st: Any, step: str, value: Any) -> None:
        self.recorded[step] = value
        self.recorded_in.append(st)

    def save(self, st: Any, step: str | None, threads: Any, at: Any = None) -> None:
        self.saved.append((step, dict((at or st).status)))


def make(wf: fr.Workflow, **kw: Any) -> tuple[WorkflowRun, list[ev.Event]]:
    seen: list[ev.Event] = []
    inputs = kw.pop("inputs", {"x": 1})
    return WorkflowRun(wf, inputs, events=EventSink(seen.append), **kw), seen


def test_readiness_waits_runs_and_skips_after_a_failure():
    wf = chain()
    run, seen = make(wf)
    assert run.readiness(wf.steps["a"]) == "run"
    assert run.readiness(wf.steps["b"]) == "wait"
    run.st.status["a"] = "failed"
    assert run.readiness(wf.steps["b"]) == "resolved"
    assert run.st.status["b"] == "skipped" and "failed step 'a'" in run.st.errors["b"].message
    assert [type(e) for e in seen] == [ev.StepSkipped]


def test_readiness_skips_a_step_whose_resource_is_missing():
    wf = fr.Workflow("res")

    @wf.step
    def ask(llm: fr.Model) -> str:
        return "never"

    run, _ = make(wf, inputs={}, resource_errors={"llm": "no engine"})
    assert run.readiness(wf.steps["ask"]) == "resolved"
    assert run.st.errors["ask"].kind == "skipped" and "no engine" in run.st.errors["ask"].message


def test_readiness_of_a_route_target_that_was_not_chosen():
    wf = fr.Workflow("pick")

    @wf.step(routes=["left", "right"])
    def choose(x: int):
        return fr.goto("left", x)

    @wf.step
    def left(choose: int) -> int:
        return choose

    @wf.step
    def right(choose: int) -> int:
        return -choose

    run, _ = make(wf)
    run.st.status["choose"] = "done"
    run.take_routes(wf.steps["choose"], fr.goto("left", 7))
    assert run.readiness(wf.steps["left"]) == "run"
    assert run.kwargs_for(wf.steps["left"]) == {"choose": 7}
    assert run.readiness(wf.steps["right"]) == "resolved"
    assert run.st.status["right"] == "not_routed" and "right" in run.st.not_routed


def test_kwargs_for_takes_results_inputs_defaults_and_resources():
    wf = chain()
    run, _ = make(wf, inputs={"x": 1, "scale": 3})
    run.st.outputs["a"] = 2
    assert run.kwargs_for(wf.steps["a"]) == {"x": 1}
    assert run.kwargs_for(wf.steps["b"]) == {"a": 2, "scale": 3}
    run.inputs = {"x": 1}
    assert run.kwargs_for(wf.steps["b"]) == {"a": 2, "scale": 10}

    wf2 = fr.Workflow("res")

    @wf2.step
    def ask(llm: fr.Model) -> str:
        return "x"

    marker = object()
    run2, _ = make(wf2, inputs={}, resources={"llm": marker})
    assert run2.kwargs_for(wf2.steps["ask"]) == {"llm": marker}


def test_take_routes_back_sets_the_loop_pending_again_and_passes_the_value():
    wf = fr.Workflow("loop")

    @wf.step
    def draft(x: int, check: int = 0) -> int:
        return x + check

    @wf.step(routes=["draft", "done"])
    def check(draft: int):
        return fr.goto("draft", draft)

    @wf.step
    def done(check: int) -> int:
        return check

    run, seen = make(wf)
    run.st.status.update(draft="done", check="done")
    run.st.visits.update(draft=1, check=1)
    kept = run.take_routes(wf.steps["check"], fr.goto("draft", 4))
    assert kept == 4
    assert run.st.status["draft"] == "pending" and run.st.status["check"] == "pending"
    assert run.st.loop_values == {"draft": {"check": 4}}
    assert run.kwargs_for(wf.steps["draft"]) == {"x": 1, "check": 4}
    assert run.st.route_log == [{"step": "check", "visit": 1, "to": ["draft"]}]
    assert isinstance(seen[-1], ev.Routed) and seen[-1].loop == ["draft"]
    with pytest.raises(ValueError, match="not one of its routes"):
        run.take_routes(wf.steps["check"], fr.goto("nowhere", 1))
    with pytest.raises(TypeError, match="must return fr.goto"):
        run.take_routes(wf.steps["check"], 3)


def test_run_step_records_the_result_and_checkpoints_it():
    wf = chain()
    cp = FakeCheckpoint()
    run, seen = make(wf, checkpoint=cp)
    run.st.status["a"] = "running"
    run.running.add("a")
    anyio.run(run.run_step, wf.steps["a"])
    assert run.st.outputs == {"a": 2} and run.st.status["a"] == "done" and run.st.visits["a"] == 1
    assert cp.recorded == {"a": 2} and cp.saved == [("a", {"a": "done", "b": "pending"})]
    assert [type(e) for e in seen] == [ev.StepStarted, ev.StepFinished]
    assert not run.running and run.changed.is_set()


def test_run_step_records_a_failure_and_the_max_visits_limit():
    wf = fr.Workflow("bad")

    @wf.step(max_visits=1)
    def boom(x: int) -> int:
        raise ValueError("no")

    run, seen = make(wf)
    anyio.run(run.run_step, wf.steps["boom"])
    err = run.st.errors["boom"]
    assert isinstance(err, StepError) and err.kind == "failed" and err.message == "ValueError: no"
    assert "Traceback" in (err.traceback or "") and isinstance(seen[-1], ev.StepFailed)
    anyio.run(run.run_step, wf.steps["boom"])
    assert "past max_visits=1" in run.st.errors["boom"].message and run.st.visits["boom"] == 1


def test_run_step_interrupt_halts_the_run():
    wf = fr.Workflow("ask")

    @wf.step
    async def review(x: int) -> int:
        return await fr.interrupt({"q": x})

    run, seen = make(wf, checkpoint=FakeCheckpoint())

    async def go() -> None:
        from flowrt.runner.interrupts import current_interrupts

        tok = current_interrupts.set(run.scope)
        try:
            await run.run_step(wf.steps["review"])
        finally:
            current_interrupts.reset(tok)

    anyio.run(go)
    assert run.halted and run.st.status["review"] == "interrupted"
    assert run.st.interrupt == {"step": "review", "index": 0, "payload": {"q": 1}}
    assert isinstance(seen[-1], ev.Interrupted) and run.status() == "interrupted"


def test_attempts_retries_then_gives_up_with_the_count():
    wf = fr.Workflow("flaky")
    calls: list[int] = []

    @wf.step(retries=2)
    def flaky(x: int) -> int:
        calls.append(x)
        if len(calls) < 3:
            raise RuntimeError("again")
        return 9

    run, _ = make(wf)
    assert anyio.run(run.attempts, wf.steps["flaky"], {"x": 1}, "flaky") == (9, 3)
    calls.clear()
    run2, _ = make(wf)
    wf.steps["flaky"].retries = 1
    with pytest.raises(RuntimeError) as info:
        anyio.run(run2.attempts, wf.steps["flaky"], {"x": 1}, "flaky")
    assert info.value.__flowrt_attempts__ == 2 and len(calls) == 2
    assert [s.args["status"] for s in run2.tracer.spans] == ["error", "error"]


def test_attempts_times_out():
    wf = fr.Workflow("slow")

    @wf.step(timeout=0.01)
    async def slow(x: int) -> int:
        await anyio.Event().wait()   # never set: only the timeout ends it
        return x

    run, _ = make(wf)
    with pytest.raises(TimeoutError, match="timed out after 0.01s"):
        anyio.run(run.attempts, wf.steps["slow"], {"x": 1}, "slow")


def test_run_mapped_keeps_order_bounds_concurrency_and_names_the_failing_item():
    wf = fr.Workflow("mapped")
    live = [0, 0]   # in flight now, most in flight

    @wf.step(map="n", max_concurrency=2)
    async def sq(n: int) -> int:
        live[0] += 1
        live[1] = max(live[1], live[0])
        await anyio.sleep(0)
        live[0] -= 1
        if n < 0:
            raise ValueError("negative")
        return n * n

    run, _ = make(wf, inputs={"n": [3, 1, 2]})
    assert anyio.run(run.run_mapped, wf.steps["sq"], {"n": [3, 1, 2, 4]}) == [9, 1, 4, 16]
    assert live[1] == 2
    with pytest.raises(ValueError) as info:
        anyio.run(run.run_mapped, wf.steps["sq"], {"n": [1, -1]})
    assert info.value.__flowrt_item__ == 1
    with pytest.raises(TypeError, match="must be a list"):
        anyio.run(run.run_mapped, wf.steps["sq"], {"n": "abc"})


def test_restore_and_the_loop_run_what_the_checkpoint_left():
    wf = chain()
    cp = FakeCheckpoint()
    run, _ = make(wf, checkpoint=cp)
    assert run.restore() is True
    anyio.run(run.run)
    assert run.st.outputs == {"a": 5, "b": 50} and run.status() == "done"
    assert [s for s, _ in cp.saved] == ["b"]   # a (restored) did not run again
    result = run.result(0.5, None)
    assert result.outputs == {"a": 5, "b": 50} and result.output == 50 and result.run_id == "run-1"


def test_start_ready_does_not_start_steps_once_halted():
    wf = chain()
    run, _ = make(wf)
    run.halted = True

    async def go() -> None:
        async with anyio.create_task_group() as tg:
            assert run.start_ready(tg) is False

    anyio.run(go)
    assert run.st.status == {"a": "pending", "b": "pending"} and not run.running




def test_a_subgraph_run_labels_its_steps_with_its_path_and_shares_the_parents_run():
    wf = chain()
    cp = FakeCheckpoint()
    parent, seen = make(wf, checkpoint=cp)
    child = WorkflowRun(wf, {"x": 1}, parent=parent, path="outer/inner")
    assert child.label("a") == "outer/inner/a" and child.root is parent
    assert child.events is parent.events and child.scope is parent.scope and child.threads is parent.threads
    child.st.status["a"] = "running"   # as start_ready leaves it
    anyio.run(child.run_step, wf.steps["a"])
    assert [(e.type, e.step) for e in seen] == [("step_started", "outer/inner/a"), ("step_finished", "outer/inner/a")]
    assert cp.recorded == {"a": 2} and cp.recorded_in == [child.st]   # in the subgraph's own state
    assert cp.saved == [("outer/inner/a", {"a": "done", "b": "pending"})]   # the subgraph's own state


def test_drop_children_forgets_the_subgraph_states_of_a_finished_step():
    parent, _ = make(chain())
    for key in ("a", "a/sub", "a[2]/sub", "ab/sub", "b/sub"):
        parent.st.children[key] = object()
    parent.drop_children("a")
    assert sorted(parent.st.children) == ["ab/sub", "b/sub"]
