"""Workflows as endpoints: ``POST /v1/workflows/{name}/runs``, ``POST /v1/workflows/{name}/runs/{id}/resume``,
``GET /v1/workflows/{name}/runs/{id}/history``, ``POST /v1/workflows/{name}/runs/{id}/fork`` and
``GET /v1/workflows``.

Body ``{"inputs": {...}, "stream": false, "stream_tokens": false}``. Runs the workflow on the server's engine
(through an ``fr.Runtime`` sharing it, so workflow steps batch with API requests) and returns the same JSON as
``flowrt run --json``: ``{"outputs": {...}, "errors": {...}, "stats": {...}}`` (200 even when a step
failed: the failure is in ``errors``, as with ``flowrt run``). With ``"stream": true`` the response is
Server-Sent Events: ``step`` events as steps start and finish, a final ``result`` event holding the JSON
above, then ``data: [DONE]``; ``"stream_tokens": true`` adds a ``token`` event for every piece of text a thread
generates (``{"step", "thread_id", "fork_index", "text", "token_ids"}``) and ``route`` / ``interrupt``
events. Each workflow is served under its own name, ``fr.Workflow("name")``.

Every run is checkpointed (in memory, or in ``flowrt serve --checkpoint runs.db``); its id is in the
``X-Flowrt-Run-Id`` header. A step that calls ``fr.interrupt(payload)`` ends the request with
``{"status": "interrupted", "run_id": ..., "interrupt": {"step", "payload"}, "outputs": ...}``;
``POST /v1/workflows/{name}/runs/{run_id}/resume`` with ``{"answer": ...}`` continues that run (the step
runs again from its start, its ``fr.interrupt`` call returning the answer) and answers like a run; a run
waiting at several interrupts (parallel branches: its ``interrupts``) takes ``{"answers": {step: ...}}``.
Without ``answer`` or ``answers`` the resume of an interrupted run is a 400 (a run that crashed, with
``--checkpoint``, is resumed with ``{}``). The run is claimed before the response starts: a second resume
while it runs is a 409 naming the holder.

Time travel, as ``flowrt runs history`` / ``flowrt runs fork`` (flowrt.checkpoint.fork):
``GET /v1/workflows/{name}/runs/{run_id}/history`` lists the run's checkpoints, oldest first (``{"object":
"list", "data": [{"seq", "step", "visit", "status", "result", "route", "created"}, ...]}``), and
``POST /v1/workflows/{name}/runs/{run_id}/fork`` with ``{"at": "step" or "outer/inner", "inputs": {...}}``
starts a new run from the source run's state with ``at`` and what depends on it pending again (the inputs
given replacing the source's) and answers like a run (``stream`` too; the new run's id in
``X-Flowrt-Run-Id``). An unknown run or step is a 404 naming it, a run that is running now a 409, a step that
cannot be forked inside (mapped, routing) or bad inputs a 400. A finished run is kept for this only with
``flowrt serve --checkpoint`` (in memory only runs waiting for an answer are).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any, AsyncGenerator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from ..runner.state import StepStatus
from . import protocol as P
from .errors import OpenAIError, bad_request
from .state import ServerState, State
from .streaming import SSEResponse, guarded, until_disconnect

router = APIRouter(prefix="/v1")


def load_workflows(files: list[str]) -> dict[str, Any]:
    """name -> workflow from workflow files (loaded as `flowrt run FILE` loads them), named by their
    ``Workflow`` name (not the variable holding them: every example calls its workflow ``wf``)."""
    from flowrt.graph.loader import find_workflows, load_module
    from flowrt.graph.workflow import WorkflowError

    out: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for path in files:
        found = find_workflows(load_module(path))
        if not found:
            raise WorkflowError(f"{path} defines no flowrt Workflow at top level")
        for wf in {id(w): w for w in found.values()}.values():
            wf.validate()
            if wf.name in out:
                raise WorkflowError(f"two served workflows are named {wf.name!r} (in {origin[wf.name]} and "
                                    f"{path}); endpoints are named by fr.Workflow(name), so rename one")
            out[wf.name], origin[wf.name] = wf, path
    return out


def _describe(name: str, wf: Any) -> dict[str, Any]:
    inputs = {}
    for spec in wf.inputs.values():
        ann = getattr(spec, "annotation", None)
        type_name = getattr(ann, "__name__", None) if ann is not None else None
        inputs[spec.name] = {"required": spec.required, **({"type": type_name} if isinstance(type_name, str) else {})}
    return {"id": name, "object": "workflow", "name": wf.name, "steps": list(wf.steps), "inputs": inputs}


def _observer_class() -> type:
    from flowrt.runner.executor import RunObserver

    class StreamingObserver(RunObserver):
        """Forwards step status changes to an asyncio queue (from any thread)."""

        def __init__(self, workflow: Any, queue: asyncio.Queue, loop: asyncio.AbstractEventLoop) -> None:
            super().__init__(workflow)
            self._queue = queue
            self._loop = loop
            self._loop_thread = threading.get_ident()

        def on_status(self, step: str, status: StepStatus) -> None:
            super().on_status(step, status)
            event: dict[str, Any] = {"type": "step", "step": step, "status": status,
                                     "time": round(time.perf_counter() - self.t0, 6)}
            if status in ("done", "failed", "skipped") and step in self.started:
                event["duration"] = round(self.finished[step] - self.started[step], 6)
            if status == "done" and self.cache.get(step) == "hit":   # an fr.Cache step's kept result
                event["cached"] = True
            if threading.get_ident() == self._loop_thread:
                self._queue.put_nowait(event)
            else:
                self._loop.call_soon_threadsafe(self._queue.put_nowait, event)

    return StreamingObserver


class _Run:
    """One workflow run as a task that the server can stop when it shuts down (then its result is a 503
    saying so, not a cut connection)."""

    def __init__(self, st: ServerState, wf: Any, inputs: dict[str, Any], observer: Any = None, *,
                 events: Any = None, run: Any = None) -> None:
        self.st = st
        self.stopped = False
        self.task = asyncio.create_task(_runtime(st).execute(wf, inputs, observer=observer, events=events, run=run))
        self.task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved: no warning
        if run is not None:   # a claimed run whose task is cancelled before it starts still gives its lease back
            self.task.add_done_callback(lambda t: _release(run))
        st.stoppers.add(self.stop)

    def stop(self) -> None:
        self.stopped = True
        self.task.cancel()

    def close(self) -> None:
        self.st.stoppers.discard(self.stop)
        self.task.cancel()  # a no-op once it is done

    async def result(self) -> dict[str, Any]:
        """The run's ``flowrt run --json`` dict; a 400 for bad inputs, a 503 when shutdown stopped it or no
        engine replica is left to take it over."""
        from flowrt.graph.workflow import WorkflowError

        try:
            result = await self.task
        except asyncio.CancelledError:
            # Task.cancelling() is Python 3.11's: on 3.10 no cancellation is told apart (none is pending)
            cancelling = getattr(asyncio.current_task(), "cancelling", None)
            if self.stopped and not (cancelling is not None and cancelling()):
                raise OpenAIError("The server shut down before the workflow run finished.", 503) from None
            raise
        except WorkflowError as e:
            raise bad_request(str(e), param="inputs") from None
        except Exception as e:
            from flowrt.checkpoint import CheckpointError
            from flowrt.replicas.router import NoReplicaError

            if isinstance(e, CheckpointError):
                raise _run_error(e) from None
            if isinstance(e, NoReplicaError):   # its replica died and none is left to take the run over
                raise OpenAIError(str(e), 503, code="no_replica") from None
            raise
        self.run_id = result.run_id
        store = getattr(_runtime(self.st), "checkpointer", None)
        if (result.run_id and not result.interrupted and store is not None
                and getattr(store, "path", None) == ":memory:"):
            store.delete_run(result.run_id)   # in memory, only runs waiting for an answer are kept
        return result.to_dict()


def _run_error(e: Exception) -> OpenAIError:
    """A checkpoint refusal as HTTP: 404 for an unknown run, else 409 (finished, held by another: named)."""
    from flowrt.checkpoint import UnknownRunError

    if isinstance(e, UnknownRunError):
        return OpenAIError(str(e), 404, param="run_id", code="run_not_found")
    return OpenAIError(str(e), 409, param="run_id")


def _release(run: Any) -> None:
    from flowrt.checkpoint import CheckpointError

    try:
        run.store.release_run(run.run_id, run.holder)
    except CheckpointError:
        pass   # the lease runs out by itself


def _runtime(st: ServerState) -> Any:
    if st.workflow_runtime is None:
        from flowrt.runner.runtime import Runtime

        # shares the server's engine (does not own it); runs checkpointed in memory, for interrupts
        st.workflow_runtime = Runtime(model=st.engine, checkpoint=":memory:")
    return st.workflow_runtime


@router.get("/workflows")
async def list_workflows(st: State) -> dict:
    return {"object": "list", "data": [_describe(n, wf) for n, wf in st.workflows.items()]}


@router.post("/workflows/{name}/runs")
async def run_workflow(name: str, req: P.WorkflowRunRequest, request: Request, st: State) -> Response:
    from flowrt.graph.workflow import WorkflowError

    wf = _served(st, name)
    try:
        wf.check_inputs(req.inputs)
    except WorkflowError as e:
        raise bad_request(str(e), param="inputs") from None
    return await _respond(st, request, wf, dict(req.inputs), req.stream, req.stream_tokens)


@router.post("/workflows/{name}/runs/{run_id}/resume")
async def resume_workflow(name: str, run_id: str, req: P.WorkflowResumeRequest, request: Request,
                          st: State) -> Response:
    from flowrt.checkpoint import CheckpointError

    wf = _served(st, name)
    rt, record = _stored_run(st, wf, name, run_id)
    if record.status == "done":
        raise OpenAIError(f"Run {run_id} is not waiting for an answer (status done).", 409, param="run_id")
    given: dict[str, Any] = {}
    if "answer" in req.model_fields_set:
        given["answer"] = req.answer
    if req.answers is not None:
        if given:
            raise bad_request("Give either `answer` (a run waiting at one interrupt) or `answers` ({step: answer}), "
                              "not both.", param="answers")
        given["answers"] = req.answers
    if record.status == "interrupted" and not given:
        raise bad_request(f"Run {run_id} is waiting for an answer (step '{(record.interrupt or {}).get('step')}'): "
                          f"the body needs \"answer\" (or \"answers\": {{step: answer}}).", param="answer")
    try:   # claimed here, before any response: of two resumes one runs, the other is a 409 naming the holder
        _, run = rt.claim(run_id, workflow=wf, **given)
    except CheckpointError as e:
        raise _run_error(e) from None
    return await _respond(st, request, wf, dict(run.record.inputs), req.stream, req.stream_tokens, run=run)


def _served(st: ServerState, name: str) -> Any:
    """The workflow served as ``name``, or a 404 listing those served."""
    wf = st.workflows.get(name)
    if wf is None:
        known = ", ".join(st.workflows) or "none"
        raise OpenAIError(f"Unknown workflow '{name}' (served: {known}).", 404, param="name",
                          code="workflow_not_found")
    return wf


def _stored_run(st: ServerState, wf: Any, name: str, run_id: str) -> tuple[Any, Any]:
    """The runtime and the stored run ``run_id`` of workflow ``wf``: a 404 for an unknown run or one of
    another workflow, a 409 when the server keeps no checkpoints."""
    from flowrt.checkpoint import CheckpointError

    rt = _runtime(st)
    if getattr(rt, "checkpointer", None) is None:
        raise OpenAIError("This server keeps no checkpoints (its workflow runtime has none).", 409, param="run_id")
    try:
        record = rt.checkpointer.get_run(run_id, with_state=False)
    except CheckpointError as e:
        raise _run_error(e) from None
    if record.workflow != wf.name:
        raise OpenAIError(f"Run {run_id} is a run of workflow '{record.workflow}', not '{name}'.", 404,
                          param="run_id", code="run_not_found")
    return rt, record


@router.get("/workflows/{name}/runs/{run_id}/history")
async def run_history(name: str, run_id: str, st: State) -> dict:
    from flowrt.checkpoint import CheckpointError
    from flowrt.render import to_jsonable

    rt, _ = _stored_run(st, _served(st, name), name, run_id)
    try:
        history = rt.checkpointer.history(run_id)
    except CheckpointError as e:
        raise _run_error(e) from None
    return {"object": "list", "run_id": run_id, "workflow": name, "data": to_jsonable(history)}


@router.post("/workflows/{name}/runs/{run_id}/fork")
async def fork_workflow(name: str, run_id: str, req: P.WorkflowForkRequest, request: Request, st: State) -> Response:
    from flowrt.checkpoint import CheckpointError
    from flowrt.checkpoint.fork import ForkAtError, UnknownStepError
    from flowrt.graph.workflow import WorkflowError

    wf = _served(st, name)
    rt, _ = _stored_run(st, wf, name, run_id)
    try:   # the new run is made (and held) before any response, as flowrt runs fork makes it
        wf, inputs, run = rt.prepare_fork(run_id, at=req.at, workflow=wf, inputs=dict(req.inputs))
    except UnknownStepError as e:
        raise OpenAIError(str(e), 404, param="at", code="step_not_found") from None
    except ForkAtError as e:
        raise bad_request(str(e), param="at") from None
    except WorkflowError as e:
        raise bad_request(str(e), param="inputs") from None
    except CheckpointError as e:
        raise _run_error(e) from None
    return await _respond(st, request, wf, inputs, req.stream, req.stream_tokens, run=run)


async def _respond(st: ServerState, request: Request, wf: Any, inputs: dict[str, Any], stream: bool,
                   stream_tokens: bool, **run_kw: Any) -> Response:
    if stream:
        queue: asyncio.Queue = asyncio.Queue()
        sink = None
        if stream_tokens:
            from flowrt.events import EventSink

            sink = EventSink(lambda ev: _forward(queue, ev), tokens=True)
        run = _Run(st, wf, inputs, _observer_class()(wf, queue, asyncio.get_running_loop()), events=sink, **run_kw)
        events = guarded(st, request, _events(wf, run, queue), f"workflow {wf.name} run")
        return SSEResponse(events, on_close=run.close)
    run = _Run(st, wf, inputs, **run_kw)
    try:
        done, result = await until_disconnect(st, request, run.result())
    finally:
        run.close()
    if not done:
        return Response(status_code=499)
    rid = getattr(run, "run_id", None)
    return JSONResponse(result, headers={"X-Flowrt-Run-Id": rid} if rid else None)


def _forward(queue: asyncio.Queue, ev: Any) -> None:
    """Run events for a stream with tokens: token, route and interrupt events (steps come from the observer)."""
    kind = {"token": "token", "routed": "route", "interrupted": "interrupt", "run_started": "run_id"}.get(ev.type)
    if kind is None:
        return
    data = {**ev.to_dict(), "type": kind}
    if kind == "run_id":
        data = {"type": "run_id", "run_id": data.get("run_id")}
    queue.put_nowait((kind, data))


async def _events(wf: Any, run: _Run, queue: asyncio.Queue) -> AsyncGenerator[str, None]:
    yield _event("run", {"type": "run", "workflow": wf.name, "steps": list(wf.steps)})
    while not run.task.done():
        getter = asyncio.create_task(queue.get())
        await asyncio.wait({getter, run.task}, return_when=asyncio.FIRST_COMPLETED)
        if getter.done():
            yield _queued(getter.result())
        else:
            getter.cancel()
            await asyncio.gather(getter, return_exceptions=True)
            if not getter.cancelled():  # it got an event just as the run ended
                yield _queued(getter.result())
    while not queue.empty():
        yield _queued(queue.get_nowait())
    try:
        yield _event("result", {"type": "result", **await run.result()})
    except OpenAIError as e:
        yield e.sse()
    yield P.SSE_DONE


def _queued(item: Any) -> str:
    """A queued event: a step event (dict, from the observer) or (kind, data) from the run's event sink."""
    if isinstance(item, tuple):
        return _event(item[0], item[1])
    return _event("step", item)


def _event(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"
