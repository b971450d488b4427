"""The DAG executor: starts every step whose inputs are ready, concurrently (anyio task group), so the
engine sees every LLM call that can happen at a given moment and batches them.

* async steps run on the event loop; sync steps run in daemon threads (flowrt.worker);
* a mapped step runs once per item, concurrently (bounded by ``max_concurrency``);
* ``retries`` re-runs a failed attempt, ``timeout`` bounds each attempt (a sync step that overruns is
  abandoned: Python cannot stop a thread, so it runs on in the background, its result is dropped, and
  being a daemon thread it never keeps the process from exiting);
* a failing step fails alone: steps that depend on it are skipped (with the reason), every other branch
  runs to completion, and the result keeps all that completed next to the error and its traceback;
* a subgraph step (``wf.step(sub)``) or ``fr.subflow`` runs a child ``WorkflowRun`` inside the step: the
  run's tracer, events, interrupts and checkpoint are shared, its step names are prefixed by its path.
"""

from __future__ import annotations

import json
import logging
import time
import traceback as tb_mod
from contextvars import ContextVar, Token
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Protocol

import anyio

import networkx as nx

from .. import events as ev
from ..context import RunThreads, current_run_threads, current_sink, current_step, current_tracer
from ..events import EventSink
from ..graph.routing import Goto
from ..graph.workflow import Step, Workflow
from ..render import to_jsonable, unrenderable
from ..worker import run_sync_abandonable
from .checkpointer import Checkpointer
from .interrupts import Interrupt, InterruptScope, current_interrupts
from .step_cache import cached
from .state import PendingInterrupt, RouteTaken, RunState, RunStatus, StepError, StepStatus, step_of
from .trace import Tracer

logger = logging.getLogger("flowrt.runner")

__all__ = ["RunResult", "StepError", "StepFailed", "RunObserver", "WorkflowRun", "execute", "load_resources",
           "ResourceProvider", "to_jsonable", "subflow", "run_subgraph", "SubgraphFailed", "StepStatus", "RunStatus"]

S = StepStatus
Readiness = Literal["wait", "run", "resolved"]


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
    skipped: dict[str, StepError] = field(default_factory=dict)   # steps no route chose (not errors)
    routes: list[RouteTaken] = field(default_factory=list)         # routes taken, in order
    visits: dict[str, int] = field(default_factory=dict)           # steps that ran more than once
    status: RunStatus = RunStatus.DONE  # done, failed or interrupted
    run_id: str | None = None           # with a checkpointer
    interrupt: PendingInterrupt | None = None   # {"step", "index", "payload"} of an interrupted run (its first)
    interrupts: list[PendingInterrupt] = field(default_factory=list)   # every pending one (parallel branches)

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

    @property
    def interrupted(self) -> bool:
        return self.status == RunStatus.INTERRUPTED

    def to_dict(self) -> dict[str, Any]:
        """``{"outputs": {step: result}, "errors": {step: message}, "stats": {...}}`` (JSON-safe: a result
        that cannot be rendered becomes an ``<unrenderable ...>`` placeholder, the others are kept), plus
        ``"skipped"`` and ``"routes"`` for a workflow that routed, ``"status"``, ``"run_id"`` and
        ``"interrupt"`` for an interrupted run."""
        out: dict[str, Any] = {"outputs": {k: to_jsonable(v) for k, v in self.outputs.items()},
                               "errors": {k: to_jsonable(e.message) for k, e in self.errors.items()},
                               "stats": to_jsonable(self.stats)}
        if self.skipped:
            out["skipped"] = {k: to_jsonable(e.message) for k, e in self.skipped.items()}
        if self.routes:
            out["routes"] = to_jsonable(self.routes)
        if self.interrupted:
            out.update(status=self.status, run_id=self.run_id, interrupt=to_jsonable(self.interrupt),
                       interrupts=to_jsonable(self.interrupts))
        return out

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent, ensure_ascii=False)


class ResourceProvider(Protocol):
    async def get_resource(self, name: str) -> Any: ...


