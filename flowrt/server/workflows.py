"""Workflows as endpoints: ``POST /v1/workflows/{name}/runs``.

Body ``{"inputs": {...}, "stream": false}``. Runs the workflow on the server's engine and returns the same
JSON as ``flowrt run --json``; with ``"stream": true`` the response is Server-Sent Events: one event per
step start/finish and a final ``result`` event, then ``data: [DONE]``.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from . import protocol as P
from .errors import OpenAIError


def load_workflows(files: list[str]) -> dict[str, Any]:
    """name -> workflow, from workflow files (as `flowrt run FILE` loads them)."""
    if not files:
        return {}
    raise NotImplementedError("serving workflows needs flowrt's workflow runtime, which is not available yet")


def install(app: FastAPI, st: Any) -> None:
    @app.get("/v1/workflows")
    async def list_workflows() -> dict:
        return {"object": "list", "data": [{"id": name, "object": "workflow"} for name in st.workflows]}

    @app.post("/v1/workflows/{name}/runs")
    async def run_workflow(name: str, req: P.WorkflowRunRequest, request: Request) -> Response:
        if name not in st.workflows:
            known = ", ".join(st.workflows) or "none"
            raise OpenAIError(f"Unknown workflow '{name}' (served: {known}).", 404, param="name",
                              code="workflow_not_found")
        return JSONResponse({"error": "not implemented"}, status_code=501)
