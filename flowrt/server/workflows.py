"""Workflows as endpoints: ``POST /v1/workflows/{name}/runs``.

Body ``{"inputs": {...}, "stream": false}``. Runs the workflow on the server's engine (through an
``fr.Runtime`` sharing it, so workflow steps batch with API requests) and returns the same JSON as
``flowrt run --json``: ``{"outputs": {...}, "errors": {...}, "stats": {...}}`` (200 even when a step
failed: the failure is in ``errors``, as with ``flowrt run``). With ``"stream": true`` the response is
Server-Sent Events: ``step`` events as steps start and finish, a final ``result`` event holding the JSON
above, then ``data: [DONE]``. ``GET /v1/workflows`` lists the served workflows and their inputs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from . import protocol as P
from .errors import OpenAIError, bad_request

logger = logging.getLogger("flowrt.server")


def load_workflows(files: list[str]) -> dict[str, Any]:
    """name -> workflow from workflow files (loaded as `flowrt run FILE` loads them). Each workflow is
    served under its ``Workflow`` name and, when different, the variable that holds it."""
    if not files:
        return {}
    from flowrt.loader import find_workflows, load_module
    from flowrt.workflow import WorkflowError

    out: dict[str, Any] = {}
    for path in files:
        found = find_workflows(load_module(path))
        if not found:
            raise WorkflowError(f"{path} defines no flowrt Workflow at top level")
        for var, wf in found.items():
            wf.validate()
            for name in dict.fromkeys((wf.name, var)):
                if name in out and out[name] is not wf:
                    raise WorkflowError(f"two served workflows are named {name!r} ({path})")
                out[name] = wf
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


def install(app: FastAPI, st: Any) -> None:
    def runtime() -> Any:
        if st.workflow_runtime is None:
            from flowrt.runtime import Runtime

            st.workflow_runtime = Runtime(model=st.engine)  # shares the server's engine; does not own it
        return st.workflow_runtime

    def unique() -> dict[str, Any]:
        seen: dict[int, str] = {}
        for name, wf in st.workflows.items():
            seen.setdefault(id(wf), name)
        return {name: st.workflows[name] for name in seen.values()}

    @app.get("/v1/workflows")
    async def list_workflows() -> dict:
        return {"object": "list", "data": [_describe(n, wf) for n, wf in unique().items()]}

    @app.post("/v1/workflows/{name}/runs")
    async def run_workflow(name: str, req: P.WorkflowRunRequest, request: Request) -> Response:
        wf = st.workflows.get(name)
        if wf is None:
            known = ", ".join(unique()) or "none"
            raise OpenAIError(f"Unknown workflow '{name}' (served: {known}).", 404, param="name",
                              code="workflow_not_found")
        if st.shutting_down:
            raise OpenAIError("The server is shutting down.", 503)
        from flowrt.workflow import WorkflowError

        try:
            wf.check_inputs(req.inputs)
        except WorkflowError as e:
            raise bad_request(str(e), param="inputs") from None
        rt = runtime()

        if not req.stream:
            task = asyncio.create_task(rt.execute(wf, dict(req.inputs)))
            disc = asyncio.create_task(_wait_for_disconnect(request))
            try:
                await asyncio.wait({task, disc}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for t in (task, disc):
                    if not t.done():
                        t.cancel()
                await asyncio.gather(task, disc, return_exceptions=True)
            if task.cancelled():
                _mark_aborted(st, request)
                return Response(status_code=499)
            try:
                result = task.result()
            except WorkflowError as e:
                raise bad_request(str(e), param="inputs") from None
            return JSONResponse(result.to_dict())

        queue: asyncio.Queue = asyncio.Queue()
        observer = _observer_class()(wf, queue, asyncio.get_running_loop())

        async def events() -> AsyncIterator[str]:
            task = asyncio.create_task(rt.execute(wf, dict(req.inputs), observer=observer))
            try:
                yield _event("run", {"type": "run", "workflow": wf.name, "steps": list(wf.steps)})
                while True:
                    getter = asyncio.create_task(queue.get())
                    await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
                    if getter.done():
                        yield _event("step", getter.result())
                        continue
                    getter.cancel()
                    await asyncio.gather(getter, return_exceptions=True)
                    while not queue.empty():
                        yield _event("step", queue.get_nowait())
                    break
                try:
                    result = task.result()
                    yield _event("result", {"type": "result", **result.to_dict()})
                except WorkflowError as e:
                    yield bad_request(str(e), param="inputs").sse()
                yield P.SSE_DONE
            except (asyncio.CancelledError, GeneratorExit):
                _mark_aborted(st, request)
                raise
            except Exception as e:  # noqa: BLE001
                logger.exception("workflow %s run failed", wf.name)
                yield OpenAIError(f"{type(e).__name__}: {e}", 500).sse()
                yield P.SSE_DONE
            finally:
                if not task.done():
                    task.cancel()
                with contextlib.suppress(BaseException):
                    await task

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _event(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _mark_aborted(st: Any, request: Request) -> None:
    from .app import _mark_aborted as mark

    mark(st, request)
