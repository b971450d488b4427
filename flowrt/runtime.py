"""``fr.Runtime``: the resources runs share (one engine, a retriever, user objects) and ``run``.

    async with fr.Runtime(model="path/or/model.gguf") as rt:
        result = await rt.run(wf, question="...")

Resources are created on first need (a workflow of plain Python steps never loads a model) and shared by
every run on the runtime, so concurrent runs are batched together by the one engine.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import anyio

from .executor import RunObserver, RunResult, execute
from .model import Model
from .resources import resource_kinds
from .trace import Tracer
from .workflow import Workflow

if TYPE_CHECKING:
    from .engine import EngineClient

__all__ = ["Runtime"]


class Runtime:
    """Shared resources for workflow runs.

    ``model``: a model path (Hugging Face directory or .gguf; None = the default model), an engine
    (an ``EngineClient``, e.g. ``AsyncLLM``), or an ``fr.Model``. ``index``: a retrieval index
    directory (``Retriever.load``).
    ``resources``: extra objects by resource name (e.g. ``{"retriever": my_retriever}``).
    ``share_kv=False``: the no-sharing baseline (forks recompute; pair with
    ``enable_prefix_caching=False``). Other keywords go to ``AsyncLLM`` (dtype, num_kv_blocks, ...).
    """

    def __init__(self, model: str | os.PathLike[str] | EngineClient | Model | None = None, *, index: str | None = None,
                 resources: dict[str, Any] | None = None, share_kv: bool = True, **engine_kwargs: Any) -> None:
        self._model_spec = model
        self._engine_kwargs = engine_kwargs
        self._index = index
        self._share_kv = share_kv
        self._resources: dict[str, Any] = dict(resources or {})
        self._owned_engine: EngineClient | None = None
        self._lock = anyio.Lock()
        if isinstance(model, Model):
            self._resources.setdefault("llm", model)
        elif model is not None and not isinstance(model, (str, bytes, os.PathLike)):
            from .engine.protocol import EngineClient  # only here: a path must not load the engine yet

            if not isinstance(model, EngineClient):
                raise TypeError(f"model must be a path, an engine (flowrt.engine.EngineClient, e.g. AsyncLLM) "
                                f"or an fr.Model, got {type(model).__name__}")
            self._resources.setdefault("llm", Model(model, share_kv=share_kv))

    # ------------------------------------------------------------------ lifecycle
    async def __aenter__(self) -> "Runtime":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    def __enter__(self) -> "Runtime":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    async def aclose(self) -> None:
        await anyio.to_thread.run_sync(self.close)

    def close(self) -> None:
        """Shut down the engine this runtime created (not one passed in)."""
        eng, self._owned_engine = self._owned_engine, None
        if eng is not None:
            self._resources.pop("llm", None)
            eng.shutdown()

    # ------------------------------------------------------------------ resources
    def _create_engine(self) -> EngineClient:
        from .engine import AsyncLLM

        path = self._model_spec
        if isinstance(path, (bytes, os.PathLike)):
            path = os.fsdecode(path)
        return AsyncLLM(model=path, **self._engine_kwargs)

    async def get_resource(self, name: str) -> Any:
        if name in self._resources:
            return self._resources[name]
        async with self._lock:
            if name in self._resources:
                return self._resources[name]
            if name == "llm":
                engine = await anyio.to_thread.run_sync(self._create_engine)
                self._owned_engine = engine
                value: Any = Model(engine, share_kv=self._share_kv)
            elif name == "retriever" and self._index is not None:
                from .retrieval import Retriever  # imported only when a step asks for it (faiss)

                index = self._index
                value = await anyio.to_thread.run_sync(lambda: Retriever.load(index))
            else:
                kind = resource_kinds().get(name)
                hint = f"; {kind.hint}" if kind is not None and kind.hint else ""
                raise LookupError(f"no {name!r} resource was provided{hint}")
            self._resources[name] = value
            return value

    async def model(self) -> Model:
        """The shared ``fr.Model`` (loads the engine on first use)."""
        return await self.get_resource("llm")

    @property
    def llm(self) -> Model | None:
        """The ``fr.Model`` if it is loaded (see ``await rt.model()``)."""
        return self._resources.get("llm")

    def stats(self) -> dict[str, Any]:
        llm = self._resources.get("llm")
        return llm.stats() if llm is not None else {}

    # ------------------------------------------------------------------ running
    async def run(self, wf: Workflow, inputs: dict[str, Any] | None = None, /, **kw_inputs: Any) -> RunResult:
        """Run ``wf`` with the given inputs; step failures are in the result (``result.errors``)."""
        return await self.execute(wf, {**(inputs or {}), **kw_inputs})

    async def execute(self, wf: Workflow, inputs: dict[str, Any], *, tracer: Tracer | None = None,
                      observer: RunObserver | None = None) -> RunResult:
        if not isinstance(wf, Workflow):
            raise TypeError(f"expected a flowrt Workflow, got {type(wf).__name__}")
        return await execute(wf, inputs, self, tracer=tracer, observer=observer, stats_fn=self.stats)
