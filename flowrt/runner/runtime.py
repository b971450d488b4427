"""``fr.Runtime``: the resources runs share (one engine, a retriever, user objects) and ``run``.

    async with fr.Runtime(model="path/or/model.gguf") as rt:
        result = await rt.run(wf, question="...")

Resources are created on first need (a workflow of plain Python steps never loads a model) and shared by
every run on the runtime, so concurrent runs are batched together by the one engine.
"""

from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING, Any, AsyncIterator

import anyio

from ..aio import _BaseExceptionGroup, _leaves
from .executor import RunObserver, RunResult, execute
from .state import RunStatus
from ..replicas.takeover import lost_to_replica, replica_set_of, wait_for_replica
from ..llm.model import Model
from ..graph.resources import resource_kinds
from .trace import Tracer
from ..graph.workflow import Workflow

if TYPE_CHECKING:
    from ..engine import EngineClient

__all__ = ["Runtime"]

_NO_ANSWER: Any = object()


class Runtime:
    """Shared resources for workflow runs.

    ``model``: a model path (Hugging Face directory or .gguf; None = the default model), an engine
    (an ``EngineClient``, e.g. ``AsyncLLM``), or an ``fr.Model``. ``index``: a retrieval index
    directory (``Retriever.load``).
    ``resources``: extra objects by resource name (e.g. ``{"retriever": my_retriever}``).
    ``share_kv=False``: the no-sharing baseline (forks recompute; pair with
    ``enable_prefix_caching=False``). Other keywords go to ``AsyncLLM`` (dtype, num_kv_blocks, ...).
    ``checkpoint``: a database path (SQLite; ``":memory:"``) or a ``flowrt.checkpoint.CheckpointStore``:
    every run is saved after each step and can be resumed (``rt.resume``), and steps may ``fr.interrupt``.
    ``checkpoint_kv``: True (a directory beside the SQLite file, ``runs.db.kv``) or a directory: the KV blocks
    of live threads are saved with every checkpoint, so that a resume in a fresh process loads them instead of
    computing them again (flowrt.checkpoint.kv); they are written by a thread off the event loop.
    ``checkpoint_kv_max_bytes``: the disk budget of those blocks (default 20 GiB; 0: none): the least recently
    used ones no unfinished run refers to are evicted to stay within it (flowrt.checkpoint.kv_budget).
    ``cache``: with a checkpoint store, ``fr.Cache`` steps keep their results in it, and a later run (of any
    process using the store) with the same inputs takes them (flowrt.runner.step_cache); ``cache=False``
    runs every step (``--no-cache``).
    ``replicas=N``: N engine replicas as Ray actors (flowrt.replicas; ``ray_address`` joins a cluster,
    ``routing="prefix"|"round_robin"``, ``replica_options``: more ``ReplicaSet`` keywords); each run is bound
    to one replica. With a checkpointer, a run whose replica dies is taken over by a live one from its last
    checkpoint (flowrt/replicas/takeover.py).
    """

    def __init__(self, model: str | os.PathLike[str] | EngineClient | Model | None = None, *, index: str | None = None,
                 resources: dict[str, Any] | None = None, share_kv: bool = True, replicas: int | None = None,
                 ray_address: str | None = None, routing: str = "prefix",
                 replica_options: dict[str, Any] | None = None, checkpoint: Any = None,
                 checkpoint_kv: bool | str | os.PathLike[str] = False, checkpoint_kv_max_bytes: int | None = None,
                 cache: bool = True,
                 **engine_kwargs: Any) -> None:
        from ..checkpoint import CheckpointError, open_store

        self.checkpointer = open_store(checkpoint)   # a CheckpointStore (flowrt.checkpoint), or None
        self.result_cache = None                     # where fr.Cache steps keep results (checkpoint.result_cache)
        if cache and self.checkpointer is not None:
            from ..checkpoint.result_cache import result_cache

            self.result_cache = result_cache(self.checkpointer)
        self.kv_checkpoint = None                    # a flowrt.checkpoint.kv.KVCheckpoint, or None
        if checkpoint_kv:
            if self.checkpointer is None:
                raise CheckpointError("checkpoint_kv saves KV with checkpoints: it needs checkpoint=")
            from ..checkpoint.kv import DEFAULT_MAX_BYTES, KVCheckpoint, kv_dir_for

            self.kv_checkpoint = KVCheckpoint(
                kv_dir_for(getattr(self.checkpointer, "path", checkpoint), checkpoint_kv),
                max_bytes=DEFAULT_MAX_BYTES if checkpoint_kv_max_bytes is None else checkpoint_kv_max_bytes)
        self._replicas = replicas if (replicas or ray_address) else None
        if self._replicas is not None:
            if not isinstance(model, (str, bytes, os.PathLike, type(None))):
                raise TypeError("replicas= needs a model path (each replica loads the model itself)")
            self._replica_options = {"ray_address": ray_address, "routing": routing, **(replica_options or {})}
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
            from ..engine.interfaces import EngineClient  # only here: a path must not load the engine yet

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
        """Shut down the engine this runtime created (not one passed in), after the KV blocks queued for
        writing are on disk."""
        if self.kv_checkpoint is not None:
            self.kv_checkpoint.close()
        eng, self._owned_engine = self._owned_engine, None
        if eng is not None:
            self._resources.pop("llm", None)
            eng.shutdown()

    # ------------------------------------------------------------------ resources
    def _create_engine(self) -> EngineClient:
        from ..engine import AsyncLLM

        path = self._model_spec
        if isinstance(path, (bytes, os.PathLike)):
            path = os.fsdecode(path)
        if self._replicas is not None:
            from ..replicas.client import ReplicaSet, RouterClient

            assert path is None or isinstance(path, str)  # __init__ takes replicas= only with a model path
            rs = ReplicaSet(path, self._replicas or 1, **self._replica_options, **self._engine_kwargs)
            return RouterClient(rs, owns=True)
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
                from ..retrieval import Retriever  # imported only when a step asks for it (faiss)

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
                      observer: RunObserver | None = None, events: Any = None, run: Any = None,
                      file: str | None = None) -> RunResult:
        """Run ``wf``. With a checkpointer the run is recorded (``result.run_id``) and held by this process
        while it runs (a lease, renewed in the background); ``run``: a ``RunCheckpoint`` to continue
        (``resume`` makes it); ``events``: an ``flowrt.events.EventSink``."""
        if not isinstance(wf, Workflow):
            raise TypeError(f"expected a flowrt Workflow, got {type(wf).__name__}")
        if run is None and self.checkpointer is not None:
            from ..checkpoint import RunCheckpoint

            wf.validate()
            checked = wf.check_inputs(inputs)   # a bad input records no run
            run = RunCheckpoint.new(self.checkpointer, wf.name, checked, file=file or _workflow_file(wf),
                                    kv=self.kv_checkpoint,
                                    meta=self._run_meta())
        if run is not None:   # what the run viewer shows of it (flowrt.ui): its LLM calls and forks
            from .activity import RunActivity

            tracer = tracer or Tracer(stats_fn=self.stats)
            run.activity = RunActivity(tracer, run.record.state if run.record is not None else None)
        kw: dict[str, Any] = dict(tracer=tracer, observer=observer, stats_fn=self.stats, checkpoint=run,
                                  events=events)
        from .step_cache import RunCache, current_cache

        cache = RunCache(self.result_cache) if self.result_cache is not None else None
        token = current_cache.set(cache)   # the run's fr.Cache steps look their results up there
        try:
            return _cache_stats(await self._execute(wf, inputs, run, kw), cache, wf)
        finally:
            current_cache.reset(token)

    async def _execute(self, wf: Workflow, inputs: dict[str, Any], run: Any, kw: dict[str, Any]) -> RunResult:
        """The run, taken over by a live replica from its last checkpoint while its own replica died under it."""
        result = await self._execute_held(wf, inputs, run, kw)
        rs = replica_set_of(self._resources.get("llm")) if run is not None else None
        takeovers, computed = 0, 0
        while rs is not None and lost_to_replica(result) and takeovers < rs.max_takeovers:
            takeovers += 1   # its replica died: a live one continues it from its last checkpoint (takeover.py)
            if takeovers == 1:   # the run's stats sum every attempt's LLM calls (one tracer): what came before
                computed = kw["tracer"].llm_totals["tokens_computed"]
            run_id = result.run_id
            assert run_id is not None  # a checkpointed run (run is not None) has its id
            await wait_for_replica(rs, run_id)
            wf, run = self.claim(run_id, workflow=wf)
            from .activity import RunActivity

            run.activity = RunActivity(kw["tracer"], run.record.state if run.record is not None else None)
            kw["checkpoint"] = run
            result = await self._execute_held(wf, inputs, run, kw)
            result.stats["takeovers"] = takeovers
            # The prompt tokens the takeovers computed: what neither the loaded KV nor a prefix cache held.
            result.stats["takeover_tokens_computed"] = kw["tracer"].llm_totals["tokens_computed"] - computed
        return result

    async def _execute_held(self, wf: Workflow, inputs: dict[str, Any], run: Any, kw: dict[str, Any]) -> RunResult:
        with run.held() if run is not None else contextlib.nullcontext():
            try:
                if "llm" not in wf.resources or not self._binds_runs():
                    return _kv_stats(await execute(wf, inputs, self, **kw), run)
                res = _RunResources(self)  # replicas: this run's fr.Model is bound to one replica (affinity)
                try:
                    return _kv_stats(await execute(wf, inputs, res, **kw), run)
                finally:
                    res.release()
            except _BaseExceptionGroup as group:   # a checkpoint that failed in a step's task: the error itself
                error = _checkpoint_error(group)
                if error is None:
                    raise
                raise error from None

    def _binds_runs(self) -> bool:
        """Replicas: each run gets its own ``fr.Model``, bound to one replica (also for a router passed in)."""
        llm = self._resources.get("llm")
        return self._replicas is not None or hasattr(getattr(llm, "engine", None), "bind")

    def _run_meta(self) -> dict[str, Any]:
        from ..render import to_jsonable

        spec = self._model_spec
        model = os.fsdecode(spec) if isinstance(spec, (str, bytes, os.PathLike)) else None
        return {"model": model, "engine": to_jsonable(self._engine_kwargs), "index": self._index}

    async def resume(self, run_id: str, *, answer: Any = _NO_ANSWER, workflow: Workflow | None = None,
                     tracer: Tracer | None = None, observer: RunObserver | None = None,
                     events: Any = None, answers: dict[str, Any] | None = None) -> RunResult:
        """Continue a checkpointed run (after a crash, or an interrupt: ``answer`` is what the interrupted
        ``fr.interrupt`` call returns; ``answers``: ``{step: answer}`` for a run waiting at several, from
        parallel branches, ``result.interrupts``). Steps that finished are not run again.

        ``workflow``: the workflow; by default the one of the file the run recorded, taken as it is when that
        file is already imported (the running script, a module), imported only when it is not. The run is
        claimed first (``claim``): while another process or task executes it, this raises
        ``flowrt.checkpoint.RunBusyError`` naming that holder."""
        wf, run = self.claim(run_id, answer=answer, answers=answers, workflow=workflow)
        return await self.execute(wf, dict(run.record.inputs), tracer=tracer, observer=observer, events=events,
                                  run=run)

    def claim(self, run_id: str, *, answer: Any = _NO_ANSWER, answers: dict[str, Any] | None = None,
              workflow: Workflow | None = None) -> tuple[Workflow, Any]:
        """What ``resume`` does before it runs: the run's workflow, and the run claimed for this process in one
        atomic transition of the store (a ``RunCheckpoint``; ``execute(wf, inputs, run=...)`` runs it and
        gives it back). Refusals are ``CheckpointError`` s: ``UnknownRunError``, ``RunNotResumableError``
        (finished; an answer for a run not waiting for one), ``RunBusyError`` (held by another, named)."""
        from ..checkpoint import CheckpointError, RunCheckpoint, RunNotResumableError
        from ..checkpoint.run import NO_ANSWER

        if self.checkpointer is None:
            raise CheckpointError("resume needs a checkpointer: fr.Runtime(checkpoint=\"runs.db\")")
        record = self.checkpointer.get_run(run_id, with_state=False)
        if record.status == RunStatus.DONE:
            raise RunNotResumableError(f"run {run_id} already finished (status done); nothing to resume")
        wf = workflow
        if wf is None:
            if not record.file:
                raise CheckpointError(f"run {run_id} recorded no workflow file; pass workflow=")
            from ..graph.loader import load_workflow, loaded_workflow

            wf = loaded_workflow(record.file, record.workflow) or load_workflow(record.file, record.workflow)
        elif wf.name != record.workflow:
            raise CheckpointError(f"run {run_id} is of workflow {record.workflow!r}, not {wf.name!r}")
        run = RunCheckpoint.resume(self.checkpointer, run_id, answer=NO_ANSWER if answer is _NO_ANSWER else answer,
                                   kv=self.kv_checkpoint, answers=answers)
        return wf, run

    async def stream(self, wf: Workflow, inputs: dict[str, Any] | None = None, /, *, tokens: bool = True,
                     **kw_inputs: Any) -> AsyncIterator[Any]:
        """Run ``wf``, yielding its events (flowrt.events: step started / finished / failed / skipped /
        routed / interrupted and, with ``tokens``, every thread's token deltas); the last one is
        ``RunFinished`` with the result. Leaving the loop early cancels the run."""
        import asyncio
        from collections import deque

        from ..events import EventSink, RunFinished

        # A deque and a wake-up event, not a memory stream: events are drained in batches, without a trip
        # through the event loop for each one (token events come by the hundred per second).
        queue: deque[Any] = deque()
        ready = asyncio.Event()
        done = object()

        def put(event: Any) -> None:
            queue.append(event)
            ready.set()

        sink = EventSink(put, tokens=tokens)

        async def go() -> None:
            try:
                result = await self.execute(wf, {**(inputs or {}), **kw_inputs}, events=sink)
                put(RunFinished(result.status, result.run_id, result))
            finally:
                put(done)

        task = asyncio.ensure_future(go())
        try:
            while True:
                if not queue:
                    ready.clear()
                    await ready.wait()
                    continue
                event = queue.popleft()
                if event is done:
                    break
                yield event
            await task   # a failure before any step (bad inputs) is raised here
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    async def fork(self, run_id: str, /, *, at: str, workflow: Workflow | None = None, tracer: Tracer | None = None,
                   observer: RunObserver | None = None, events: Any = None, **inputs: Any) -> RunResult:
        """Time travel: a new run from the state of run ``run_id`` just before step ``at``, with ``inputs``
        replacing its inputs of those names. ``at`` (a step, or one inside a subgraph step: ``outer/inner``)
        and the steps downstream of it run again, the steps upstream keep their results (their threads reuse
        the engine's cached KV where it is still there).
        The source run is unchanged; the result's ``run_id`` is the new run's (flowrt.checkpoint.fork)."""
        wf, checked, run = self.prepare_fork(run_id, at=at, workflow=workflow, inputs=inputs)
        return await self.execute(wf, checked, tracer=tracer, observer=observer, events=events, run=run)

    def prepare_fork(self, run_id: str, *, at: str, workflow: Workflow | None = None,
                     inputs: dict[str, Any] | None = None) -> tuple[Workflow, dict[str, Any], Any]:
        """What ``fork`` does before it runs: the workflow, the new run's checked inputs, and the new run (a
        ``RunCheckpoint`` held by this process; ``execute(wf, inputs, run=...)`` runs it). Refusals:
        ``UnknownRunError``, ``flowrt.checkpoint.fork.UnknownStepError`` (``at`` names no step),
        ``ForkAtError`` (a step that cannot be forked inside), ``RunBusyError`` (the run is running now),
        ``WorkflowError`` (inputs)."""
        from ..checkpoint import CheckpointError
        from ..checkpoint.fork import fork_run

        if self.checkpointer is None:
            raise CheckpointError("fork needs a checkpointer: fr.Runtime(checkpoint=\"runs.db\")")
        record = self.checkpointer.get_run(run_id, with_state=False)
        wf = workflow
        if wf is None:
            if not record.file:
                raise CheckpointError(f"run {run_id} recorded no workflow file; pass workflow=")
            from ..graph.loader import load_workflow, loaded_workflow

            wf = loaded_workflow(record.file, record.workflow) or load_workflow(record.file, record.workflow)
        wf.validate()
        checked = wf.check_inputs({**record.inputs, **(inputs or {})})
        run = fork_run(self.checkpointer, run_id, wf, at, checked)
        run.kv = self.kv_checkpoint   # with KV checkpoints, the source run's saved blocks are loaded
        return wf, checked, run


