"""Time travel: a new run forked from a stored one at a step (``flowrt runs fork``, ``rt.fork``).

The new run starts from the source run's last state with ``at`` and every step downstream of it (through
data edges, ``after=`` and forward routes) set back to pending: their results, errors, route choices and
interrupt answers are dropped, the upstream steps keep their results and do not run again. Upstream results
that hold threads are restored from their token ids, so on a warm engine their KV comes from the prefix
cache and only what the re-run steps add is computed.
"""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Any

from ..render import to_jsonable
from .lease import LEASE_TTL_S, new_holder
from .run import RunCheckpoint
from .store import CheckpointError, CheckpointStore

if TYPE_CHECKING:
    from ..graph.workflow import Workflow

__all__ = ["fork_state", "fork_run"]


def _top(label: str) -> str:
    """The top-level step of a label (``research/search`` -> research, ``each[3]`` -> each)."""
    return label.split("/", 1)[0].split("[", 1)[0].split("#", 1)[0]


def fork_state(state: dict[str, Any], wf: Workflow, at: str) -> dict[str, Any]:
    """``state`` with ``at`` and its downstream steps pending again (a new dict; ``state`` is unchanged)."""
    import networkx as nx

    if at not in wf.steps:
        raise CheckpointError(f"workflow {wf.name!r} has no step {at!r} to fork at (its steps: "
                              f"{', '.join(wf.steps)})")
    again = {at} | (set(nx.descendants(wf.graph, at)) & set(wf.steps))

    def keep(d: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in d.items() if _top(k) not in again}

    status = {n: ("pending" if n in again else s) for n, s in state.get("status", {}).items()}
    visits = {n: (0 if n in again else v) for n, v in state.get("visits", {}).items()}
    loops = {t: {r: v for r, v in c.items() if r not in again} for t, c in state.get("loop_values", {}).items()
             if t not in again}
    return {**state, "status": status, "visits": visits, "outputs": keep(state.get("outputs", {})),
            "errors": keep(state.get("errors", {})), "not_routed": keep(state.get("not_routed", {})),
            "chosen": keep(state.get("chosen", {})), "loop_values": loops,
            "routes": [r for r in state.get("routes", []) if r["step"] not in again],
            "timings": keep(state.get("timings", {})), "answers": keep(state.get("answers", {})),
            "subruns": keep(state.get("subruns", {})), "held_threads": keep(state.get("held_threads", {})),
            "interrupt": None}


def fork_run(store: CheckpointStore, run_id: str, wf: Workflow, at: str, inputs: dict[str, Any]) -> RunCheckpoint:
    """A new run in ``store``: ``run_id`` forked at step ``at`` with ``inputs`` (already checked) replacing
    its inputs. Its first checkpoint holds the forked state, so a crash before its first step resumes it."""
    source = store.get_run(run_id)
    if source.workflow != wf.name:
        raise CheckpointError(f"run {run_id} is of workflow {source.workflow!r}, not {wf.name!r}")
    state = fork_state(source.state or {}, wf, at)
    new_id = uuid.uuid4().hex[:16]
    meta = {**(source.meta or {}), "forked_from": {"run_id": run_id, "at": at, "time": time.time()}}
    holder = new_holder()   # the new run is held by this process from its creation, as any new run
    store.create_run(new_id, wf.name, to_jsonable(inputs), file=source.file, meta=meta, holder=holder,
                     ttl=LEASE_TTL_S)
    store.save(new_id, step=None, visit=0, step_status="forked", result=None, route=None, threads=[],
               state=state, run_status="running", holder=holder)
    return RunCheckpoint(store, new_id, record=store.get_run(new_id), holder=holder)
