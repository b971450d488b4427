"""What the viewer shows of a stored run, as JSON: a row of the run list (``summary``) and a run's page
(``detail``: its steps' states, results, errors and LLM calls, its threads' fork tree, its graph).

A step's state is one of ``STEP_STATES``. The store saves a run after each step, with the statuses it had then
(steps in flight among them, ``running``); a step that started after the last save is still ``pending`` in it, so
a pending step of a running run whose upstream steps are all done is shown running (the executor starts every
step whose inputs are ready at once), and so is a step that was waiting for an answer in a run that is running
again (resumed: it runs again from its start with the answer).
"""

from __future__ import annotations

import re
import time
from typing import TYPE_CHECKING, Any

from ..checkpoint.lease import live_holder
from ..checkpoint.state_codec import load
from .layout import layout

if TYPE_CHECKING:
    from ..checkpoint.store import RunRecord
    from ..graph.workflow import Workflow

__all__ = ["STEP_STATES", "summary", "detail", "step_states", "history_view"]

STEP_STATES = ("pending", "running", "done", "failed", "skipped", "waiting")
_SHOWN = {"interrupted": "waiting", "not_routed": "skipped", "timeout": "failed"}
_INDEX = re.compile(r"(\[\d+\]|#\d+)")


def _tokens(state: dict[str, Any] | None) -> dict[str, int]:
    totals = (state or {}).get("llm_totals") or {}
    return {k: int(totals.get(k) or 0) for k in ("llm_calls", "prompt_tokens", "cached_tokens", "generated_tokens")}


def summary(r: RunRecord) -> dict[str, Any]:
    """A row of the run list (``r`` read with its state, for its token counts)."""
    end = r.updated if r.status != "running" else time.time()
    return {"run_id": r.run_id, "workflow": r.workflow, "status": r.status, "started": r.created,
            "updated": r.updated, "duration": round(max(0.0, end - r.created), 3), "tokens": _tokens(r.state),
            "checkpoints": r.checkpoints, "holder": live_holder(r),
            "forked_from": (r.meta or {}).get("forked_from")}


def _steps_of(wf: Workflow | None, state: dict[str, Any]) -> list[str]:
    """Every step the page shows, by path: the workflow's (a subgraph's inner ones as ``outer/inner``), else
    the state's."""
    if wf is None:
        return list(state.get("status", {}))
    out: list[str] = []

    def walk(w: Workflow, prefix: str) -> None:
        for n in w.order():
            out.append(prefix + n)
            sub = w.steps[n].sub
            if sub is not None:
                walk(sub, prefix + n + "/")

    walk(wf, "")
    return out


def _subrun(state: dict[str, Any], path: str) -> dict[str, Any] | None:
    """The state of the subgraph in flight at ``path``: the stored states nest (flowrt.checkpoint.state_codec),
    each below the one whose path its own extends."""
    subs = state.get("subruns") or {}
    if path in subs:
        return subs[path]
    below = max((k for k in subs if path.startswith(k + "/")), key=len, default=None)
    return None if below is None else _subrun(subs[below], path[len(below) + 1:])


def _state_at(state: dict[str, Any], path: str,
              history: list[dict[str, Any]] | None = None) -> tuple[dict[str, Any], str]:
    """The (sub)run state holding step ``path`` and the step's name in it. A subgraph that is not in flight
    keeps no state of its own: its steps' are rebuilt from their latest checkpoints in ``history``."""
    head, _, name = path.rpartition("/")
    if not head:
        return state, name
    kept = _subrun(state, head)
    if kept is not None or not history:
        return kept or {}, name
    last = next((h for h in reversed(history) if h.get("step") == path), None)
    if last is None:
        return {}, name
    at: dict[str, Any] = {"status": {name: last["status"]}, "visits": {name: last["visit"]}}
    if last["status"] == "done" and last.get("result") is not None:
        at["outputs"] = {name: last["result"]}
    return at, name