def _kv_stats(result: RunResult, run: Any) -> RunResult:
    """With KV checkpoints: how many KV blocks could not be saved (a full or read-only file system, the disk
    budget), how long its saves kept the event loop (``kv_save_blocked_s``: copying blocks out of the engine,
    waiting for room in the writer's queue, and at the run's end the last blocks' writes), and for
    a resume how many saved blocks it loaded and how many it could not use (by reason: missing, corrupt,
    foreign, not_a_file, unreadable), in ``result.stats``."""
    if getattr(run, "kv", None) is not None and run.kv.bound:
        result.stats["kv_blocks_save_failed"] = run.kv_save_failed
        result.stats["kv_save_blocked_s"] = round(run.kv_save_blocked_s, 6)
    if getattr(run, "kv_load", None) is not None:
        result.stats["kv_blocks_loaded"] = run.kv_load.loaded
        result.stats["kv_blocks_rejected"] = dict(run.kv_load.rejected)
    return result


def _cache_stats(result: RunResult, cache: Any, wf: Workflow) -> RunResult:
    """The step cache's hits and misses in ``result.stats`` (``run.cache_hits``, flat ``run_cache_hits``, and the
    misses alike), for a run with a cache whose workflow has ``fr.Cache`` steps (or made lookups in subgraphs)."""
    if cache is None or not (cache.hits or cache.misses or any(s.cache for s in wf.steps.values())):
        return result
    for k, v in cache.stats().items():
        result.stats.setdefault("run", {})[k] = v
        result.stats[f"run_{k}"] = v
    return result