class RunObserver:
    """Live state of a run, updated by the executor (the CLI's progress display reads it)."""

    def __init__(self, workflow: Workflow) -> None:
        self.workflow = workflow
        self.status: dict[str, StepStatus] = {name: S.PENDING for name in workflow.steps}
        self.started: dict[str, float] = {}
        self.finished: dict[str, float] = {}
        self.items: dict[str, tuple[int, int]] = {}       # mapped steps: (done, total)
        self.attempts: dict[str, int] = {}
        self.cache: dict[str, str] = {}                   # fr.Cache steps: "hit" or "miss" (step_cache)
        self.phase = ""                                   # e.g. "loading llm"
        self.t0 = time.perf_counter()

    def on_status(self, step: str, status: StepStatus) -> None:
        self.status[step] = status
        now = time.perf_counter()
        if status == S.RUNNING:
            self.started.setdefault(step, now)
        elif status in (S.DONE, S.FAILED, S.SKIPPED):
            self.finished[step] = now

    def counts(self) -> dict[str, int]:
        out = {str(s): 0 for s in (S.PENDING, S.RUNNING, S.DONE, S.FAILED, S.SKIPPED)}
        for s in self.status.values():
            out[str(s)] = out.get(str(s), 0) + 1
        return out


def _message(e: BaseException) -> str:
    try:
        text = str(e)
    except Exception as bad:  # noqa: BLE001 - an exception whose __str__ raises must not take the run down
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


def _as_gotos(step: Step, value: Any) -> list[Goto]:
    gotos = [value] if isinstance(value, Goto) else value
    if not isinstance(gotos, (list, tuple)) or not all(isinstance(g, Goto) for g in gotos):
        raise TypeError(f"step {step.name!r} declares routes={list(step.routes)} and must return fr.goto(step, "
                        f"value) or a list of them, got {type(value).__name__}")
    for g in gotos:
        if g.step not in step.routes:
            raise ValueError(f"step {step.name!r} routed to {g.step!r}, which is not one of its routes "
                             f"({', '.join(step.routes)})")
    names = [g.step for g in gotos]
    if len(set(names)) != len(names):
        raise ValueError(f"step {step.name!r} routed to {names}: each route at most once")
    return list(gotos)


def _failure(step: Step, e: BaseException) -> StepError:
    """The StepError of a step whose (last) attempt raised ``e``."""
    msg, tb = _format_exc(e)
    n = getattr(e, "__flowrt_attempts__", 1)
    item = getattr(e, "__flowrt_item__", None)
    if item is not None:
        msg += f" (item {item})"
    if n > 1:
        msg += f" (after {n} attempts)"
    return StepError(step.name, msg, tb, kind="timeout" if isinstance(e, _StepTimeout) else "failed", attempts=n)


