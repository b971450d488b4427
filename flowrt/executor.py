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

import networkx as nx

from . import events as ev
from .events import EventSink, current_sink
from .interrupts import Interrupt, InterruptScope
from .interrupts import current_interrupts
from .render import to_jsonable, unrenderable
from .routing import Goto
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
    skipped: dict[str, StepError] = field(default_factory=dict)   # steps no route chose (not errors)
    routes: list[dict[str, Any]] = field(default_factory=list)     # routes taken, in order
    visits: dict[str, int] = field(default_factory=dict)           # steps that ran more than once
    status: str = "done"                # "done", "failed" or "interrupted"
    run_id: str | None = None           # with a checkpointer
    interrupt: dict[str, Any] | None = None   # {"step", "payload"} of an interrupted run

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
        return self.status == "interrupted"

    def to_dict(self) -> dict[str, Any]:
        """``{"outputs": {step: result}, "errors": {step: message}, "stats": {...}}`` (JSON-safe: a result
        that cannot be rendered becomes an ``<unrenderable ...>`` placeholder, the others are kept), plus
        ``"skipped"`` and ``"routes"`` for a workflow that routed, ``"status"``, ``"run_id"`` and
        ``"interrupt"`` for an interrupted run."""
        out = {"outputs": {k: to_jsonable(v) for k, v in self.outputs.items()},
               "errors": {k: to_jsonable(e.message) for k, e in self.errors.items()},
               "stats": to_jsonable(self.stats)}
        if self.skipped:
            out["skipped"] = {k: to_jsonable(e.message) for k, e in self.skipped.items()}
        if self.routes:
            out["routes"] = to_jsonable(self.routes)
        if self.interrupted:
            out.update(status=self.status, run_id=self.run_id, interrupt=to_jsonable(self.interrupt))
        return out

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


async def _attempts(step: Step, kwargs: dict[str, Any], label: str, observer: RunObserver | None,
                    tracer: Tracer, interrupts: InterruptScope | None = None) -> tuple[Any, int]:
    """Run one invocation with retries and a per-attempt timeout; returns (value, attempts)."""
    attempts = step.retries + 1
    for attempt in range(1, attempts + 1):
        if interrupts is not None:
            interrupts.calls[label] = 0   # each attempt asks its interrupts from the first again
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
        except Interrupt:
            tracer.end(span, status="interrupted")
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


class _RunState:
    """What the scheduler knows about a run; a checkpoint is this, serialized (see ``snapshot``).

    ``status`` is per step for the current pass: pending, running, done, failed, skipped (an upstream
    failure or a missing resource), not_routed, interrupted. A loop route back to a step sets it and every
    step after it to pending again (their last results stay until replaced)."""

    def __init__(self, wf: Workflow) -> None:
        self.status: dict[str, str] = {n: "pending" for n in wf.steps}
        self.visits: dict[str, int] = {n: 0 for n in wf.steps}
        self.outputs: dict[str, Any] = {}
        self.errors: dict[str, StepError] = {}
        self.not_routed: dict[str, StepError] = {}
        self.chosen: dict[str, dict[str, Any]] = {}        # router -> {target: value} (this pass)
        self.loop_values: dict[str, dict[str, Any]] = {}   # target -> {router: value}
        self.route_log: list[dict[str, Any]] = []
        self.timings: dict[str, float] = {}
        self.interrupt: dict[str, Any] | None = None


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


