"""``fr.Cache``: a step's result cache policy (as LangGraph's ``CachePolicy``), ``@wf.step(cache=fr.Cache(ttl=3600))``.

A cached step's result is kept in the run's checkpoint store, keyed by the workflow, the step, a stable hash of
its inputs (or of what ``key`` makes of them) and, for a step that uses the model, the model's fingerprint; a
later run with the same key, in any process using the same store, takes the result without running the step
(flowrt.runner.step_cache does the lookups, flowrt.checkpoint.result_cache keeps the results).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["Cache"]


@dataclass(frozen=True)
class Cache:
    """``ttl``: seconds a result stays valid (None: until removed). ``key``: a function of the step's inputs
    (called with those of its parameters it names, by keyword; all of them if it takes ``**kwargs``; never
    the resources such as ``llm``) whose return value (JSON-like: str, numbers, lists, dicts) replaces the
    inputs in the key, e.g. ``key=lambda question: question.strip().lower()``."""

    ttl: float | None = None
    key: Callable[..., Any] | None = None

    def __post_init__(self) -> None:
        if self.ttl is not None and (isinstance(self.ttl, bool) or not isinstance(self.ttl, (int, float))
                                     or not self.ttl > 0):
            raise ValueError(f"fr.Cache(ttl=...) must be a positive number of seconds or None, got {self.ttl!r}")
        if self.key is not None and not callable(self.key):
            raise TypeError(f"fr.Cache(key=...) must be a function of the step's inputs, got {self.key!r}")