class WorkflowRun:
    """One run of a workflow: its state and the scheduler's decisions, one method each.

    ``execute`` builds one and calls ``run``; the methods also work alone (tests drive ``readiness``,
    ``kwargs_for``, ``take_routes``, ``run_step`` ... with plain Python steps, no engine). ``resources``:
    the loaded resources by name; ``resource_errors``: why the others could not be loaded."""

    def __init__(self, wf: Workflow, inputs: dict[str, Any], *, resources: dict[str, Any] | None = None,
                 resource_errors: dict[str, str] | None = None, tracer: Tracer | None = None,
                 observer: RunObserver | None = None, checkpoint: Checkpointer | None = None,
                 events: EventSink | None = None, provider: ResourceProvider | None = None,
                 parent: WorkflowRun | None = None, path: str = "") -> None:
        self.wf = wf
        self.inputs = inputs
        self.resources = dict(resources or {})
        self.resource_errors = dict(resource_errors or {})
        self.provider = provider
        self.st = RunState.new(wf.steps)
        self.parent = parent
        self.path = path                      # a subgraph's: "research" (its steps are "research/...")
        # a subgraph's path below its parent run's, the key of its state in the parent's (RunState.children)
        below = parent.path + "/" if parent is not None and parent.path else ""
        self.key = path[len(below):] if below and path.startswith(below) else path
        if parent is None:
            self.root: WorkflowRun = self
            self.tracer = tracer or Tracer()
            self.observer = observer
            self.checkpoint = checkpoint
            self.events = events
            self.scope = InterruptScope(enabled=checkpoint is not None)
            self.threads = RunThreads(checkpoint.run_id if checkpoint is not None else None)   # its durable id
            self.subflow_calls: dict[str, int] = {}   # "label/sub" -> subflow calls in the current attempt
        else:   # a subgraph: its steps are the parent run's (one tracer, event sink, checkpoint, interrupts)
            self.root = parent.root
            self.tracer, self.observer, self.checkpoint = parent.tracer, None, parent.checkpoint
            self.events, self.scope, self.threads = parent.events, parent.scope, parent.threads
        self.running: set[str] = set()
        self.halted = False          # an interrupt: start no new steps
        self.changed = anyio.Event()
        self.order = wf.order()
        self.loop_edges = set(wf.loop_edges)
        self._graph = wf.graph

    # ------------------------------------------------------------------ bookkeeping
    def label(self, name: str) -> str:
        """A step's name as events, traces and checkpoints show it: its path (``research/search``)."""
        return f"{self.path}/{name}" if self.path else name

    def emit(self, event: ev.Event) -> None:
        if self.events is not None:
            self.events(event)

    def set_status(self, name: str, status: StepStatus) -> None:
        if self.observer is not None:
            self.observer.on_status(name, status)

    def save(self, step: str | None) -> None:
        """Checkpoint the run's state (after ``step``; None: the run's end)."""
        if self.checkpoint is None:
            return
        if self.parent is None:
            self.checkpoint.save(self.st, step, self.threads)
        elif step is not None:   # the whole run's state, saved at this subgraph step
            self.checkpoint.save(self.root.st, self.label(step), self.threads, at=self.st)

    def restore(self) -> bool:
        """Fill the state from the checkpoint (a resume; for a subgraph, the state its last run left);
        False for a new run."""
        if self.checkpoint is None:
            return False
        if self.parent is not None:
            saved = self.parent.st.restoring.pop(self.key, None)
            self.parent.st.children[self.key] = self.st
            if saved is None:
                return False
            self.checkpoint.restore_into(self.st, saved, self.resources.get("llm"), self.path)
            return True
        token = current_run_threads.set(self.threads)   # threads restored from token ids are the run's too
        try:
            restored = self.checkpoint.start(self.st, self.scope, self.resources.get("llm"))
        finally:
            current_run_threads.reset(token)
        if restored:
            for name in self.st.status:
                if name in self.st.outputs:
                    self.set_status(name, S.DONE)
        return bool(restored)

    def resolve(self, name: str, status: StepStatus, err: StepError | None = None) -> None:
        """Record that ``name`` ended as ``status`` without a new output of its own (or ``done``)."""
        st = self.st
        st.status[name] = status
        if status == S.DONE:
            st.errors.pop(name, None)
            st.not_routed.pop(name, None)
        elif status == S.NOT_ROUTED:
            assert err is not None
            if name not in st.outputs:
                st.not_routed[name] = err
            self.set_status(name, S.SKIPPED if name not in st.outputs else S.DONE)
            self.emit(ev.StepSkipped(self.label(name), err.message))
        elif status in (S.FAILED, S.SKIPPED):
            assert err is not None
            st.outputs.pop(name, None)
            st.not_routed.pop(name, None)
            st.errors[name] = err
            self.set_status(name, status)
            if status == S.SKIPPED:
                self.emit(ev.StepSkipped(self.label(name), err.message))

    # ------------------------------------------------------------------ decisions
    def readiness(self, step: Step) -> Readiness:
        """"wait", "run", or "resolved" (skipped / not routed here and now)."""
        st = self.st
        for d in step.deps + step.gates:
            if st.status[d] in (S.PENDING, S.RUNNING, S.INTERRUPTED):
                return "wait"
        failed = [d for d in step.deps + step.gates if st.status[d] in (S.FAILED, S.SKIPPED)]
        if failed:
            self.resolve(step.name, S.SKIPPED, StepError(
                step.name, f"skipped: depends on failed step {failed[0]!r}", kind="skipped"))
            return "resolved"
        if step.gates and not any(step.name in st.chosen.get(g, {}) for g in step.gates):
            by = ", ".join(step.gates)
            self.resolve(step.name, S.NOT_ROUTED, StepError(
                step.name, f"not routed: {by} chose another route", kind="not_routed"))
            return "resolved"
        params = {p.name: p for p in step.params}
        for d in step.deps:
            if st.status[d] == S.NOT_ROUTED and d not in st.outputs:
                p = params.get(d)
                if p is None or p.has_default:   # ordering only, or a join: the default stands in
                    continue
                self.resolve(step.name, S.NOT_ROUTED, StepError(
                    step.name, f"not routed: depends on {d!r}, which was not routed", kind="not_routed"))
                return "resolved"
        if self.skip_if_unavailable(step):
            return "resolved"
        return "run"

    def skip_if_unavailable(self, step: Step) -> bool:
        """Skip ``step`` (True) when a resource it needs could not be loaded."""
        missing = [r for r in step.resources if r in self.resource_errors]
        if missing:
            self.resolve(step.name, S.SKIPPED, StepError(
                step.name, f"skipped: resource {missing[0]!r} is unavailable: "
                f"{self.resource_errors[missing[0]]}", kind="skipped"))
        return bool(missing)

    async def load_missing(self, step: Step) -> bool:
        """Load the resources ``step`` needs that were not loaded before the run (a resume loads only those of
        the steps that run again; a loop route may send it back to another); False when one cannot be (the
        step is skipped)."""
        missing = [r for r in step.resources if r not in self.resources and r not in self.resource_errors]
        if missing:
            loaded, errors = await load_resources(self.wf, self.provider, self.observer, only=missing)
            self.resources.update(loaded)
            self.root.resources.update(loaded)   # the run's stats include the engine's once it is loaded
            self.resource_errors.update(errors)
        return not self.skip_if_unavailable(step)

    def kwargs_for(self, step: Step) -> dict[str, Any]:
        """The step's arguments: resources, route values, upstream results, inputs, defaults."""
        st = self.st
        kwargs: dict[str, Any] = {}
        for p in step.params:
            if p.resource:
                kwargs[p.name] = self.resources[p.resource]
            elif p.name in step.loop_sources:
                kwargs[p.name] = st.loop_values.get(step.name, {}).get(p.name, p.default)
            elif p.name in step.gates:
                kwargs[p.name] = st.chosen.get(p.name, {}).get(step.name, p.default)
            elif p.name in self.wf.steps:
                kwargs[p.name] = st.outputs[p.name] if p.name in st.outputs else p.default
            elif p.name in self.inputs:
                kwargs[p.name] = self.inputs[p.name]
            elif p.has_default:
                kwargs[p.name] = p.default
            else:  # check_inputs guarantees this does not happen
                raise AssertionError(f"input {p.name!r} missing")
        return kwargs

    def take_routes(self, step: Step, value: Any) -> Any:
        """Apply the routes a routing step returned; returns the value the step's result keeps."""
        st = self.st
        gotos = _as_gotos(step, value)
        loops = [g for g in gotos if (step.name, g.step) in self.loop_edges]
        forward = [g for g in gotos if (step.name, g.step) not in self.loop_edges]
        st.route_log.append({"step": step.name, "visit": st.visits[step.name], "to": [g.step for g in gotos]})
        self.emit(ev.Routed(self.label(step.name), [self.label(g.step) for g in gotos],
                            [self.label(g.step) for g in loops]))
        for g in loops:
            again = {g.step} | (set(nx.descendants(self._graph, g.step)) & set(self.wf.steps))
            for x in again:
                if st.status[x] != S.RUNNING:
                    st.status[x] = S.PENDING
                    st.chosen.pop(x, None)
                    st.not_routed.pop(x, None)   # this pass decides again (a last result stays until then)
                    if x != step.name:
                        st.errors.pop(x, None)
            st.loop_values.setdefault(g.step, {})[step.name] = g.value
        if st.status[step.name] == S.DONE:
            st.chosen[step.name] = {g.step: g.value for g in forward}
        if isinstance(value, Goto):
            return value.value
        return [g.value for g in gotos]

    # ------------------------------------------------------------------ running steps
    async def attempts(self, step: Step, kwargs: dict[str, Any], label: str) -> tuple[Any, int]:
        """Run one invocation with retries and a per-attempt timeout; returns (value, attempts)."""
        total = step.retries + 1
        for attempt in range(1, total + 1):
            self.scope.calls[label] = 0   # each attempt asks its interrupts (and subflows) from the first again
            for k in [k for k in self.root.subflow_calls if k.startswith(label + "/")]:
                del self.root.subflow_calls[k]
            if self.observer is not None:
                self.observer.attempts[step.name] = max(self.observer.attempts.get(step.name, 0), attempt)
            span = self.tracer.start(label, "step", step=self.label(step.name), attempt=attempt)
            try:
                value = await self._attempt(step, kwargs)
            except anyio.get_cancelled_exc_class():
                self.tracer.end(span, status="cancelled")
                raise
            except Interrupt:
                self.tracer.end(span, status="interrupted")
                raise
            except Exception as e:
                self.tracer.end(span, status="error", error=_message(e))
                if attempt >= total:
                    e.__flowrt_attempts__ = attempt  # type: ignore[attr-defined]
                    raise
                if step.retry_delay:
                    await anyio.sleep(step.retry_delay * (2 ** (attempt - 1)))
                continue
            self.tracer.end(span, status="ok")
            return value, attempt
        raise AssertionError("unreachable")

    async def _attempt(self, step: Step, kwargs: dict[str, Any]) -> Any:
        if step.timeout is None:
            return await _call_once(step, kwargs)
        with anyio.move_on_after(step.timeout):
            return await _call_once(step, kwargs)
        raise _StepTimeout(f"step {step.name!r} timed out after {step.timeout:g}s")

    async def run_mapped(self, step: Step, kwargs: dict[str, Any]) -> list[Any]:
        """Run ``step`` once per item of its ``map`` parameter, concurrently; the first failure fails it."""
        mapped = step.map
        assert mapped is not None, f"step {step.name!r} is not mapped"
        items = kwargs[mapped]
        if isinstance(items, (str, bytes, dict)) or not hasattr(items, "__iter__"):
            raise TypeError(f"step {step.name!r} maps over {mapped!r}, which must be a list "
                            f"(got {type(items).__name__})")
        items = list(items)
        results: list[Any] = [None] * len(items)
        if self.observer is not None:
            self.observer.items[step.name] = (0, len(items))
        limiter = anyio.CapacityLimiter(step.max_concurrency) if step.max_concurrency else None
        first_error: list[BaseException] = []
        finished = 0

        async def one(i: int, item: Any) -> None:
            nonlocal finished
            label = f"{self.label(step.name)}[{i}]"
            token = current_step.set(label)
            try:
                if limiter is not None:
                    async with limiter:
                        results[i], _ = await self.attempts(step, {**kwargs, mapped: item}, label)
                else:
                    results[i], _ = await self.attempts(step, {**kwargs, mapped: item}, label)
                finished += 1
                if self.observer is not None:
                    self.observer.items[step.name] = (finished, len(items))
            except anyio.get_cancelled_exc_class():
                raise
            except Exception as e:  # noqa: BLE001 - first item error kept, re-raised after
                if not first_error:
                    if hasattr(e, "add_note") and not isinstance(e, Interrupt):
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

    async def run_step(self, step: Step) -> None:
        """Run one visit of ``step`` and record how it ended (result, failure, interrupt); checkpoint."""
        label = self.label(step.name)
        token = current_step.set(label)
        try:
            if not await self.load_missing(step):
                return
            visit = self._next_visit(step)
            if visit is None:
                return
            kwargs = self.kwargs_for(step)
            self.set_status(step.name, S.RUNNING)
            self.emit(ev.StepStarted(label, visit))
            t0 = time.perf_counter()
            try:
                value = await cached(self, step, kwargs, self._invoke)   # fr.Cache steps: flowrt.runner.step_cache
            except anyio.get_cancelled_exc_class():
                self.hold_threads(label)   # the run is stopped: the checkpoint it saves keeps their KV
                raise
            except Interrupt as e:
                self.on_interrupt(step, e)
            except Exception as e:  # noqa: BLE001 - step failure is recorded, other steps go on
                self.resolve(step.name, S.FAILED, _failure(step, e))
                self.emit(ev.StepFailed(label, visit, self.st.errors[step.name].message,
                                        self.st.errors[step.name].kind))
            else:
                self.on_result(step, value, visit, time.perf_counter() - t0)
            finally:
                self.st.timings[step.name] = time.perf_counter() - t0
            if self.st.status[step.name] != S.INTERRUPTED:
                self.drop_children(step.name)
            self.save(step.name)
        finally:
            self.threads.step_done(label)  # the step's open threads: "finished" hints to the engine
            current_step.reset(token)
            self.running.discard(step.name)
            self.changed.set()

    def _next_visit(self, step: Step) -> int | None:
        """Count a visit; None (and the step failed) past ``max_visits``."""
        self.st.visits[step.name] += 1
        visit = self.st.visits[step.name]
        if visit <= step.max_visits:
            return visit
        msg = (f"step {step.name!r} would run a {visit}th time, past max_visits={step.max_visits} (a loop "
               f"that does not end?); end the loop or raise @wf.step(max_visits=...)")
        self.st.visits[step.name] -= 1
        self.resolve(step.name, S.FAILED, StepError(step.name, msg, kind="failed"))
        self.emit(ev.StepFailed(self.label(step.name), visit, msg))
        return None

    async def _invoke(self, step: Step, kwargs: dict[str, Any]) -> Any:
        if step.map is None:
            value, _ = await self.attempts(step, kwargs, self.label(step.name))
        else:
            value = await self.run_mapped(step, kwargs)
        if step.routes:
            self.st.status[step.name] = S.DONE   # a loop route may set it pending again
            value = self.take_routes(step, value)
        return value

    def hold_threads(self, label: str) -> None:
        """Keep the token ids of the live threads the step at ``label`` opened (its frames still hold them
        here), for the checkpoints saved while it has not ended."""
        held = self.threads.opened_within(label)
        if held:
            self.root.st.held_threads[label] = held

    def on_interrupt(self, step: Step, e: Interrupt) -> None:
        """The step asked for an answer (or a subgraph it runs, for one or more): the run starts no new steps
        and ends interrupted, every pending interrupt listed."""
        st = self.st
        st.status[step.name] = S.INTERRUPTED
        st.not_routed.pop(step.name, None)
        own = e.pending is None
        infos: list[PendingInterrupt] = ([{"step": e.step, "index": e.index, "payload": to_jsonable(e.payload)}]
                                         if e.pending is None else e.pending)
        st.interrupts.extend(infos)
        st.interrupt = st.interrupt or infos[0]
        if e.threads:
            self.root.st.held_threads[e.step] = e.threads
        self.halted = True
        self.set_status(step.name, S.INTERRUPTED)
        if self.parent is None:   # a subgraph's interrupts reach the parent's step, which reports them
            run_id = self.checkpoint.run_id if self.checkpoint is not None else None
            for info in infos:
                self.emit(ev.Interrupted(info["step"], e.payload if own else info["payload"], run_id))

    def on_result(self, step: Step, value: Any, visit: int, seconds: float) -> None:
        st = self.st
        st.outputs[step.name] = value
        if self.checkpoint is not None:
            self.checkpoint.record_output(st, step.name, value)
        st.errors.pop(step.name, None)
        st.not_routed.pop(step.name, None)
        if st.status[step.name] in (S.RUNNING, S.DONE):
            st.status[step.name] = S.DONE
        self.set_status(step.name, S.DONE)
        self.emit(ev.StepFinished(self.label(step.name), visit, round(seconds, 6)))

    def drop_children(self, name: str) -> None:
        """Step ``name`` ended (not interrupted): the subgraph states and held threads it kept are no longer
        needed (a later visit starts them afresh)."""
        for key in [k for k in self.st.children if step_of(k) == name]:
            del self.st.children[key]
        label, held = self.label(name), self.root.st.held_threads
        for k in [k for k in held if k == label or k.startswith((label + "/", label + "["))]:
            del held[k]

    # ------------------------------------------------------------------ the loop
    def start_ready(self, tg: Any) -> bool:
        """One pass over the pending steps: resolve those that cannot run, start those that can (unless
        halted). True when something was resolved (which may unblock others)."""
        progressed = False
        for name in self.order:
            if self.st.status[name] != S.PENDING or name in self.running:
                continue
            r = self.readiness(self.wf.steps[name])
            if r == "resolved":
                progressed = True
            elif r == "run" and not self.halted:
                self.st.status[name] = S.RUNNING
                self.running.add(name)
                tg.start_soon(self.run_step, self.wf.steps[name], name=f"flowrt step {name}")
        return progressed

    async def run(self) -> None:
        """Run the steps until none can start and none is running (in the run's context variables)."""
        tokens: list[tuple[ContextVar[Any], Token[Any]]] = [
            (current_tracer, current_tracer.set(self.tracer)),
            (current_run_threads, current_run_threads.set(self.threads)),
            (current_sink, current_sink.set(self.events)),
            (current_interrupts, current_interrupts.set(self.scope)),
            (current_run, current_run.set(self))]
        try:
            async with anyio.create_task_group() as tg:
                while True:
                    while self.start_ready(tg):   # skips resolve at once and may unblock others
                        pass
                    if not self.running:
                        break
                    self.changed = anyio.Event()
                    await self.changed.wait()
        except BaseException as e:  # cancelled (or interrupted): release the run's KV now, not at garbage collection
            if self.parent is None:
                if isinstance(e, anyio.get_cancelled_exc_class()):
                    self.save_stopped()
                self.threads.close_all()
            raise
        finally:
            for var, tok in reversed(tokens):
                var.reset(tok)

    def save_stopped(self) -> None:
        """The run is stopped mid-step (a server's shutdown, Ctrl-C, SIGTERM) and saves KV checkpoints:
        checkpoint it with the KV of the threads it holds, so that a resume in a fresh process computes only
        what its steps add (without KV its last checkpoint stands, as after a crash)."""
        if self.checkpoint is None or not self.checkpoint.saves_kv:
            return
        from ..checkpoint import CheckpointError

        try:
            self.checkpoint.save(self.st, None, self.threads)
        except CheckpointError as e:   # the lease was lost, the store is gone: the last checkpoint stands
            logger.warning("run %s stopped: its checkpoint was not saved (%s)", self.checkpoint.run_id, e)

    def status(self) -> RunStatus:
        st = self.st
        if st.interrupt is not None:
            return RunStatus.INTERRUPTED
        return RunStatus.FAILED if any(e.kind != "skipped" for e in st.errors.values()) else RunStatus.DONE

    def result(self, elapsed: float, stats_fn: Callable[[], dict[str, Any]] | None) -> RunResult:
        st, wf, order = self.st, self.wf, self.order
        run_stats = {
            "elapsed_s": round(elapsed, 6),
            "steps_completed": len(st.outputs),
            "step_runs": sum(st.visits.values()),   # a loop's step counts once per run of it (retries do not)
            "steps_failed": sum(1 for e in st.errors.values() if e.kind != "skipped"),
            "steps_skipped": sum(1 for e in st.errors.values() if e.kind == "skipped"),
            **self.tracer.llm_totals,
        }
        if wf.has_routes:
            run_stats["steps_not_routed"] = len(st.not_routed)
        stats = _stats(stats_fn if "llm" in self.resources else None, run_stats)
        return RunResult(wf.name, {n: st.outputs[n] for n in order if n in st.outputs},
                         {n: st.errors[n] for n in order if n in st.errors and n not in st.outputs},
                         stats, dict(st.timings), wf.sinks(), self.tracer,
                         skipped={n: st.not_routed[n] for n in order if n in st.not_routed},
                         routes=list(st.route_log), visits={n: v for n, v in st.visits.items() if v > 1},
                         status=self.status(), run_id=self.checkpoint.run_id if self.checkpoint is not None else None,
                         interrupt=st.interrupt, interrupts=list(st.interrupts))