async def execute(wf: Workflow, inputs: dict[str, Any], provider: ResourceProvider | None = None, *,
                  tracer: Tracer | None = None, observer: RunObserver | None = None,
                  stats_fn: Callable[[], dict[str, Any]] | None = None, checkpoint: Any = None,
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
    st = _RunState(wf)
    emit = events if events is not None else (lambda ev: None)
    scope = InterruptScope(enabled=checkpoint is not None)
    graph = wf.graph

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
        except Exception as e:  # noqa: BLE001 - reported per resource, run continues
            resource_errors[rname] = f"{type(e).__name__}: {e}"

    restored = checkpoint.start(st, scope, resources.get("llm")) if checkpoint is not None else False
    if restored:
        for name in st.status:
            if name in st.outputs:
                set_status(name, "done")
    emit(ev.RunStarted(wf.name, getattr(checkpoint, "run_id", None), list(wf.steps), resumed=restored))

    changed = anyio.Event()
    halted = False          # an interrupt: start no new steps

    def poke() -> None:
        nonlocal changed
        changed.set()

    def save(step: str | None) -> None:
        if checkpoint is not None:
            checkpoint.save(st, step, threads)

    def resolve(name: str, status: str, err: StepError | None = None) -> None:
        st.status[name] = status
        if status == "done":
            st.errors.pop(name, None)
            st.not_routed.pop(name, None)
        elif status == "not_routed":
            assert err is not None
            if name not in st.outputs:
                st.not_routed[name] = err
            set_status(name, "skipped" if name not in st.outputs else "done")
            emit(ev.StepSkipped(name, err.message))
        elif status in ("failed", "skipped"):
            assert err is not None
            st.outputs.pop(name, None)
            st.not_routed.pop(name, None)
            st.errors[name] = err
            set_status(name, status)
            if status == "skipped":
                emit(ev.StepSkipped(name, err.message))

    def readiness(step: Step) -> str:
        """"wait", "run", or "resolved" (skipped / not routed here and now)."""
        for d in step.deps + step.gates:
            if st.status[d] in ("pending", "running", "interrupted"):
                return "wait"
        failed = [d for d in step.deps + step.gates if st.status[d] in ("failed", "skipped")]
        if failed:
            resolve(step.name, "skipped", StepError(step.name, f"skipped: depends on failed step {failed[0]!r}",
                                                    kind="skipped"))
            return "resolved"
        if step.gates and not any(step.name in st.chosen.get(g, {}) for g in step.gates):
            by = ", ".join(step.gates)
            resolve(step.name, "not_routed", StepError(step.name, f"not routed: {by} chose another route",
                                                       kind="not_routed"))
            return "resolved"
        params = {p.name: p for p in step.params}
        for d in step.deps:
            if st.status[d] == "not_routed" and d not in st.outputs:
                p = params.get(d)
                if p is None or p.has_default:   # ordering only, or a join: the default stands in
                    continue
                resolve(step.name, "not_routed", StepError(
                    step.name, f"not routed: depends on {d!r}, which was not routed", kind="not_routed"))
                return "resolved"
        missing = [r for r in step.resources if r in resource_errors]
        if missing:
            resolve(step.name, "skipped", StepError(step.name, f"skipped: resource {missing[0]!r} is unavailable: "
                                                    f"{resource_errors[missing[0]]}", kind="skipped"))
            return "resolved"
        return "run"

    def kwargs_for(step: Step) -> dict[str, Any]:
        kwargs: dict[str, Any] = {}
        for p in step.params:
            if p.resource:
                kwargs[p.name] = resources[p.resource]
            elif p.name in step.loop_sources:
                kwargs[p.name] = st.loop_values.get(step.name, {}).get(p.name, p.default)
            elif p.name in step.gates:
                kwargs[p.name] = st.chosen.get(p.name, {}).get(step.name, p.default)
            elif p.name in wf.steps:
                kwargs[p.name] = st.outputs[p.name] if p.name in st.outputs else p.default
            elif p.name in inputs:
                kwargs[p.name] = inputs[p.name]
            elif p.has_default:
                kwargs[p.name] = p.default
            else:  # check_inputs guarantees this does not happen
                raise AssertionError(f"input {p.name!r} missing")
        return kwargs

    def take_routes(step: Step, value: Any) -> Any:
        gotos = _as_gotos(step, value)
        loops = [g for g in gotos if (step.name, g.step) in loop_edges]
        forward = [g for g in gotos if (step.name, g.step) not in loop_edges]
        st.route_log.append({"step": step.name, "visit": st.visits[step.name], "to": [g.step for g in gotos]})
        emit(ev.Routed(step.name, [g.step for g in gotos], [g.step for g in loops]))
        for g in loops:
            again = {g.step} | (set(nx.descendants(graph, g.step)) & set(wf.steps))
            for x in again:
                if st.status[x] != "running":
                    st.status[x] = "pending"
                    st.chosen.pop(x, None)
                    st.not_routed.pop(x, None)   # this pass decides again (a last result stays until then)
                    if x != step.name:
                        st.errors.pop(x, None)
            st.loop_values.setdefault(g.step, {})[step.name] = g.value
        if st.status[step.name] == "done":
            st.chosen[step.name] = {g.step: g.value for g in forward}
        if isinstance(value, Goto):
            return value.value
        return [g.value for g in gotos]

    async def run_step(step: Step) -> None:
        nonlocal halted
        token = current_step.set(step.name)
        try:
            st.visits[step.name] += 1
            visit = st.visits[step.name]
            if visit > step.max_visits:
                msg = (f"step {step.name!r} would run a {visit}th time, past max_visits={step.max_visits} (a loop "
                       f"that does not end?); end the loop or raise @wf.step(max_visits=...)")
                st.visits[step.name] -= 1
                resolve(step.name, "failed", StepError(step.name, msg, kind="failed"))
                emit(ev.StepFailed(step.name, visit, msg))
                return
            kwargs = kwargs_for(step)
            set_status(step.name, "running")
            emit(ev.StepStarted(step.name, visit))
            t0 = time.perf_counter()
            try:
                if step.map is None:
                    value, _ = await _attempts(step, kwargs, step.name, observer, tracer, scope)
                else:
                    value = await run_mapped(step, kwargs)
                if step.routes:
                    st.status[step.name] = "done"   # a loop route may set it pending again
                    value = take_routes(step, value)
            except anyio.get_cancelled_exc_class():
                raise
            except Interrupt as e:
                st.status[step.name] = "interrupted"
                st.not_routed.pop(step.name, None)
                st.interrupt = {"step": e.step, "index": e.index, "payload": to_jsonable(e.payload)}
                halted = True
                set_status(step.name, "interrupted")
                emit(ev.Interrupted(e.step, e.payload, getattr(checkpoint, "run_id", None)))
            except Exception as e:  # noqa: BLE001 - step failure is recorded, other steps go on
                msg, tb = _format_exc(e)
                n = getattr(e, "__flowrt_attempts__", 1)
                item = getattr(e, "__flowrt_item__", None)
                if item is not None:
                    msg += f" (item {item})"
                if n > 1:
                    msg += f" (after {n} attempts)"
                resolve(step.name, "failed", StepError(step.name, msg, tb,
                                                       kind="timeout" if isinstance(e, _StepTimeout) else "failed",
                                                       attempts=n))
                emit(ev.StepFailed(step.name, visit, msg, st.errors[step.name].kind))
            else:
                st.outputs[step.name] = value
                if checkpoint is not None:
                    checkpoint.record_output(step.name, value)
                st.errors.pop(step.name, None)
                st.not_routed.pop(step.name, None)
                if st.status[step.name] in ("running", "done"):
                    st.status[step.name] = "done"
                set_status(step.name, "done")
                emit(ev.StepFinished(step.name, visit, round(time.perf_counter() - t0, 6)))
            finally:
                st.timings[step.name] = time.perf_counter() - t0
            save(step.name)
        finally:
            threads.step_done(step.name)  # the step's open threads: "finished" hints to the engine
            current_step.reset(token)
            running.discard(step.name)
            poke()

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
                                                    observer, tracer, scope)
                finally:
                    if limiter is not None:
                        limiter.release()
                finished += 1
                if observer is not None:
                    observer.items[step.name] = (finished, len(items))
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

    if observer is not None:
        observer.phase = ""
    loop_edges = set(wf.loop_edges)
    order = wf.order()
    running: set[str] = set()
    tok = current_tracer.set(tracer)
    threads = RunThreads(getattr(checkpoint, "run_id", None))   # a checkpointed run: its durable id
    threads_tok = current_run_threads.set(threads)
    sink_tok = current_sink.set(events)
    int_tok = current_interrupts.set(scope)
    try:
        async with anyio.create_task_group() as tg:
            while True:
                progressed = True
                while progressed:   # skips resolve at once and may unblock others
                    progressed = False
                    for name in order:
                        if st.status[name] != "pending" or name in running:
                            continue
                        r = readiness(wf.steps[name])
                        if r == "resolved":
                            progressed = True
                        elif r == "run" and not halted:
                            st.status[name] = "running"
                            running.add(name)
                            tg.start_soon(run_step, wf.steps[name], name=f"flowrt step {name}")
                if not running:
                    break
                changed = anyio.Event()
                await changed.wait()
    except BaseException:  # cancelled (or interrupted): release the run's KV now, not at garbage collection
        threads.close_all()
        raise
    finally:
        current_interrupts.reset(int_tok)
        current_sink.reset(sink_tok)
        current_run_threads.reset(threads_tok)
        current_tracer.reset(tok)

    status = "interrupted" if st.interrupt is not None else (
        "failed" if any(e.kind != "skipped" for e in st.errors.values()) else "done")
    run_stats = {
        "elapsed_s": round(time.perf_counter() - t_start, 6),
        "steps_completed": len(st.outputs),
        "steps_failed": sum(1 for e in st.errors.values() if e.kind != "skipped"),
        "steps_skipped": sum(1 for e in st.errors.values() if e.kind == "skipped"),
        **tracer.llm_totals,
    }
    if wf.has_routes:
        run_stats["steps_not_routed"] = len(st.not_routed)
    stats = _stats(stats_fn if "llm" in resources else None, run_stats)
    ordered_outputs = {n: st.outputs[n] for n in order if n in st.outputs}
    ordered_errors = {n: st.errors[n] for n in order if n in st.errors and n not in st.outputs}
    result = RunResult(wf.name, ordered_outputs, ordered_errors, stats, dict(st.timings), wf.sinks(), tracer,
                       skipped={n: st.not_routed[n] for n in order if n in st.not_routed},
                       routes=list(st.route_log), visits={n: v for n, v in st.visits.items() if v > 1},
                       status=status, run_id=getattr(checkpoint, "run_id", None), interrupt=st.interrupt)
    if checkpoint is not None:
        checkpoint.finish(st, status, threads)
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
    flat_run = {k if k.startswith(("elapsed", "steps_")) else f"run_{k}": v for k, v in run.items()}
    return {**engine, **flat_run, "engine": engine, "run": run}
