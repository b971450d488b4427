"""The OpenAI-compatible FastAPI app over an in-process flowrt engine.

``create_app(engine, ...)`` takes an already-constructed ``flowrt.engine.AsyncLLM`` (tests and embedders
build their own; ``flowrt serve`` builds one from its options) and returns the ASGI app. The endpoints
live one family per module (completions, chat, responses, models, workflows, health); they share
``ServerState``.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, AsyncIterator

from fastapi import FastAPI

from . import chat, completions, health, models, responses
from . import workflows as workflow_endpoints
from .errors import install_handlers
from .defaults import (DEFAULT_CHAT_TEMPLATE_TIMEOUT, DEFAULT_MAX_BODY_BYTES, DEFAULT_RESPONSES_MAX,
                       DEFAULT_RESPONSES_MAX_BYTES)
from .guard import Guard
from .metrics import ServerMetrics
from .responses_store import ResponseStore
from .state import ServerState, default_model_name


def create_app(engine: Any, *, served_model_name: str | list[str] | None = None, model_path: str | None = None,
               api_key: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               workflows: dict[str, Any] | None = None, workflow_runtime: Any = None,
               trust_request_chat_template: bool = False,
               chat_template_timeout: float = DEFAULT_CHAT_TEMPLATE_TIMEOUT, owns_engine: bool = False,
               responses_max: int = DEFAULT_RESPONSES_MAX,
               responses_max_bytes: int = DEFAULT_RESPONSES_MAX_BYTES) -> FastAPI:
    """The OpenAI-compatible app over `engine` (a flowrt.engine.AsyncLLM).

    served_model_name: the name(s) clients must pass as `model` (default: the model directory's name, or
    "flowrt"). api_key: when set, every /v1 request needs `Authorization: Bearer <key>`.
    workflows: name -> fr.Workflow served at POST /v1/workflows/{name}/runs (see flowrt.server.workflows);
    workflow_runtime: the fr.Runtime they run on (default: one over `engine`).
    trust_request_chat_template: accept chat templates sent in requests (client code run by the server).
    chat_template_timeout: seconds a chat template may take to render before the request gets a 400.
    owns_engine: shut the engine down when the app shuts down.
    responses_max, responses_max_bytes: how many stored /v1/responses (and their bytes) are kept, oldest evicted.
    """
    if served_model_name is None:
        served_model_name = default_model_name(model_path)
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name)
    if not names:
        raise ValueError("served_model_name must name at least one model")
    st = ServerState(engine=engine, served_model_names=names, model_root=model_path, api_key=api_key,
                     max_body_bytes=max_body_bytes, metrics=ServerMetrics(engine.stats),
                     workflows=dict(workflows or {}), workflow_runtime=workflow_runtime,
                     trust_request_chat_template=trust_request_chat_template,
                     chat_template_timeout=chat_template_timeout)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        st.shutting_down = True
        if owns_engine:
            await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="flowrt", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.flowrt = st
    app.state.flowrt_responses = ResponseStore(responses_max, responses_max_bytes)
    install_handlers(app)
    app.add_middleware(Guard, state=st)
    for module in (health, models, completions, chat, responses, workflow_endpoints):
        app.include_router(module.router)
    _install_viewer(app, st)
    return app


def _install_viewer(app: FastAPI, st: ServerState) -> None:
    """The run viewer at /ui (flowrt.ui) over the served workflows' runs, behind the server's API key."""
    from flowrt.ui.api import install
    from flowrt.ui.viewer import Viewer

    viewer = Viewer(lambda: workflow_endpoints._runtime(st).checkpointer, workflows=st.workflows,
                    runtime=lambda: workflow_endpoints._runtime(st), api_key=st.api_key)
    st.stoppers.add(viewer.stop_all)
    install(app, viewer)
