"""The viewer's side of a checkpoint store: which workflow a run is of, which runtime continues it, and the two
things the page can do to a run, answer its interrupt and fork it, each run as a background task.

Answering claims the run (``Runtime.claim``: one atomic transition of the store, as ``flowrt resume`` and
``POST /v1/workflows/{name}/runs/{id}/resume`` do) before the request returns, so a second answer, from the page,
the CLI or the HTTP API, is refused naming the holder; the run then executes in this process, holding its lease.
Under ``flowrt serve`` the workflows and runtime are the server's (its engine); under ``flowrt ui`` a run's
workflow is loaded from the file it recorded and it runs on a runtime built from the model and engine options it
recorded (one per distinct set, loaded when a step first needs the model).
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from ..checkpoint.store import CheckpointStore, RunRecord
    from ..graph.workflow import Workflow
    from ..runner.runtime import Runtime

__all__ = ["Viewer", "ViewerError"]

logger = logging.getLogger("flowrt.ui")


class ViewerError(Exception):
    """A refusal the page shows: ``status`` is the HTTP status (400 bad answer or inputs, 404 unknown run,
    409 finished or held by another)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def _refusal(e: Exception) -> ViewerError:
    """As the HTTP API answers them: 404 an unknown run or step, 400 bad inputs or a step that cannot be forked
    inside, 409 the rest (finished, held by another, not waiting)."""
    from ..checkpoint import CheckpointError, UnknownRunError
    from ..checkpoint.fork import ForkAtError, UnknownStepError
    from ..graph.workflow import WorkflowError

    if isinstance(e, (UnknownRunError, UnknownStepError)):
        return ViewerError(str(e), 404)
    if isinstance(e, (WorkflowError, ForkAtError)):
        return ViewerError(str(e), 400)
    if isinstance(e, CheckpointError):
        return ViewerError(str(e), 409)
    raise e


class Viewer:
    """``store``: gives the checkpoint store (called at each request: a server makes its runtime lazily);
    ``workflows``: name -> workflow, when they are known (a server's); ``runtime``: gives the runtime every run
    continues on (a server's), else one is made per run's recorded model and engine options, with
    ``runtime_options`` (the command line's) on top; ``api_key``: when set, the JSON API needs
    ``Authorization: Bearer <key>``."""

    def __init__(self, store: Callable[[], CheckpointStore], *, workflows: dict[str, Workflow] | None = None,
                 runtime: Callable[[], Runtime] | None = None, runtime_options: dict[str, Any] | None = None,
                 api_key: str | None = None) -> None:
        self._store = store
        self.workflows = workflows
        self._runtime = runtime
        self.runtime_options = dict(runtime_options or {})
        self.api_key = api_key
        self._runtimes: dict[str, Runtime] = {}
        self._loaded: dict[tuple[str, str, float], Workflow] = {}
        self.tasks: dict[str, asyncio.Task] = {}   # run id -> the task executing it here
        self.closing = False                       # shutting down: event streams end

    @property
    def store(self) -> CheckpointStore:
        return self._store()

    # ------------------------------------------------------------------ reading
    def workflow(self, record: RunRecord) -> Workflow | None:
        """The run's workflow (None when it cannot be had: the page then shows the steps without a graph)."""
        if self.workflows is not None:
            return self.workflows.get(record.workflow)
        if not record.file:
            return None
        try:
            key = (record.file, record.workflow, os.path.getmtime(record.file))
            if key not in self._loaded:
                from ..graph.loader import load_workflow, loaded_workflow

                wf = loaded_workflow(record.file, record.workflow) or load_workflow(record.file, record.workflow)
                wf.validate()
                self._loaded[key] = wf
            return self._loaded[key]
        except Exception as e:  # noqa: BLE001 - a file gone or broken: the run is still shown
            logger.warning("run %s: cannot load workflow %r from %s: %s", record.run_id, record.workflow,
                           record.file, e)
            return None

    def runtime(self, record: RunRecord) -> Runtime:
        if self._runtime is not None:
            return self._runtime()
        import json

        from ..runner.runtime import Runtime

        meta = record.meta or {}
        opts = {"model": meta.get("model"), "index": meta.get("index"), **(meta.get("engine") or {}),
                **self.runtime_options}
        key = json.dumps(opts, sort_keys=True, default=str)
        if key not in self._runtimes:
            self._runtimes[key] = Runtime(checkpoint=self.store, **opts)
        return self._runtimes[key]

    def running_here(self, run_id: str) -> bool:
        task = self.tasks.get(run_id)
        return task is not None and not task.done()

    # ------------------------------------------------------------------ acting
    def answer(self, run_id: str, given: dict[str, Any]) -> None:
        """Claim the interrupted run with ``given`` (``{"answer": v}`` or ``{"answers": {step: v}}``) and run it
        on in the background; refusals (the claim's: finished, held by another, named, not waiting) are
        ``ViewerError`` s."""
        from ..checkpoint import CheckpointError

        try:
            record = self.store.get_run(run_id, with_state=False)
        except CheckpointError as e:
            raise _refusal(e) from None
        wf = self._workflow_or_refuse(record)
        rt = self.runtime(record)
        try:
            _, run = rt.claim(run_id, workflow=wf, **given)
        except CheckpointError as e:
            raise _refusal(e) from None
        self._start(run_id, rt.execute(wf, dict(run.record.inputs), run=run), run)

    def fork(self, run_id: str, at: str, inputs: dict[str, Any]) -> str:
        """A new run of ``run_id``'s workflow from its state before step ``at`` (``at`` and its downstream run
        again; ``inputs`` replace the run's of those names), made by ``Runtime.prepare_fork`` (as ``flowrt runs
        fork`` and ``POST /v1/workflows/{name}/runs/{id}/fork``: a run running now is refused) and started in the
        background; its id."""
        from ..checkpoint import CheckpointError
        from ..graph.workflow import WorkflowError

        try:
            record = self.store.get_run(run_id, with_state=False)
            wf = self._workflow_or_refuse(record)
            rt = self.runtime(record)
            wf, checked, run = rt.prepare_fork(run_id, at=at, workflow=wf, inputs=inputs)   # as rt.fork and HTTP
        except (CheckpointError, WorkflowError) as e:
            raise _refusal(e) from None
        self._start(run.run_id, rt.execute(wf, checked, run=run), run)
        return run.run_id

    def _workflow_or_refuse(self, record: RunRecord) -> Workflow:
        wf = self.workflow(record)
        if wf is None:
            where = "this server does not serve it" if self.workflows is not None else \
                f"its file {record.file!r} cannot be loaded" if record.file else "it recorded no workflow file"
            raise ViewerError(f"run {record.run_id}: workflow {record.workflow!r} is not available ({where})", 409)
        return wf

    def _start(self, run_id: str, coro: Any, run: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks[run_id] = task

        def done(t: asyncio.Task) -> None:
            if not t.cancelled() and t.exception() is not None:
                logger.warning("run %s ended with an error: %s", run_id, t.exception())
            from ..server.workflows import _release

            _release(run)   # a task cancelled before it started still gives its lease back

        task.add_done_callback(done)

    def stop_all(self) -> int:
        """Cancel the runs executing here and end the event streams (shutdown); the runs' leases are given back,
        their last checkpoints stand."""
        self.closing = True
        live = [t for t in self.tasks.values() if not t.done()]
        for t in live:
            t.cancel()
        return len(live)

    def close(self) -> None:
        for rt in self._runtimes.values():
            rt.close()
        self._runtimes.clear()
