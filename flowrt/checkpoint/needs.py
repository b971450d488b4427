"""What a stored run needs loaded to continue: a resume whose remaining steps use no model must not pay for
loading one (seconds for a large model), as a new run of plain Python steps does not."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..runner.state import StepStatus
from .codec import TAG

if TYPE_CHECKING:
    from ..graph.workflow import Workflow

__all__ = ["resources_to_continue"]

_KEPT = (StepStatus.DONE, StepStatus.NOT_ROUTED)   # statuses a resume keeps; every other step runs again


def _holds_thread(v: Any) -> bool:
    """Whether an encoded value holds a thread (decoding it needs the model)."""
    if isinstance(v, dict):
        return v.get(TAG) == "thread" or any(_holds_thread(x) for x in v.values())
    if isinstance(v, list):
        return any(_holds_thread(x) for x in v)
    return False


def _runs_again(name: str, state: dict[str, Any]) -> bool:
    status = state.get("status", {}).get(name, StepStatus.PENDING)
    return status not in _KEPT or (status == StepStatus.DONE and "json" not in state.get("outputs", {}).get(name, {}))


def resources_to_continue(wf: Workflow, state: dict[str, Any] | None) -> list[str]:
    """The resources of ``wf`` to load before resuming from ``state``: those of the steps that run again, and
    the model when a kept result holds a thread (restored from its token ids). A step that a loop route later
    sends back to, and that needs another, gets it when it starts (the executor loads it then)."""
    if not state:
        return list(wf.resources)
    needed = {r for name, step in wf.steps.items() if _runs_again(name, state) for r in step.resources}
    kept = {k: v for k, v in state.items() if k in ("outputs", "chosen", "loop_values", "subruns")}
    if _holds_thread(kept):
        needed.add("llm")
    return [r for r in wf.resources if r in needed]
