"""The on-disk form of a run's state (``flowrt.runner.state.RunState``): one versioned codec.

``dump`` writes the current version, ``load`` reads it and every earlier one (into the current form), and
``restore`` fills a run's state from it (a resume). Step results are encoded by flowrt.checkpoint.codec.

Versions:

* 1 (no ``"version"`` key; flowrt before the state was typed): the states of the subgraphs in flight lie flat
  in the run's ``"subruns"``, by their path from the run (``second/outer``, ``second/outer/inner/review``).
* 2: nested: a state's ``"subruns"`` hold the subgraphs its own steps run, by their path below it
  (``second/outer`` holds ``inner/review``). The run's own state carries ``"version"``.
"""

from __future__ import annotations

from typing import Any, Mapping, TypedDict, cast

from ..render import to_jsonable
from ..runner.state import PendingInterrupt, RouteTaken, RunState, StepError, StepStatus
from .codec import NotRestorable, decode, encode
from .store import CheckpointError

__all__ = ["VERSION", "StoredState", "StoredError", "Encoded", "dump", "load", "restore"]

VERSION = 2

Encoded = dict[str, Any]   # a value as flowrt.checkpoint.codec.encode stores it: {"json": ...} or a placeholder

S = StepStatus
_AGAIN = (S.RUNNING, S.INTERRUPTED, S.FAILED, S.SKIPPED)   # statuses whose step runs again on resume


class StoredError(TypedDict):
    message: str
    kind: str
    traceback: str | None
    attempts: int


class StoredState(TypedDict, total=False):
    """A run's (or a subgraph's) state as its checkpoints store it: JSON, statuses as their strings."""

    version: int
    status: dict[str, str]
    visits: dict[str, int]
    outputs: dict[str, Encoded]
    errors: dict[str, StoredError]
    not_routed: dict[str, str]                    # step -> why
    chosen: dict[str, dict[str, Encoded]]
    loop_values: dict[str, dict[str, Encoded]]
    routes: list[RouteTaken]
    timings: dict[str, float]
    interrupt: PendingInterrupt | None
    interrupts: list[PendingInterrupt]            # only when more than one is pending
    answers: dict[str, list[Any]]                 # the interrupt answers given, by step label (the run's)
    subruns: dict[str, StoredState]               # subgraphs in flight, by their path below this state's
    held_threads: dict[str, list[list[int]]]      # the run's, with KV checkpoints
    kv: dict[str, Any]                            # the run's saved KV blocks (flowrt.checkpoint.kv)
    # what the run did besides its results, for the run viewer (flowrt.runner.activity)
    llm_calls: dict[str, list[dict[str, Any]]]    # by step
    llm_totals: dict[str, int] | None
    forks: list[dict[str, Any]]
    block_size: int | None


def dump(st: RunState, *, answers: dict[str, list[Any]] | None = None, held_threads: bool = False) -> StoredState:
    """The on-disk form of the run state ``st``, its subgraphs' nested. ``answers``: the interrupt answers
    given so far; ``held_threads``: save the token ids of the threads of steps that have not ended (with KV
    checkpoints)."""
    out = _dump(st)
    out["answers"] = to_jsonable(answers or {})
    if held_threads and st.held_threads:
        out["held_threads"] = dict(st.held_threads)
    return {"version": VERSION, **out}


def _dump(st: RunState) -> StoredState:
    # a subgraph a resume found and did not start again yet is kept as found
    subruns = {**st.restoring, **{k: _dump(c) for k, c in st.children.items()}}
    out: StoredState = {
        "status": {n: str(s) for n, s in st.status.items()},
        "visits": dict(st.visits),
        "outputs": {n: st.encoded[n] for n in st.outputs if n in st.encoded},
        "errors": {n: {"message": e.message, "kind": e.kind, "traceback": e.traceback, "attempts": e.attempts}
                   for n, e in st.errors.items()},
        "not_routed": {n: e.message for n, e in st.not_routed.items()},
        "chosen": {r: {t: encode(v) for t, v in c.items()} for r, c in st.chosen.items()},
        "loop_values": {t: {r: encode(v) for r, v in c.items()} for t, c in st.loop_values.items()},
        "routes": list(st.route_log),
        "timings": dict(st.timings),
        "interrupt": st.interrupt,
        "answers": {},
    }
    if len(st.interrupts) > 1:
        out["interrupts"] = list(st.interrupts)
    if subruns:
        out["subruns"] = subruns
    return out


