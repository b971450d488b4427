"""``GET /health`` (load balancers: 503 while draining, so traffic moves elsewhere) and ``GET /metrics``."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from .metrics import CONTENT_TYPE
from .state import State

router = APIRouter()


@router.get("/health")
async def health(st: State) -> Response:
    if st.shutting_down:
        return JSONResponse({"status": "shutting_down", "in_flight": st.in_flight}, status_code=503)
    try:
        stats = st.engine.stats()
    except Exception as e:  # noqa: BLE001 - a broken engine is an unhealthy server, not a 500
        return JSONResponse({"status": "error", "error": f"{type(e).__name__}: {e}"}, status_code=503)
    return JSONResponse({"status": "ok", "running": stats.get("num_running"), "waiting": stats.get("num_waiting")})


@router.get("/metrics")
async def metrics(st: State) -> Response:
    return Response(st.metrics.render(), media_type=CONTENT_TYPE)
