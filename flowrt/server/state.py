"""What every endpoint shares: the engine, the served names, limits, metrics and shutdown state.

One ``ServerState`` per app lives in ``app.state.flowrt``; handlers receive it through the ``State``
dependency instead of closing over it, so each endpoint family can live in its own module.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Annotated, Any, Callable

from fastapi import Depends, Request

from . import protocol as P
from .errors import OpenAIError
from .defaults import DEFAULT_CHAT_TEMPLATE_TIMEOUT
from .metrics import ServerMetrics


@dataclass
class ServerState:
    engine: Any
    served_model_names: list[str]
    model_root: str | None
    api_key: str | None
    max_body_bytes: int
    metrics: ServerMetrics
    workflows: dict[str, Any] = field(default_factory=dict)
    workflow_runtime: Any = None
    trust_request_chat_template: bool = False
    chat_template_timeout: float = DEFAULT_CHAT_TEMPLATE_TIMEOUT
    created: int = field(default_factory=P.now)
    shutting_down: bool = False
    in_flight: int = 0  # /v1 requests being served (the drain waits for it to reach 0)
    # Called when the server stops waiting for in-flight work: each ends its request early (abort).
    stoppers: set[Callable[[], object]] = field(default_factory=set)   # what each returns is not used

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return int(self.engine.max_model_len)

    def kv_capacity(self) -> int | None:
        """Tokens the whole KV pool holds (one sequence can never be longer), or None when unknown."""
        stats = self.engine.stats()
        blocks, size = stats.get("num_kv_blocks"), stats.get("block_size")
        return int(blocks) * int(size) if blocks and size else None

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.served_model_names:
            raise OpenAIError(f"The model '{model}' does not exist. This server serves: "
                              f"{', '.join(self.served_model_names)}.", 404, type="invalid_request_error",
                              param="model", code="model_not_found")

    def model_name(self, requested: str | None) -> str:
        return requested or self.served_model_names[0]

    def stop_all(self) -> int:
        """Ends every request still running (server shutdown past its grace period); returns how many."""
        stoppers = list(self.stoppers)
        for stop in stoppers:
            stop()
        return len(stoppers)


def get_state(request: Request) -> ServerState:
    return request.app.state.flowrt


State = Annotated[ServerState, Depends(get_state)]


def default_model_name(model_path: str | None) -> str:
    if not model_path:
        return "flowrt"
    name = os.path.basename(os.path.normpath(str(model_path)))
    return name[:-5] if name.endswith(".gguf") else name