def _checkpoint_error(group: BaseException) -> BaseException | None:
    """The first of ``group``'s errors when they all are checkpoint errors (a lost lease, a store that cannot
    be written), else None."""
    from ..checkpoint import CheckpointError

    leaves = _leaves(group)
    return leaves[0] if leaves and all(isinstance(e, CheckpointError) for e in leaves) else None


def _workflow_file(wf: Workflow) -> str | None:
    """The file that defines ``wf`` (its steps' source file), for ``flowrt resume``."""
    import inspect

    for s in wf.steps.values():
        try:
            f = inspect.getsourcefile(inspect.unwrap(s.fn))
        except TypeError:
            continue
        if f:
            return os.path.abspath(f)
    return None



class _RunResources:
    """One run's resources on a replicated runtime: its own ``fr.Model`` on a ``RunClient`` (every thread,
    fork and request of the run goes to one replica), the runtime's shared resources otherwise."""

    def __init__(self, rt: Runtime) -> None:
        self._rt = rt
        self._model: Model | None = None

    async def get_resource(self, name: str) -> Any:
        if name != "llm":
            return await self._rt.get_resource(name)
        shared: Model = await self._rt.get_resource("llm")
        if self._model is None:
            bind = getattr(shared.engine, "bind", None)
            self._model = Model(bind(), share_kv=shared.share_kv) if bind is not None else shared
        return self._model

    def release(self) -> None:
        if self._model is not None:
            release = getattr(self._model.engine, "release", None)
            if release is not None:
                release()
