"""Typed workflow inputs: each input is validated and converted (pydantic, lax mode) against the
annotations of the steps that take it, before anything runs or loads, so ``--input max_turns=abc``
fails at once with the input's name and type instead of reaching the step as a string after the model
has loaded."""

from __future__ import annotations

import functools
import inspect
import typing
from types import GenericAlias
from typing import TYPE_CHECKING, Any

from pydantic import TypeAdapter, ValidationError

if TYPE_CHECKING:
    from .workflow import Workflow

__all__ = ["coerce_inputs", "coerce_input", "type_name"]


def type_name(ann: Any) -> str:
    """``int``, ``list[str]``, ``Optional[int]``: an annotation as a person writes it."""
    if isinstance(ann, type) and not typing.get_args(ann):
        return ann.__qualname__
    return repr(ann).replace("typing.", "")


@functools.lru_cache(maxsize=512)
def _cached_adapter(ann: Any) -> TypeAdapter | None:
    return _build_adapter(ann)


def _build_adapter(ann: Any) -> TypeAdapter | None:
    try:
        return TypeAdapter(ann)
    except Exception:  # noqa: BLE001 - a type pydantic cannot describe (an arbitrary class, ...): left unchecked
        return None


def _adapter(ann: Any) -> TypeAdapter | None:
    if ann is inspect.Parameter.empty or ann is Any or isinstance(ann, str):
        return None  # unannotated, or a forward reference that never resolved
    try:
        return _cached_adapter(ann)
    except TypeError:  # unhashable annotation
        return _build_adapter(ann)


def _expected(wf: "Workflow", name: str) -> list[tuple[str, Any]]:
    """(step, annotation) for every step that takes input ``name``; a step mapped over the input takes
    a list of its parameter's type."""
    out = []
    for step in wf.steps.values():
        for p in step.params:
            if p.name == name and not p.resource and p.annotation is not inspect.Parameter.empty:
                out.append((step.name, GenericAlias(list, (p.annotation,)) if step.map == name else p.annotation))
    return out


def coerce_input(wf: "Workflow", name: str, value: Any) -> Any:
    """``value`` validated against every step's annotation of input ``name``, converted by the first;
    a ``WorkflowError`` naming the input, the type and the step when it does not fit."""
    from .workflow import WorkflowError

    converted, first = value, True
    for step, ann in _expected(wf, name):
        adapter = _adapter(ann)
        if adapter is None:
            continue
        try:
            result = adapter.validate_python(value)
        except ValidationError as e:
            reason = e.errors()[0].get("msg", str(e)) if e.errors() else str(e)
            raise WorkflowError(f"workflow {wf.name!r}: input {name!r} must be {type_name(ann)} (step {step!r}), "
                                f"got {value!r:.200}: {reason}") from None
        if first:
            converted, first = result, False
    return converted


def coerce_inputs(wf: "Workflow", inputs: dict[str, Any]) -> dict[str, Any]:
    """Every input validated and converted (see ``coerce_input``)."""
    return {name: coerce_input(wf, name, value) for name, value in inputs.items()}