def load(data: Mapping[str, Any] | None) -> StoredState | None:
    """A stored state of any version, in the current form (a new dict; ``data`` is not changed); None for
    none (a run with no checkpoint yet)."""
    if not data:
        return None
    version = data.get("version", 1)
    if not isinstance(version, int) or not 1 <= version <= VERSION:
        raise CheckpointError(f"the run's checkpoint is of state format {version!r}; this flowrt reads formats 1 "
                              f"to {VERSION} (a newer flowrt wrote it?)")
    state = cast(StoredState, dict(data))
    if version == 1 and state.get("subruns"):
        state["subruns"] = _nest(state["subruns"])
    state["version"] = VERSION
    return state


def _nest(flat: Mapping[str, StoredState]) -> dict[str, StoredState]:
    """Version 1's flat subgraph states, nested: each below the one in flight whose path its own extends
    (the longest; a subgraph runs inside a step of its parent's, so its path is the parent's and more)."""
    nodes = {p: cast(StoredState, dict(s)) for p, s in flat.items()}
    top: dict[str, StoredState] = {}
    for p, node in nodes.items():
        parent = max((q for q in nodes if p.startswith(q + "/")), key=len, default=None)
        if parent is None:
            top[p] = node
        else:
            nodes[parent].setdefault("subruns", {})[p[len(parent) + 1:]] = node
    return top


def restore(st: RunState, saved: StoredState, model: Any, *, run_id: str, path: str = "") -> None:
    """Fill ``st`` (a run's state, or the one of its subgraph at ``path``) from ``saved`` (not changed).

    Finished steps keep their results (a thread restored from its token ids, on ``model``); a step that was
    running or waiting at an interrupt (that visit does not count), failed or skipped is pending again, and
    so is one whose result cannot be restored (a placeholder)."""
    where = path + "/" if path else ""
    status: dict[str, StepStatus] = {}
    for name, s in saved.get("status", {}).items():
        if name not in st.status:
            raise CheckpointError(f"run {run_id}: its checkpoint has step {where + name!r}, which the workflow "
                                  f"no longer defines (the workflow file changed?)")
        try:
            status[name] = StepStatus(s)
        except ValueError:
            raise CheckpointError(f"run {run_id}: step {where + name!r} has the status {s!r} in its checkpoint, "
                                  f"which is none of {', '.join(map(str, StepStatus))} (corrupt?)") from None
    visits = {k: int(v) for k, v in saved.get("visits", {}).items()}
    for name, enc in saved.get("outputs", {}).items():
        try:
            st.outputs[name] = decode(enc, model)
            st.encoded[name] = enc
        except NotRestorable:
            status[name] = S.PENDING   # the step runs again
    for name, s in status.items():
        if s in (S.RUNNING, S.INTERRUPTED):
            visits[name] = max(0, visits.get(name, 1) - 1)
        if s in _AGAIN or (s == S.DONE and name not in st.outputs):
            status[name] = S.PENDING
    st.status.update(status)
    st.visits.update({k: v for k, v in visits.items() if k in st.visits})
    st.not_routed = {n: StepError(n, m, kind="not_routed") for n, m in saved.get("not_routed", {}).items()
                     if status.get(n) == S.NOT_ROUTED}
    st.chosen = {r: {t: _dec(v, model) for t, v in c.items()} for r, c in saved.get("chosen", {}).items()}
    st.loop_values = {t: {r: _dec(v, model) for r, v in c.items()} for t, c in saved.get("loop_values", {}).items()}
    st.route_log = list(saved.get("routes", []))
    st.timings = dict(saved.get("timings", {}))
    st.restoring = dict(saved.get("subruns", {}))
    if not path:
        st.held_threads = {k: [list(ids) for ids in v] for k, v in saved.get("held_threads", {}).items()}


def _dec(enc: Encoded, model: Any) -> Any:
    try:
        return decode(enc, model)
    except NotRestorable:
        return None
