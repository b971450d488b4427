"""A hung sync tool gives control back: tools run in abandonable daemon threads (as sync steps do), so
cancellation (asyncio.wait_for, a step timeout) returns at once instead of waiting for the tool, and
``@fr.tool(timeout=...)`` bounds a run with an error naming the tool (issue 27, item 7).

The tool blocks on a threading.Event that the test sets only afterwards: had the caller waited for the
tool, the tool would have finished by then (its wait has a safety bound) and `released` would be set."""

from __future__ import annotations

import asyncio
import threading

import anyio
import pytest

import flowrt as fr
from flowrt.runner.executor import execute
from flowrt.llm.toolcalls import ToolCall
from flowrt.llm.tools import ToolTimeoutError, run_tool_calls

SAFETY_S = 60  # how long a tool that nobody abandons blocks: the test fails rather than hangs


def hung_tool(**kw):
    gate, released = threading.Event(), threading.Event()

    @fr.tool(**kw)
    def lookup(key: str) -> str:
        """Look a key up (never answers until released)."""
        gate.wait(SAFETY_S)
        released.set()
        return "late " + key

    return lookup, gate, released


def test_wait_for_cancels_a_hung_sync_tool():
    lookup, gate, released = hung_tool()
    call = ToolCall("call_1", "lookup", {"key": "a"})

    async def main():
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(run_tool_calls([call], [lookup]), 0.05)
        return released.is_set()

    try:
        assert asyncio.run(main()) is False  # control came back while the tool was still blocked
    finally:
        gate.set()
    assert released.wait(SAFETY_S)  # the abandoned thread ran on and ended


def test_step_timeout_cuts_a_hung_sync_tool():
    lookup, gate, released = hung_tool()
    wf = fr.Workflow("w")

    @wf.step(timeout=0.05)
    async def ask() -> str:
        return await lookup.invoke({"key": "b"})

    try:
        r = anyio.run(lambda: execute(wf, {}, None))
        assert not released.is_set()
    finally:
        gate.set()
    assert r.errors["ask"].kind == "timeout" and "timed out after 0.05s" in r.errors["ask"].message


def test_tool_timeout_names_the_tool():
    lookup, gate, released = hung_tool(timeout=0.05)
    call = ToolCall("call_1", "lookup", {"key": "c"})
    try:
        with pytest.raises(ToolTimeoutError, match=r"tool 'lookup' timed out after 0.05s") as e:
            anyio.run(lookup.invoke, {"key": "c"})
        assert e.value.tool == "lookup" and isinstance(e.value, TimeoutError)
        # through call_tools / run_tool_calls the model is told, as for any tool error
        assert anyio.run(run_tool_calls, [call], [lookup]) == ["error: tool 'lookup' timed out after 0.05s"]
        assert not released.is_set()
    finally:
        gate.set()


def test_tool_timeout_on_an_async_tool_and_in_time():
    @fr.tool(timeout=0.05)
    async def stuck() -> str:
        await anyio.Event().wait()

    @fr.tool(timeout=30)
    def quick(x: int) -> int:
        return x + 1

    with pytest.raises(ToolTimeoutError, match="tool 'stuck'"):
        anyio.run(stuck.invoke, {})
    assert anyio.run(quick.invoke, {"x": 1}) == 2


@pytest.mark.parametrize("bad", [0, -1, "5", True])
def test_bad_timeout(bad):
    with pytest.raises(ValueError, match="timeout must be a positive number"):
        fr.tool(timeout=bad)(lambda: None)
