"""Typed workflow inputs: validated and converted from the step annotations before anything loads;
``wf.run`` inside a running event loop says to use ``wf.arun``."""

from __future__ import annotations

import asyncio

import anyio
import pytest

import flowrt as fr
from flowrt.graph.workflow import WorkflowError


class RecordingProvider:
    """A resource provider that records what was asked for (nothing may load before inputs are valid)."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    async def get_resource(self, name: str):
        self.asked.append(name)
        return object()


def typed_workflow() -> fr.Workflow:
    wf = fr.Workflow("typed")

    @wf.step
    def agent(max_turns: int, llm, name: str | None = None, tags: list[str] = []) -> dict:  # noqa: B006
        return {"max_turns": max_turns, "name": name, "tags": tags}

    @wf.step(map="scores")
    def double(scores: float) -> float:
        return 2 * scores

    return wf


def test_bad_typed_input_names_input_and_type_before_resources_load():
    wf = typed_workflow()
    provider = RecordingProvider()
    with pytest.raises(WorkflowError) as e:
        anyio.run(lambda: fr.Runtime(resources={"llm": object()}).run(wf, max_turns="abc", scores=[]))
    msg = str(e.value)
    assert "input 'max_turns' must be int" in msg and "step 'agent'" in msg and "'abc'" in msg
    from flowrt.runner.executor import execute

    with pytest.raises(WorkflowError, match="input 'tags' must be list\\[str\\]"):
        anyio.run(lambda: execute(wf, {"max_turns": 1, "tags": [1], "scores": []}, provider))
    with pytest.raises(WorkflowError, match="input 'scores' must be list\\[float\\] \\(step 'double'\\)"):
        anyio.run(lambda: execute(wf, {"max_turns": 1, "scores": "x"}, provider))
    assert provider.asked == []  # nothing loaded


def test_typed_inputs_are_converted_for_run_and_wf_run():
    wf = typed_workflow()
    provider = RecordingProvider()
    from flowrt.runner.executor import execute

    r = anyio.run(lambda: execute(wf, {"max_turns": "3", "scores": ["1.5", 2]}, provider))
    assert r.outputs["agent"]["max_turns"] == 3 and r.outputs["double"] == [3.0, 4.0]
    plain = fr.Workflow("plain")

    @plain.step
    def inc(x: int) -> int:
        return x + 1

    assert plain.run(x="41").outputs["inc"] == 42
    with pytest.raises(WorkflowError, match="input 'x' must be int"):
        plain.run(x="forty")
    assert plain.check_inputs({"x": "7"}) == {"x": 7}


def test_unannotated_and_arbitrary_types_pass_unchanged():
    wf = fr.Workflow("w")

    class Thing:
        pass

    thing = Thing()

    @wf.step
    def a(x, t: Thing) -> bool:
        return t is thing and x == "raw"

    assert wf.run(x="raw", t=thing).outputs["a"] is True


def test_wf_run_inside_a_running_loop_says_use_arun():
    wf = fr.Workflow("w")

    @wf.step
    def one() -> int:
        return 1

    async def inside() -> None:
        with pytest.raises(RuntimeError, match=r"running event loop.*await wf\.arun\(\.\.\.\)"):
            wf.run()
        assert (await wf.arun()).outputs == {"one": 1}

    asyncio.run(inside())
