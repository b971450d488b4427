"""Time travel: a new run forked from a stored one at a step (``flowrt runs fork``, ``rt.fork``).

The new run starts from the source run's last state with ``at`` and every step downstream of it (through
data edges, ``after=`` and forward routes) set back to pending: their results, errors, route choices and
interrupt answers are dropped, the upstream steps keep their results and do not run again. Upstream results
that hold threads are restored from their token ids, so on a warm engine their KV comes from the prefix
cache and only what the re-run steps add is computed.

``at`` may name a step inside a subgraph step (``wf.step(sub)``, at any depth: ``outer/inner``): the
subgraph step and its downstream run again, and inside it ``inner`` and its downstream; the subgraph's other
steps keep their last results, taken from the run's checkpoints (a finished subgraph keeps no state of its
own). Not inside a mapped subgraph step or one whose steps route (their route choices are not stored).
"""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Any, Mapping, cast

from ..render import to_jsonable
from ..runner.state import RunStatus, StepStatus, step_of
from .lease import LEASE_TTL_S, live_holder, new_holder
from .run import RunCheckpoint
from .state_codec import StoredState, load
from .store import CheckpointError, CheckpointStore, RunBusyError

if TYPE_CHECKING:
    from ..graph.workflow import Workflow

__all__ = ["fork_state", "fork_run", "ForkAtError", "UnknownStepError"]


class ForkAtError(CheckpointError):
    """``at`` names a step the run cannot be forked at (inside a mapped or routing subgraph step; HTTP: 400)."""


class UnknownStepError(ForkAtError):
    """``at`` names no step of the workflow (or of the subgraph it goes into; HTTP: 404)."""


def fork_state(state: Mapping[str, Any] | None, wf: Workflow, at: str,
               history: list[dict[str, Any]] | None = None) -> StoredState:
    """A stored run state (of any version) with ``at`` and its downstream steps pending again, in the current
    form (a new dict; ``state`` is unchanged). ``history``: the run's checkpoints (``store.history``), for
    ``at`` inside a subgraph (``outer/inner``)."""
    return _fork(load(state) or {}, wf, at, history)


def _fork(state: StoredState, wf: Workflow, at: str, history: list[dict[str, Any]] | None) -> StoredState:
    import networkx as nx

    at, _, inner = at.partition("/")
    if at not in wf.steps:
        raise UnknownStepError(f"workflow {wf.name!r} has no step {at!r} to fork at (its steps: "
                              f"{', '.join(wf.steps)})")
    sub = _subgraph(wf, at) if inner else None
    again = {at} | (set(nx.descendants(wf.graph, at)) & set(wf.steps))

    def keep(d: dict[str, Any]) -> dict[str, Any]:   # keys: steps, labels (``each[2]``), subgraph paths
        return {k: v for k, v in d.items() if step_of(k) not in again}

    status = {n: (str(StepStatus.PENDING) if n in again else s) for n, s in state.get("status", {}).items()}
    visits = {n: (0 if n in again else v) for n, v in state.get("visits", {}).items()}
    loops = {t: {r: v for r, v in c.items() if r not in again} for t, c in state.get("loop_values", {}).items()
             if t not in again}
    return {**state, "status": status, "visits": visits, "outputs": keep(state.get("outputs", {})),
            "errors": keep(state.get("errors", {})), "not_routed": keep(state.get("not_routed", {})),
            "chosen": keep(state.get("chosen", {})), "loop_values": loops,
            "routes": [r for r in state.get("routes", []) if r["step"] not in again],
            "timings": keep(state.get("timings", {})), "answers": keep(state.get("answers", {})),
            "subruns": {**keep(state.get("subruns", {})),
                        **(_inner_states(sub, at, inner, history or []) if sub is not None else {})},
            "held_threads": keep(state.get("held_threads", {})), "interrupt": None,
            "llm_calls": keep(state.get("llm_calls", {})), "llm_totals": None,   # the totals of the calls kept
            "forks": [f for f in state.get("forks", []) if step_of(f.get("step") or "") not in again]}


def _subgraph(wf: Workflow, at: str) -> Workflow:
    """The workflow that step ``at`` runs, for a fork inside it."""
    step = wf.steps[at]
    if step.sub is None:
        raise ForkAtError(f"step {at!r} of workflow {wf.name!r} runs no subgraph (wf.step(sub)); fork at "
                              f"{at!r} itself")
    if step.map is not None or step.sub.has_routes:
        why = "mapped" if step.map is not None else "a subgraph whose steps route"
        raise ForkAtError(f"cannot fork inside step {at!r}: it is {why} (its inner states are not stored); "
                              f"fork at {at!r} itself")
    return step.sub


def _inner_states(sub: Workflow, path: str, at: str, history: list[dict[str, Any]]) -> dict[str, StoredState]:
    """The state subgraph ``sub`` at ``path`` starts from (those below it nested in it), forked at ``at``
    inside it: each of its steps done with its latest result in the checkpoints, the others pending."""
    prefix = path + "/"
    rows = [{**h, "step": h["step"][len(prefix):]} for h in history if (h.get("step") or "").startswith(prefix)]
    last = {h["step"]: h for h in rows if h.get("status") == StepStatus.DONE and h.get("result") is not None}
    done = {n: last[n]["result"] for n in sub.steps if n in last}
    state: StoredState = {"status": {n: str(StepStatus.DONE if n in done else StepStatus.PENDING) for n in sub.steps},
                          "visits": {n: int(n in done) for n in sub.steps}, "outputs": done}
    return {path: _fork(state, sub, at, rows)}


def fork_run(store: CheckpointStore, run_id: str, wf: Workflow, at: str, inputs: dict[str, Any]) -> RunCheckpoint:
    """A new run in ``store``: ``run_id`` forked at step ``at`` with ``inputs`` (already checked) replacing
    its inputs. Its first checkpoint holds the forked state, so a crash before its first step resumes it.
    A run that is running now (a live lease) is refused (``RunBusyError``): its state is still changing."""
    source = store.get_run(run_id)
    if source.workflow != wf.name:
        raise CheckpointError(f"run {run_id} is of workflow {source.workflow!r}, not {wf.name!r}")
    busy = live_holder(source)
    if busy is not None:
        raise RunBusyError(run_id, busy, source.lease_expires)
    state = fork_state(source.state, wf, at, store.history(run_id) if "/" in at else None)
    new_id = uuid.uuid4().hex[:16]
    meta = {**(source.meta or {}), "forked_from": {"run_id": run_id, "at": at, "time": time.time()}}
    holder = new_holder()   # the new run is held by this process from its creation, as any new run
    store.create_run(new_id, wf.name, to_jsonable(inputs), file=source.file, meta=meta, holder=holder,
                     ttl=LEASE_TTL_S)
    store.save(new_id, step=None, visit=0, step_status="forked", result=None, route=None, threads=[],
               state=cast("dict[str, Any]", state), run_status=str(RunStatus.RUNNING), holder=holder)
    return RunCheckpoint(store, new_id, record=store.get_run(new_id), holder=holder)
