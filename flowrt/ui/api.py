"""The viewer's pages and JSON API, one router on any FastAPI app (``flowrt ui``'s own, or ``flowrt serve``'s).

Pages (no data in them, so no key needed): ``GET /ui`` (the run list) and ``GET /ui/runs/{id}`` (a run), both the
same page, and its files under ``/ui/static/``. The JSON API, under ``/ui/api`` and behind the API key when one is
set (``Authorization: Bearer <key>``; the page asks for it and keeps it for the browser tab):

  GET  /ui/api/runs?status=S&limit=N      the runs, newest first: {"runs": [...], "counts": {status: n}}
  GET  /ui/api/runs/{id}                  a run's page: run, steps (state, result, error, LLM calls), forks, graph,
                                          history
  GET  /ui/api/runs/{id}/events           Server-Sent Events: a ``run`` event (the same JSON) whenever the stored
                                          run changes, until it is no longer running (then ``end``)
  POST /ui/api/runs/{id}/answer           {"answer": v} or {"answers": {step: v}}: 202, the run continues here
  POST /ui/api/runs/{id}/fork             {"at": step, "inputs": {...}}: 202 {"run_id": the new run}
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from importlib import resources
from typing import Any, AsyncIterator

from fastapi import APIRouter, Depends, FastAPI, HTTPException, Request
from fastapi.responses import FileResponse, StreamingResponse
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, ConfigDict, Field

from .viewer import Viewer, ViewerError
from .views import detail, summary

__all__ = ["install", "router", "POLL_S"]

POLL_S = 0.25   # how often the event stream reads the stored run
_STATIC = resources.files("flowrt.ui") / "static"


def viewer(request: Request) -> Viewer:
    return request.app.state.flowrt_ui


def check_key(request: Request) -> None:
    key = viewer(request).api_key
    if key is None:
        return
    scheme, _, token = (request.headers.get("authorization") or "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
        raise HTTPException(401, "This viewer needs the server's API key: 'Authorization: Bearer <key>'.")


pages = APIRouter(prefix="/ui")
router = APIRouter(prefix="/ui/api", dependencies=[Depends(check_key)])


class AnswerRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    answer: Any = None
    answers: dict[str, Any] | None = None


class ForkRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    at: str
    inputs: dict[str, Any] = Field(default_factory=dict)


@pages.get("", include_in_schema=False)
@pages.get("/runs/{run_id}", include_in_schema=False)
async def page(run_id: str | None = None) -> FileResponse:
    return FileResponse(str(_STATIC / "index.html"), media_type="text/html")


def _call(fn: Any, *args: Any) -> Any:
    from ..checkpoint import CheckpointError, UnknownRunError

    try:
        return fn(*args)
    except UnknownRunError as e:
        raise HTTPException(404, str(e)) from None
    except CheckpointError as e:
        raise HTTPException(409, str(e)) from None


@router.get("/runs")
async def list_runs(request: Request, status: str | None = None, limit: int = 100) -> dict[str, Any]:
    v = viewer(request)

    def go() -> dict[str, Any]:
        records = v.store.list_runs(max(1, min(limit, 1000)))
        counts: dict[str, int] = {}
        for r in records:
            counts[r.status] = counts.get(r.status, 0) + 1
        shown = [v.store.get_run(r.run_id) for r in records if status in (None, "", r.status)]
        return {"runs": [summary(r) for r in shown], "counts": counts}

    return await asyncio.to_thread(_call, go)


def _detail(v: Viewer, run_id: str) -> dict[str, Any]:
    record = v.store.get_run(run_id)
    out = detail(record, v.workflow(record), v.store.history(run_id))
    out["run"]["running_here"] = v.running_here(run_id)
    return out


@router.get("/runs/{run_id}")
async def get_run(run_id: str, request: Request) -> dict[str, Any]:
    return await asyncio.to_thread(_call, _detail, viewer(request), run_id)


@router.get("/runs/{run_id}/events")
async def run_events(run_id: str, request: Request) -> StreamingResponse:
    v = viewer(request)
    first = await asyncio.to_thread(_call, _detail, v, run_id)   # a 404 before the stream starts

    async def events() -> AsyncIterator[str]:
        shown, seen = first, None
        while True:
            r = shown["run"]
            mark = (r["updated"], r["checkpoints"], r["status"], json.dumps([s["state"] for s in shown["steps"]]))
            if mark != seen:
                seen = mark
                yield _sse("run", shown)
            if v.closing or (r["status"] != "running" and not v.running_here(run_id)):
                yield _sse("end", {"run_id": run_id, "status": r["status"]})
                return
            await asyncio.sleep(POLL_S)
            shown = await asyncio.to_thread(_call, _detail, v, run_id)

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _sse(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False, default=str)}\n\n"


@router.post("/runs/{run_id}/answer", status_code=202)
async def answer(run_id: str, req: AnswerRequest, request: Request) -> dict[str, Any]:
    given: dict[str, Any] = {}
    if "answer" in req.model_fields_set:
        given["answer"] = req.answer
    if req.answers is not None:
        if given:
            raise HTTPException(400, "Give either `answer` or `answers` ({step: answer}), not both.")
        given["answers"] = req.answers
    if not given:
        raise HTTPException(400, "The body needs \"answer\" (or \"answers\": {step: answer}).")
    try:
        viewer(request).answer(run_id, given)
    except ViewerError as e:
        raise HTTPException(e.status, str(e)) from None
    return {"run_id": run_id, "status": "running", "time": time.time()}


@router.post("/runs/{run_id}/fork", status_code=202)
async def fork(run_id: str, req: ForkRequest, request: Request) -> dict[str, Any]:
    try:
        new_id = viewer(request).fork(run_id, req.at, req.inputs)
    except ViewerError as e:
        raise HTTPException(e.status, str(e)) from None
    return {"run_id": new_id, "forked_from": run_id, "at": req.at}


def install(app: FastAPI, v: Viewer) -> None:
    """Serve the viewer on ``app``: its pages, files and JSON API over ``v``."""
    app.state.flowrt_ui = v
    app.include_router(pages)
    app.include_router(router)
    app.mount("/ui/static", StaticFiles(directory=str(_STATIC)), name="flowrt-ui-static")


def standalone_app(v: Viewer) -> FastAPI:
    """``flowrt ui``'s app: the viewer alone (``/`` leads to ``/ui``); the runs it executes stop with it."""
    import contextlib

    from fastapi.responses import RedirectResponse

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        v.stop_all()
        await asyncio.gather(*v.tasks.values(), return_exceptions=True)
        await asyncio.to_thread(v.close)

    app = FastAPI(title="flowrt ui", lifespan=lifespan, docs_url=None, redoc_url=None)

    @app.get("/", include_in_schema=False)
    async def root() -> RedirectResponse:
        return RedirectResponse("/ui")

    install(app, v)
    return app
