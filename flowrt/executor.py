"""The DAG executor: starts every step whose inputs are ready, concurrently (anyio task group), so the
engine sees every LLM call that can happen at a given moment and batches them.

* async steps run on the event loop; sync steps run in daemon threads (flowrt.worker);
* a mapped step runs once per item, concurrently (bounded by ``max_concurrency``);
* ``retries`` re-runs a failed attempt, ``timeout`` bounds each attempt (a sync step that overruns is
  abandoned: Python cannot stop a thread, so it runs on in the background, its result is dropped, and
  being a daemon thread it never keeps the process from exiting);
* a failing step fails alone: steps that depend on it are skipped (with the reason), every other branch
  runs to completion, and the result keeps all that completed next to the error and its traceback.
"""

from __future__ import annotations

import json
import time
import traceback as tb_mod
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import anyio

from .render import to_jsonable, unrenderable
from .runscope import RunThreads, current_run_threads
from .trace import Tracer, current_step, current_tracer
from .worker import run_sync_abandonable
from .workflow import Step, Workflow

__all__ = ["RunResult", "StepError", "StepFailed", "RunObserver", "execute", "ResourceProvider", "to_jsonable"]


@dataclass
class StepError:
    """Why a step has no output. ``kind``: "failed" (raised), "timeout", or "skipped" (an upstream step
    failed or a resource was unavailable)."""

    step: str
    message: str
    traceback: str | None = None
    kind: str = "failed"
    attempts: int = 0

    def __str__(self) -> str:
        return self.message


class StepFailed(RuntimeError):
    """Raised by ``RunResult[name]`` / ``raise_for_errors`` for a step that has no output."""

    def __init__(self, error: StepError) -> None:
        super().__init__(f"step {error.step!r} {error.kind}: {error.message}")
        self.error = error


@dataclass
class RunResult:
    workflow: str
    outputs: dict[str, Any]
    errors: dict[str, StepError]
    stats: dict[str, Any]
    timings: dict[str, float] = field(default_factory=dict)   # step -> seconds
    sinks: list[str] = field(default_factory=list)
    tracer: Tracer | None = field(default=None, repr=False)

    @property
    def ok(self) -> bool:
        return not self.errors

    @property
    def output(self) -> Any:
        """The result of the workflow's last step (its single sink); a StepFailed if that step failed."""
        if len(self.sinks) != 1:
            raise ValueError(f"workflow {self.workflow!r} has {len(self.sinks)} final steps "
                             f"({', '.join(self.sinks)}); use result.outputs[name]")
        return self[self.sinks[0]]

    def __getitem__(self, step: str) -> Any:
        if step in self.outputs:
            return self.outputs[step]
        if step in self.errors:
            raise StepFailed(self.errors[step])
        raise KeyError(step)

    def raise_for_errors(self) -> "RunResult":
        for err in self.errors.values():
            if err.kind != "skipped":
                raise StepFailed(err)
        for err in self.errors.values():
            raise StepFailed(err)
        return self

    def to_dict(self) -> dict[str, Any]:
        """``{"outputs": {step: result}, "errors": {step: message}, "stats": {...}}`` (JSON-safe: a result
        that cannot be rendered becomes an ``<unrenderable ...>`` placeholder, the others are kept)."""
        return {"outputs": {k: to_jsonable(v) for k, v in self.outputs.items()},
                "errors": {k: to_jsonable(e.message) for k, e in self.errors.items()},
                "stats": to_jsonable(self.stats)}

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent, ensure_ascii=False)


class ResourceProvider(Protocol):
    async def get_resource(self, name: str) -> Any: ...


class RunObserver:
    """Live state of a run, updated by the executor (the CLI's progress display reads it)."""

    def __init__(self, workflow: Workflow) -> None:
        self.workflow = workflow
        self.status: dict[str, str] = {name: "pending" for name in workflow.steps}
        self.started: dict[str, float] = {}
        self.finished: dict[str, float] = {}
        self.items: dict[str, tuple[int, int]] = {}       # mapped steps: (done, total)
        self.attempts: dict[str, int] = {}
        self.phase = ""                                   # e.g. "loading llm"
        self.t0 = time.perf_counter()

    def on_status(self, step: str, status: str) -> None:
        self.status[step] = status
        now = time.perf_counter()
        if status == "running":
            self.started.setdefault(step, now)
        elif status in ("done", "failed", "skipped"):
            self.finished[step] = now

    def counts(self) -> dict[str, int]:
        out = {"pending": 0, "running": 0, "done": 0, "failed": 0, "skipped": 0}
        for s in self.status.values():
            out[s] = out.get(s, 0) + 1
        return out


