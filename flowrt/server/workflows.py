"""Workflows as endpoints: ``POST /v1/workflows/{name}/runs`` and ``GET /v1/workflows``.

Body ``{"inputs": {...}, "stream": false}``. Runs the workflow on the server's engine (through an
``fr.Runtime`` sharing it, so workflow steps batch with API requests) and returns the same JSON as
``flowrt run --json``: ``{"outputs": {...}, "errors": {...}, "stats": {...}}`` (200 even when a step
failed: the failure is in ``errors``, as with ``flowrt run``). With ``"stream": true`` the response is
Server-Sent Events: ``step`` events as steps start and finish, a final ``result`` event holding the JSON
above, then ``data: [DONE]``. Each workflow is served under its own name, ``fr.Workflow("name")``.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from . import protocol as P
from .errors import OpenAIError, bad_request
from .state import ServerState, State
from .streaming import SSEResponse, guarded, until_disconnect

router = APIRouter(prefix="/v1")


def load_workflows(files: list[str]) -> dict[str, Any]:
    """name -> workflow from workflow files (loaded as `flowrt run FILE` loads them), named by their
    ``Workflow`` name (not the variable holding them: every example calls its workflow ``wf``)."""
    from flowrt.loader import find_workflows, load_module
    from flowrt.workflow import WorkflowError

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
    from flowrt.executor import RunObserver

    class StreamingObserver(RunObserver):
        """Forwards step status changes to an asyncio queue (from any thread)."""

        def __init__(self, workflow: Any, queue: asyncio.Queue, loop: asyncio.AbstractEventLoop) -> None:
            super().__init__(workflow)
            self._queue = queue
            self._loop = loop
            self._loop_thread = threading.get_ident()

        def on_status(self, step: str, status: str) -> None:
            super().on_status(step, status)
            event: dict[str, Any] = {"type": "step", "step": step, "status": status,
                                     "time": round(time.perf_counter() - self.t0, 6)}
            if status in ("done", "failed", "skipped") and step in self.started:
                event["duration"] = round(self.finished[step] - self.started[step], 6)
            if threading.get_ident() == self._loop_thread:
                self._queue.put_nowait(event)
            else:
                self._loop.call_soon_threadsafe(self._queue.put_nowait, event)

    return StreamingObserver


class _Run:
    """One workflow run as a task that the server can stop when it shuts down (then its result is a 503
    saying so, not a cut connection)."""

    def __init__(self, st: ServerState, wf: Any, inputs: dict[str, Any], observer: Any = None) -> None:
        self.st = st
        self.stopped = False
        self.task = asyncio.create_task(_runtime(st).execute(wf, inputs, observer=observer))
        self.task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved: no warning
        st.stoppers.add(self.stop)

    def stop(self) -> None:
        self.stopped = True
        self.task.cancel()

    def close(self) -> None:
        self.st.stoppers.discard(self.stop)
        self.task.cancel()  # a no-op once it is done

    async def result(self) -> dict[str, Any]:
        """The run's ``flowrt run --json`` dict; a 400 for bad inputs, a 503 when shutdown stopped it."""
        from flowrt.workflow import WorkflowError

        try:
            result = await self.task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if self.stopped and not (current is not None and current.cancelling()):
                raise OpenAIError("The server shut down before the workflow run finished.", 503) from None
            raise
        except WorkflowError as e:
            raise bad_request(str(e), param="inputs") from None
        return result.to_dict()


def _runtime(st: ServerState) -> Any:
    if st.workflow_runtime is None:
        from flowrt.runtime import Runtime

        st.workflow_runtime = Runtime(model=st.engine)  # shares the server's engine; does not own it
    return st.workflow_runtime


@router.get("/workflows")
async def list_workflows(st: State) -> dict:
    return {"object": "list", "data": [_describe(n, wf) for n, wf in st.workflows.items()]}


@router.post("/workflows/{name}/runs")
async def run_workflow(name: str, req: P.WorkflowRunRequest, request: Request, st: State) -> Response:
    from flowrt.workflow import WorkflowError

    wf = st.workflows.get(name)
    if wf is None:
        known = ", ".join(st.workflows) or "none"
        raise OpenAIError(f"Unknown workflow '{name}' (served: {known}).", 404, param="name",
                          code="workflow_not_found")
    try:
        wf.check_inputs(req.inputs)
    except WorkflowError as e:
        raise bad_request(str(e), param="inputs") from None
    if req.stream:
        queue: asyncio.Queue = asyncio.Queue()
        run = _Run(st, wf, dict(req.inputs), _observer_class()(wf, queue, asyncio.get_running_loop()))
        events = guarded(st, request, _events(wf, run, queue), f"workflow {wf.name} run")
        return SSEResponse(events, on_close=run.close)
    run = _Run(st, wf, dict(req.inputs))
    try:
        done, result = await until_disconnect(st, request, run.result())
    finally:
        run.close()
    return JSONResponse(result) if done else Response(status_code=499)


async def _events(wf: Any, run: _Run, queue: asyncio.Queue) -> AsyncIterator[str]:
    yield _event("run", {"type": "run", "workflow": wf.name, "steps": list(wf.steps)})
    while not run.task.done():
        getter = asyncio.create_task(queue.get())
        await asyncio.wait({getter, run.task}, return_when=asyncio.FIRST_COMPLETED)
        if getter.done():
            yield _event("step", getter.result())
        else:
            getter.cancel()
            await asyncio.gather(getter, return_exceptions=True)
            if not getter.cancelled():  # it got an event just as the run ended
                yield _event("step", getter.result())
    while not queue.empty():
        yield _event("step", queue.get_nowait())
    try:
        yield _event("result", {"type": "result", **await run.result()})
    except OpenAIError as e:
        yield e.sse()
    yield P.SSE_DONE


def _event(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"
