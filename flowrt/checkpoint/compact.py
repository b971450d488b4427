"""Compact checkpoints: each step result and route is stored once, in its checkpoint's row, and a run's
latest state is kept in the run's row (overwritten at every checkpoint), its outputs as references to the
checkpoints that hold them and its route log as a count of routes kept in checkpoint rows. So a store grows
with the results it holds, not with steps x state (a 200-iteration loop: bench/checkpoint_size.py).

``pack`` turns the state a checkpoint saves into its stored form, given the run's previous stored state;
``unpack`` turns it back, given the results of the checkpoints it refers to (``refs``) and the rows' routes.
What cannot be referred to stays inline: an output that is not the saved step's result and that the
previous state did not refer to, a route log that is not the previous one plus this step's route (a state
written whole, e.g. by a fork). An encoded result is ``{"json": ...}`` or ``{"placeholder": ...}``; a
reference is ``{"ref": seq}``; the route log, ``{"rows": n}``: the routes of the run's checkpoint rows whose
route is the one that step took at that visit (a failed visit's row repeats an earlier route).
"""

from __future__ import annotations

from typing import Any, Sequence

from .store import CheckpointError

__all__ = ["pack", "unpack", "refs", "routes_from_rows"]


def _ref(enc: Any) -> int | None:
    return enc["ref"] if isinstance(enc, dict) and set(enc) == {"ref"} else None


def _own_route(step: str | None, visit: int, route: Any) -> bool:
    """The row's route was taken by its step at its visit (one route per visit that routes)."""
    return isinstance(route, dict) and route.get("step") == step and route.get("visit") == visit


def pack(state: dict[str, Any], step: str | None, visit: int, seq: int, result: Any, route: Any,
         previous: dict[str, Any] | None) -> dict[str, Any]:
    before = (previous or {}).get("outputs") or {}
    outputs: dict[str, Any] = {}
    for name, enc in (state.get("outputs") or {}).items():
        if name == step and result is not None and (enc is result or enc == result):
            outputs[name] = {"ref": seq}
        elif name != step and _ref(before.get(name)) is not None:
            outputs[name] = before[name]   # outputs change only through their own step's checkpoint
        else:
            outputs[name] = enc
    packed = {**state, "outputs": outputs} if "outputs" in state else dict(state)
    routes = state.get("routes")
    if isinstance(routes, list):
        kept = (previous or {"routes": {"rows": 0}}).get("routes")
        own = _own_route(step, visit, route)
        if isinstance(kept, dict) and len(routes) == kept["rows"] + own and (not own or routes[-1] == route):
            packed["routes"] = {"rows": len(routes)}
    return packed


def refs(packed: dict[str, Any] | None) -> list[int]:
    """The checkpoints whose results ``unpack`` needs."""
    found = (_ref(e) for e in ((packed or {}).get("outputs") or {}).values())
    return sorted({r for r in found if r is not None})


def routes_from_rows(packed: dict[str, Any] | None) -> bool:
    """Whether ``unpack`` needs the rows' routes."""
    return isinstance((packed or {}).get("routes"), dict)


def unpack(packed: dict[str, Any], results: dict[int, Any],
           rows: Sequence[tuple[str | None, int, Any]] = ()) -> dict[str, Any]:
    """``rows``: (step, visit, route) of the run's checkpoints in order, when ``routes_from_rows``."""
    outputs = {}
    for name, enc in (packed.get("outputs") or {}).items():
        r = _ref(enc)
        if r is not None and r not in results:
            raise CheckpointError(f"the state refers to checkpoint {r} for the output of {name!r}, and there is "
                                  f"none (corrupt?)")
        outputs[name] = results[r] if r is not None else enc
    state = {**packed, "outputs": outputs} if "outputs" in packed else dict(packed)
    if routes_from_rows(packed):
        state["routes"] = [route for step, visit, route in rows if _own_route(step, visit, route)]
        if len(state["routes"]) != packed["routes"]["rows"]:
            raise CheckpointError(f"the checkpoints hold {len(state['routes'])} routes, the state counts "
                                  f"{packed['routes']['rows']} (corrupt?)")
    return state