def _message(e: BaseException) -> str:
    try:
        text = str(e)
    except Exception as bad:  # an exception whose __str__ raises must not take the run down
        text = unrenderable(e, bad)
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _format_exc(e: BaseException) -> tuple[str, str]:
    msg = _message(e)
    return msg, "".join(tb_mod.format_exception(type(e), e, e.__traceback__))


class _StepTimeout(TimeoutError):
    pass


async def _call_once(step: Step, kwargs: dict[str, Any]) -> Any:
    if step.is_async:
        return await step.fn(**kwargs)
    return await run_sync_abandonable(lambda: step.fn(**kwargs), name=f"flowrt step {step.name}")


async def _attempts(step: Step, kwargs: dict[str, Any], label: str, observer: RunObserver | None,
                    tracer: Tracer) -> tuple[Any, int]:
    """Run one invocation with retries and a per-attempt timeout; returns (value, attempts)."""
    attempts = step.retries + 1
    for attempt in range(1, attempts + 1):
        if observer is not None:
            observer.attempts[step.name] = max(observer.attempts.get(step.name, 0), attempt)
        span = tracer.start(label, "step", step=step.name, attempt=attempt)
        try:
            if step.timeout is not None:
                with anyio.move_on_after(step.timeout) as scope:
                    value = await _call_once(step, kwargs)
                if scope.cancelled_caught:
                    raise _StepTimeout(f"step {step.name!r} timed out after {step.timeout:g}s")
            else:
                value = await _call_once(step, kwargs)
        except anyio.get_cancelled_exc_class():
            tracer.end(span, status="cancelled")
            raise
        except Exception as e:
            tracer.end(span, status="error", error=_message(e))
            if attempt >= attempts:
                e.__flowrt_attempts__ = attempt  # type: ignore[attr-defined]
                raise
            if step.retry_delay:
                await anyio.sleep(step.retry_delay * (2 ** (attempt - 1)))
            continue
        tracer.end(span, status="ok")
        return value, attempt
    raise AssertionError("unreachable")


