"""Conditional routing: a step that declares ``routes=[...]`` returns ``fr.goto(step, value)`` (or a list of
them, for a fan-out) to choose which of those successors run next.

    @wf.step(routes=["tool", "answer"])
    async def agent(question: str, llm: fr.Model, tool: str | None = None):
        ...
        return fr.goto("tool", call) if wants_tool else fr.goto("answer", reply)

* A chosen step receives the goto's ``value`` in its parameter named after the routing step (``def
  tool(agent: str)``); a successor that is not chosen is skipped ("not routed"), and so is what depends on
  it only through required parameters (a parameter with a default gets the default: joins work).
* A route may point back to an earlier step (or the step itself): a loop. The target runs again, with the
  goto's value in its parameter named after the routing step (which needs a default for the first visit),
  and every step after it runs again as the new results reach it. Each step runs at most ``max_visits``
  times per run (default 25); past that the step fails with an error saying so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Goto", "goto", "DEFAULT_MAX_VISITS"]

DEFAULT_MAX_VISITS = 25


@dataclass(frozen=True)
class Goto:
    """A routing decision: run ``step`` next, giving it ``value``."""

    step: str
    value: Any = None


def goto(step: str, value: Any = None) -> Goto:
    """Route to ``step`` (one of the routing step's declared ``routes``) with ``value``."""
    if not isinstance(step, str):
        raise TypeError(f"fr.goto needs a step name (str), got {type(step).__name__}")
    return Goto(step, value)