async def load_resources(wf: Workflow, provider: ResourceProvider | None, observer: RunObserver | None = None,
                         only: list[str] | None = None) -> tuple[dict[str, Any], dict[str, str]]:
    """The resources ``wf`` needs (or ``only`` these), loaded once before any step starts: (loaded, why
    not for the others)."""
    resources: dict[str, Any] = {}
    errors: dict[str, str] = {}
    for rname in only if only is not None else wf.resources:
        if observer is not None:
            observer.phase = f"loading {rname}"
        if provider is None:
            errors[rname] = f"no runtime provides the resource {rname!r}"
            continue
        try:
            resources[rname] = await provider.get_resource(rname)
        except Exception as e:  # noqa: BLE001 - reported per resource, run continues
            errors[rname] = f"{type(e).__name__}: {e}"
    if observer is not None:
        observer.phase = ""
    return resources, errors


async def execute(wf: Workflow, inputs: dict[str, Any], provider: ResourceProvider | None = None, *,
                  tracer: Tracer | None = None, observer: RunObserver | None = None,
                  stats_fn: Callable[[], dict[str, Any]] | None = None, checkpoint: Checkpointer | None = None,
                  events: EventSink | None = None) -> RunResult:
    """Run ``wf`` once. Invalid inputs raise ``WorkflowError`` before any step starts; step failures are
    reported in the result, never raised.

    ``checkpoint``: a ``flowrt.checkpoint.RunCheckpoint`` (the run's state is saved after every step, and
    a resumed run starts from its last state); ``events``: where run events go (flowrt.events)."""
    wf.validate()
    inputs = wf.check_inputs(inputs)
    tracer = tracer or Tracer(stats_fn=stats_fn)
    if tracer.stats_fn is None:
        tracer.stats_fn = stats_fn
    t_start = time.perf_counter()
    upfront = checkpoint.resources_to_continue(wf) if checkpoint is not None else None
    resources, resource_errors = await load_resources(wf, provider, observer, only=upfront)
    run = WorkflowRun(wf, inputs, resources=resources, resource_errors=resource_errors, tracer=tracer,
                      observer=observer, checkpoint=checkpoint, events=events, provider=provider)
    restored = run.restore()
    run.emit(ev.RunStarted(wf.name, checkpoint.run_id if checkpoint is not None else None, list(wf.steps),
                           resumed=restored))
    await run.run()
    result = run.result(time.perf_counter() - t_start, stats_fn)
    if checkpoint is not None:
        await checkpoint.kv_flushed()
        checkpoint.finish(run.st, result.status, run.threads)
    return result


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
        except Exception:  # noqa: BLE001 - stats are informative: never fail a finished run over them
            engine = {}
    flat_run = {k if k.startswith(("elapsed", "step")) else f"run_{k}": v for k, v in run.items()}
    return {**engine, **flat_run, "engine": engine, "run": run}