async def execute(wf: Workflow, inputs: dict[str, Any], provider: ResourceProvider | None = None, *,
                  tracer: Tracer | None = None, observer: RunObserver | None = None,
                  stats_fn: Callable[[], dict[str, Any]] | None = None) -> RunResult:
    """Run ``wf`` once. Invalid inputs raise ``WorkflowError`` before any step starts; step failures are
    reported in the result, never raised."""
    wf.validate()
    inputs = wf.check_inputs(inputs)
    tracer = tracer or Tracer(stats_fn=stats_fn)
    if tracer.stats_fn is None:
        tracer.stats_fn = stats_fn
    t_start = time.perf_counter()
    outputs: dict[str, Any] = {}
    errors: dict[str, StepError] = {}
    timings: dict[str, float] = {}
    done = {name: anyio.Event() for name in wf.steps}

    def set_status(name: str, status: str) -> None:
        if observer is not None:
            observer.on_status(name, status)

    # Resources first: a workflow that needs the model loads it once, before any step starts.
    resources: dict[str, Any] = {}
    resource_errors: dict[str, str] = {}
    for rname in wf.resources:
        if observer is not None:
            observer.phase = f"loading {rname}"
        if provider is None:
            resource_errors[rname] = f"no runtime provides the resource {rname!r}"
            continue
        try:
            resources[rname] = await provider.get_resource(rname)
        except Exception as e:
            resource_errors[rname] = f"{type(e).__name__}: {e}"

    async def run_step(step: Step) -> None:
        token = current_step.set(step.name)
        try:
            for dep in step.deps:
                await done[dep].wait()
            failed = [d for d in step.deps if d in errors]
            if failed:
                errors[step.name] = StepError(step.name, f"skipped: depends on failed step {failed[0]!r}",
                                              kind="skipped")
                set_status(step.name, "skipped")
                return
            missing = [r for r in step.resources if r in resource_errors]
            if missing:
                errors[step.name] = StepError(step.name, f"skipped: resource {missing[0]!r} is unavailable: "
                                              f"{resource_errors[missing[0]]}", kind="skipped")
                set_status(step.name, "skipped")
                return
            kwargs: dict[str, Any] = {}
            for p in step.params:
                if p.resource:
                    kwargs[p.name] = resources[p.resource]
                elif p.name in wf.steps:
                    kwargs[p.name] = outputs[p.name]
                elif p.name in inputs:
                    kwargs[p.name] = inputs[p.name]
                elif p.has_default:
                    kwargs[p.name] = p.default
                else:  # check_inputs guarantees this does not happen
                    raise AssertionError(f"input {p.name!r} missing")
            set_status(step.name, "running")
            t0 = time.perf_counter()
            try:
                if step.map is None:
                    value, _ = await _attempts(step, kwargs, step.name, observer, tracer)
                else:
                    value = await run_mapped(step, kwargs)
            except anyio.get_cancelled_exc_class():
                raise
            except Exception as e:
                msg, tb = _format_exc(e)
                n = getattr(e, "__flowrt_attempts__", 1)
                item = getattr(e, "__flowrt_item__", None)
                if item is not None:
                    msg += f" (item {item})"
                if n > 1:
                    msg += f" (after {n} attempts)"
                errors[step.name] = StepError(step.name, msg, tb,
                                              kind="timeout" if isinstance(e, _StepTimeout) else "failed",
                                              attempts=n)
                set_status(step.name, "failed")
            else:
                outputs[step.name] = value
                set_status(step.name, "done")
            finally:
                timings[step.name] = time.perf_counter() - t0
        finally:
            current_step.reset(token)
            done[step.name].set()

    async def run_mapped(step: Step, kwargs: dict[str, Any]) -> list[Any]:
        items = kwargs[step.map]  # type: ignore[index]
        if isinstance(items, (str, bytes, dict)) or not hasattr(items, "__iter__"):
            raise TypeError(f"step {step.name!r} maps over {step.map!r}, which must be a list "
                            f"(got {type(items).__name__})")
        items = list(items)
        results: list[Any] = [None] * len(items)
        if observer is not None:
            observer.items[step.name] = (0, len(items))
        limiter = anyio.CapacityLimiter(step.max_concurrency) if step.max_concurrency else None
        first_error: list[BaseException] = []
        finished = 0

        async def one(i: int, item: Any) -> None:
            nonlocal finished
            token = current_step.set(f"{step.name}[{i}]")
            try:
                if limiter is not None:
                    await limiter.acquire()
                try:
                    results[i], _ = await _attempts(step, {**kwargs, step.map: item}, f"{step.name}[{i}]",
                                                    observer, tracer)
                finally:
                    if limiter is not None:
                        limiter.release()
                finished += 1
                if observer is not None:
                    observer.items[step.name] = (finished, len(items))
            except anyio.get_cancelled_exc_class():
                raise
            except Exception as e:
                if not first_error:
                    if hasattr(e, "add_note"):
                        e.add_note(f"(item {i} of step {step.name!r}: {item!r:.200})")
                    e.__flowrt_item__ = i  # type: ignore[attr-defined]
                    first_error.append(e)
                    tg.cancel_scope.cancel()   # one item failed: the step fails, stop the others
            finally:
                current_step.reset(token)

        async with anyio.create_task_group() as tg:
            for i, item in enumerate(items):
                tg.start_soon(one, i, item)
        if first_error:
            raise first_error[0]
        return results

    if observer is not None:
        observer.phase = ""
    tok = current_tracer.set(tracer)
    threads = RunThreads()
    threads_tok = current_run_threads.set(threads)
    try:
        async with anyio.create_task_group() as tg:
            for name in wf.order():
                tg.start_soon(run_step, wf.steps[name], name=f"flowrt step {name}")
    except BaseException:  # cancelled (or interrupted): release the run's KV now, not at garbage collection
        threads.close_all()
        raise
    finally:
        current_run_threads.reset(threads_tok)
        current_tracer.reset(tok)

    stats = _stats(stats_fn if "llm" in resources else None, {
        "elapsed_s": round(time.perf_counter() - t_start, 6),
        "steps_completed": len(outputs),
        "steps_failed": sum(1 for e in errors.values() if e.kind != "skipped"),
        "steps_skipped": sum(1 for e in errors.values() if e.kind == "skipped"),
        **tracer.llm_totals,
    })
    ordered_outputs = {n: outputs[n] for n in wf.order() if n in outputs}
    ordered_errors = {n: errors[n] for n in wf.order() if n in errors}
    return RunResult(wf.name, ordered_outputs, ordered_errors, stats, timings, wf.sinks(), tracer)


def _stats(engine_fn: Callable[[], dict[str, Any]] | None, run: dict[str, Any]) -> dict[str, Any]:
    """``{"engine": {...}, "run": {...}}`` plus the same numbers flat, as before the groups existed.

    The engine's counters (``generated_tokens``, ``kv_blocks_used``, ...) count every request since the
    engine started, all runs on it together; the run's (``generated_tokens``, ``llm_calls``, ...) count
    this run's calls only. Flat, engine keys keep their names and run token counters are ``run_``-prefixed.
    """
    engine: dict[str, Any] = {}
    if engine_fn is not None:
        try:
            engine = dict(engine_fn())
        except Exception:  # stats are informative: never fail a finished run over them
            engine = {}
    flat_run = {k if k.startswith(("elapsed", "steps_")) else f"run_{k}": v for k, v in run.items()}
    return {**engine, **flat_run, "engine": engine, "run": run}


async def run_workflow(wf: Workflow, provider: ResourceProvider | None = None, /, **inputs: Any) -> RunResult:
    return await execute(wf, inputs, provider)

