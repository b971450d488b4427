"""Injectable resources: the objects a step receives by type (or by name) rather than from the DAG.

A step parameter is a *resource* when its annotation is a registered resource type (``llm: fr.Model``,
``retriever: fr.Retriever``), or when it has no annotation and its name is a resource's name (``llm``,
``retriever``). Everything else is a workflow input or another step's result.

Providers (``fr.Runtime``) supply the objects; the executor asks for each resource a run needs before the
first step starts, so a workflow that never touches the model never loads one.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["ResourceKind", "register_resource", "resource_kinds", "match_resource"]


@dataclass(frozen=True)
class ResourceKind:
    name: str                                  # the name steps use (and the provider's key)
    matches: Callable[[Any], bool]             # annotation -> is it this resource's type?
    hint: str = ""                             # how to provide it, for error messages


_KINDS: dict[str, ResourceKind] = {}


def register_resource(name: str, matches: type | Callable[[Any], bool], hint: str = "") -> ResourceKind:
    """Register a resource kind. ``matches`` is a type (annotations that are it or a subclass match) or
    a predicate over annotations."""
    pred: Callable[[Any], bool]
    if isinstance(matches, type):
        cls = matches

        def pred(ann: Any) -> bool:
            return isinstance(ann, type) and issubclass(ann, cls)
    else:
        pred = matches
    kind = ResourceKind(name, pred, hint)
    _KINDS[name] = kind
    return kind


def resource_kinds() -> dict[str, ResourceKind]:
    return dict(_KINDS)


def _unwrap_optional(ann: Any) -> Any:
    origin = typing.get_origin(ann)
    if origin is typing.Union or (origin is not None and getattr(origin, "__name__", "") == "UnionType"):
        args = [a for a in typing.get_args(ann) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return ann


def match_resource(param_name: str, annotation: Any) -> str | None:
    """The resource name a parameter asks for, or None. ``annotation`` is the resolved annotation,
    a string (unresolvable forward reference) or ``inspect.Parameter.empty``."""
    import inspect

    if annotation is inspect.Parameter.empty or annotation is None:
        return param_name if param_name in _KINDS else None
    ann = _unwrap_optional(annotation)
    if isinstance(ann, str):
        tail = ann.replace(" ", "")
        for kind in _KINDS.values():
            if tail in _string_names(kind.name):
                return kind.name
        return None
    for kind in _KINDS.values():
        try:
            if kind.matches(ann):
                return kind.name
        except Exception:  # noqa: BLE001 - a predicate must never break workflow definition
            continue
    return None


_STRING_NAMES = {
    "llm": {"fr.Model", "flowrt.Model", "Model"},
    "retriever": {"fr.Retriever", "flowrt.Retriever", "Retriever"},
}


def _string_names(name: str) -> set[str]:
    return _STRING_NAMES.get(name, set())


def _is_model(ann: Any) -> bool:
    from ..llm.model import Model

    return isinstance(ann, type) and issubclass(ann, Model)


def _is_retriever(ann: Any) -> bool:
    # Matched by name so that defining a workflow never imports flowrt.retrieval (and faiss).
    if not isinstance(ann, type):
        return False
    for cls in ann.__mro__:
        if cls.__name__ == "Retriever" and cls.__module__.startswith("flowrt.retrieval"):
            return True
    return False


register_resource("llm", _is_model, hint="runs get it from fr.Runtime(model=...) or `flowrt run --model PATH`")
register_resource(
    "retriever", _is_retriever,
    hint="pass an index: fr.Runtime(index=DIR) or `flowrt run --index DIR` (build one with `flowrt index`)",
)