def step_states(wf: Workflow | None, record: RunRecord, history: list[dict[str, Any]] | None = None) -> dict[str, str]:
    """Each step's state (one of ``STEP_STATES``) by path (``history``: the run's checkpoints, for the steps of
    a subgraph that has ended)."""
    state: dict[str, Any] = dict(load(record.state) or {})
    out: dict[str, str] = {}
    for path in _steps_of(wf, state):
        at, name = _state_at(state, path, history)
        raw = (at.get("status") or {}).get(name, "pending")
        if raw == "failed" and (at.get("errors") or {}).get(name, {}).get("kind") == "skipped":
            raw = "skipped"
        out[path] = _SHOWN.get(raw, raw if raw in STEP_STATES else "pending")
    if record.status == "running":   # resumed: its answered steps run again from their start
        out = {n: "running" if s == "waiting" else s for n, s in out.items()}
    if wf is not None and record.status == "running":
        for name, s in list(out.items()):
            if s == "pending" and "/" not in name and name in wf.steps:
                step = wf.steps[name]
                if all(out.get(d) == "done" for d in step.deps + step.gates):
                    out[name] = "running"
    return out


def _result(enc: Any) -> Any:
    if isinstance(enc, dict) and "json" in enc:
        return enc["json"]
    if isinstance(enc, dict) and "placeholder" in enc:
        return enc["placeholder"]
    return enc


def _calls_by_step(state: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """LLM calls by step path (a mapped step's items ``each[3]`` and a subflow's ``#2`` under their step)."""
    out: dict[str, list[dict[str, Any]]] = {}
    for label, calls in (state.get("llm_calls") or {}).items():
        out.setdefault(_INDEX.sub("", label), []).extend(calls)
    return out


def detail(record: RunRecord, wf: Workflow | None, history: list[dict[str, Any]]) -> dict[str, Any]:
    """A run's page."""
    state: dict[str, Any] = dict(load(record.state) or {})
    states = step_states(wf, record, history)
    calls = _calls_by_step(state)
    steps = []
    for path, s in states.items():
        at, name = _state_at(state, path, history)
        err = (at.get("errors") or {}).get(name)
        not_routed = (at.get("not_routed") or {}).get(name)
        entry: dict[str, Any] = {"step": path, "state": s, "visits": (at.get("visits") or {}).get(name, 0),
                                 "seconds": (at.get("timings") or {}).get(name), "calls": calls.get(path, [])}
        outputs = at.get("outputs") or {}
        if name in outputs:
            entry["result"] = _result(outputs[name])
        if err:
            entry["error"] = {k: err.get(k) for k in ("message", "kind", "traceback", "attempts")}
        elif not_routed:
            entry["error"] = {"message": not_routed, "kind": "not_routed"}
        if name in (at.get("answers") or {}):
            entry["answers"] = at["answers"][name]
        steps.append(entry)
    interrupts = state.get("interrupts") or ([record.interrupt] if record.interrupt else [])
    return {"run": {**summary(record), "inputs": record.inputs, "file": record.file,
                    "interrupts": interrupts if record.status == "interrupted" else []},
            "steps": steps,
            "forks": {"forks": state.get("forks") or [], "block_size": state.get("block_size"),
                      "threads": _threads(state)},
            "graph": layout(wf).to_dict() if wf is not None else None,
            "history": history_view(history)}


def _threads(state: dict[str, Any]) -> list[dict[str, Any]]:
    """Every thread the run's LLM calls or forks name: its step, its calls' tokens, its parent in a fork."""
    threads: dict[int, dict[str, Any]] = {}

    def of(tid: int, step: Any) -> dict[str, Any]:
        return threads.setdefault(tid, {"id": tid, "step": step, "parent": None, "shared_tokens": 0,
                                        "calls": 0, "prompt_tokens": 0, "cached_tokens": 0, "generated_tokens": 0})

    for f in state.get("forks") or []:
        of(f["parent"], f.get("step"))
        for c in f["children"]:
            t = of(c, f.get("step"))
            t["parent"], t["shared_tokens"] = f["parent"], f["tokens"]
    for calls in (state.get("llm_calls") or {}).values():
        for c in calls:
            if c.get("thread_id") is None:
                continue
            t = of(c["thread_id"], c.get("step"))
            t["calls"] += 1
            for k in ("prompt_tokens", "cached_tokens", "generated_tokens"):
                t[k] += int(c.get(k) or 0)
    size = state.get("block_size")
    for t in threads.values():
        t["shared_blocks"] = t["shared_tokens"] // size if size else None   # full blocks; the last partial one
    return sorted(threads.values(), key=lambda t: t["id"])                   # is copied on the first write


def history_view(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The run's checkpoints, oldest first: what each one saved (a fork from one re-runs its step)."""
    return [{"seq": h["seq"], "step": h["step"], "visit": h["visit"], "status": h["status"],
             "created": h["created"], "result": _result(h["result"]) if h["result"] is not None else None}
            for h in history]
