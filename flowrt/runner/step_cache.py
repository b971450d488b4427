"""The step result cache at run time: ``cached`` runs an ``fr.Cache`` step (flowrt.graph.cache) or takes its
result from the checkpoint store's cache (flowrt.checkpoint.result_cache).

The key is a hash of the workflow's name, the step's, the step's inputs (its arguments but the resources, or
what the policy's ``key`` makes of them, encoded as checkpoints encode results: flowrt.checkpoint.codec) and,
for a step that uses the model, the engine's fingerprint (weights, dtypes, version: ``kv_fingerprint``), so
another model never takes a result its steps did not make. Only a result the step returned is kept: a failure,
a timeout, a cancelled step and a step that called ``fr.interrupt`` (its result depends on an answer, not on
its inputs) are not, and a result JSON cannot hold exactly is not. Inputs JSON cannot hold, or a model without
a fingerprint (a replica router), leave the step uncached, with a warning once.

A runtime with a checkpoint store and ``cache=True`` (the default; ``--no-cache`` turns it off) puts a
``RunCache`` in ``current_cache`` for each run: the lookups' counts go to the run's stats (``cache_hits``,
``cache_misses``), each lookup is a span in the trace (its own row, "step cache"; a hit also a step span of
status "cached") and the progress display marks the step.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import time
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Awaitable, Callable

if TYPE_CHECKING:
    from ..checkpoint.result_cache import ResultCache
    from ..graph.workflow import Step
    from .executor import WorkflowRun

__all__ = ["RunCache", "current_cache", "cached", "cache_key"]

logger = logging.getLogger("flowrt.runner")

_KEY_VERSION = 1
_warned: set[tuple[str, str, str]] = set()


@dataclass
class RunCache:
    """One run's use of the result cache: where results are kept, and what its lookups found."""

    store: ResultCache
    hits: int = 0
    misses: int = 0

    def stats(self) -> dict[str, int]:
        return {"cache_hits": self.hits, "cache_misses": self.misses}


current_cache: ContextVar[RunCache | None] = ContextVar("flowrt_step_cache", default=None)


def _warn_once(wf: str, step: str, why: str) -> None:
    if (wf, step, why) not in _warned:
        _warned.add((wf, step, why))
        logger.warning("step %r of workflow %r is not cached: %s", step, wf, why)


def _key_material(step: Step, kwargs: dict[str, Any]) -> Any:
    """What the key hashes of the step's arguments: its inputs (no resources), or what ``key`` makes of them."""
    inputs = {p.name: kwargs[p.name] for p in step.params if not p.resource and p.name in kwargs}
    fn = step.cache.key if step.cache is not None else None
    if fn is None:
        return inputs
    params = inspect.signature(fn).parameters.values()
    if not any(p.kind is p.VAR_KEYWORD for p in params):
        names = {p.name for p in params}
        inputs = {k: v for k, v in inputs.items() if k in names}
    return fn(**inputs)


def cache_key(workflow: str, step: str, material: Any, fingerprint: str) -> str | None:
    """The key of a step's result; None when ``material`` is not something JSON holds exactly."""
    from ..checkpoint.codec import encode

    enc = encode(material)
    if "json" not in enc:
        return None
    text = json.dumps([_KEY_VERSION, workflow, step, enc["json"], fingerprint], sort_keys=True,
                      ensure_ascii=True, separators=(",", ":"))
    return hashlib.blake2b(text.encode(), digest_size=24).hexdigest()


def _fingerprint(run: WorkflowRun, step: Step) -> str | None:
    """The model's fingerprint for a step that uses it ("" for one that does not); None when it has none."""
    if "llm" not in step.resources:
        return ""
    fp = getattr(getattr(run.resources.get("llm"), "engine", None), "kv_fingerprint", None)
    return fp() if callable(fp) else None


def _answered_inside(run: WorkflowRun, label: str) -> bool:
    """The step at ``label`` (its items, its subgraph's steps) called ``fr.interrupt`` in its last attempt."""
    return any(n and (k == label or k.startswith((label + "/", label + "["))) for k, n in run.scope.calls.items())


def _mark(run: WorkflowRun, step: Step, how: str) -> None:
    if run.observer is not None:
        run.observer.cache[step.name] = how


async def cached(run: WorkflowRun, step: Step, kwargs: dict[str, Any],
                 invoke: Callable[[Step, dict[str, Any]], Awaitable[Any]]) -> Any:
    """``invoke(step, kwargs)``, or for an ``fr.Cache`` step of a run with a cache, its kept result."""
    rc = current_cache.get()
    policy = step.cache
    if policy is None or rc is None:
        return await invoke(step, kwargs)
    from ..checkpoint import CheckpointError
    from ..checkpoint.codec import NotRestorable, decode, encode
    from ..checkpoint.result_cache import CachedResult

    wf, label = run.wf.name, run.label(step.name)
    fingerprint = _fingerprint(run, step)
    if fingerprint is None:
        _warn_once(wf, step.name, "its model has no fingerprint (kv_fingerprint) to key results by")
        return await invoke(step, kwargs)
    key = cache_key(wf, step.name, _key_material(step, kwargs), fingerprint)
    if key is None:
        _warn_once(wf, step.name, "its inputs are not JSON values (give fr.Cache(key=...) a function of them that "
                                  "returns one)")
        return await invoke(step, kwargs)
    now = time.time()
    span = run.tracer.start(label, "cache", step=label, key=key)
    try:
        entry = rc.store.get(key, now)
        value = decode(entry.result, run.resources.get("llm")) if entry is not None else None
    except (CheckpointError, NotRestorable) as e:   # the cache is an optimisation: the step runs
        logger.warning("step %r: the step cache could not be read (%s); running the step", label, e)
        entry = None
    if entry is not None:
        rc.hits += 1
        run.tracer.end(span, result="hit", age_s=round(now - entry.created, 3))
        run.tracer.end(run.tracer.start(label, "step", step=label, cache="hit"), status="cached")
        _mark(run, step, "hit")
        return value
    rc.misses += 1
    run.tracer.end(span, result="miss")
    _mark(run, step, "miss")
    value = await invoke(step, kwargs)   # a failure raises here: nothing is kept
    if _answered_inside(run, label):
        return value
    enc = encode(value)
    if "json" not in enc:
        _warn_once(wf, step.name, f"its result ({type(value).__name__}) is not a JSON value")
        return value
    done = time.time()
    try:
        rc.store.put(key, CachedResult(wf, step.name, enc, done, done + policy.ttl if policy.ttl else None))
    except CheckpointError as e:
        logger.warning("step %r: its result could not be kept in the step cache (%s)", label, e)
    return value