current_run: ContextVar[WorkflowRun | None] = ContextVar("flowrt_run", default=None)


class SubgraphFailed(RuntimeError):
    """A subgraph's run failed: the first failing step's path and message."""


async def run_subgraph(sub: Workflow, inputs: dict[str, Any], *, output: str | None = None,
                       path: str | None = None) -> Any:
    """Run ``sub`` inside the current run under ``path`` (default: the current step's label) and return
    its result (its last step's, or ``output``'s). An interrupt inside pauses the whole run; a failure
    raises ``SubgraphFailed``."""
    parent = current_run.get()
    label = current_step.get()
    if parent is None or label is None:
        raise RuntimeError("a subgraph runs inside a workflow step (fr.subflow, wf.step(sub))")
    sub.validate()
    inputs = sub.check_inputs(inputs)
    resources = {r: parent.resources[r] for r in sub.resources if r in parent.resources}
    missing = [r for r in sub.resources if r not in resources]
    loaded, errors = await load_resources(sub, parent.provider, only=missing) if missing else ({}, {})
    child = WorkflowRun(sub, inputs, resources={**resources, **loaded}, resource_errors=errors,
                        provider=parent.provider, parent=parent, path=path or label)
    child.restore()
    await child.run()
    if child.st.interrupt is not None:   # every pending one reaches the parent, each answered by its path
        i = child.st.interrupt
        raise Interrupt(i["payload"], i["step"], i["index"], pending=list(child.st.interrupts))
    result = child.result(0.0, None)
    bad = next((e for e in result.errors.values() if e.kind != "skipped"), None)
    if bad is not None:
        raise SubgraphFailed(f"subgraph step {child.label(bad.step)!r} {bad.kind}: {bad.message}")
    return result[output] if output is not None else result.output


async def subflow(sub: Workflow, /, **inputs: Any) -> Any:
    """Run the workflow ``sub`` from inside a step, as part of this run: ``await fr.subflow(agent, q=q)``.

    Its steps' events, traces and checkpoints carry the path ``step/sub`` (``step/sub#2`` for the second
    call in the same step), a resume continues inside it, and an interrupt inside it pauses the run.
    Returns its last step's result."""
    label = current_step.get()
    run = current_run.get()
    if run is None or label is None:
        raise RuntimeError("fr.subflow() can only be called inside a workflow step")
    key = f"{label}/{sub.name}"
    n = run.root.subflow_calls.get(key, 0) + 1
    run.root.subflow_calls[key] = n
    return await run_subgraph(sub, inputs, path=key if n == 1 else f"{key}#{n}")
