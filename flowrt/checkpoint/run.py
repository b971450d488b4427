"""``RunCheckpoint``: one run's view of a store, used by the executor (save after every step, restore)."""

from __future__ import annotations

import contextlib
import os
import uuid
from typing import TYPE_CHECKING, Any, Iterator, cast

from ..render import to_jsonable
from ..runner.state import RunState, RunStatus, StepStatus
from .codec import encode, encode_thread
from .kv import KVCheckpoint, KVLoad, owner_of
from .kv_refs import new_owner
from .lease import LEASE_TTL_S, holder_is_dead, new_holder, renewer
from .needs import resources_to_continue
from .state_codec import StoredState, dump, load, restore
from .store import CheckpointError, CheckpointStore, RunBusyError, RunRecord

if TYPE_CHECKING:
    from ..context import RunThreads
    from ..graph.workflow import Workflow
    from ..runner.interrupts import InterruptScope

__all__ = ["RunCheckpoint", "open_store", "NO_ANSWER"]

NO_ANSWER: Any = object()


def open_store(spec: Any, *, readonly: bool = False, create: bool = True) -> CheckpointStore | None:
    """A store from ``None``, a path (SQLite file; ``":memory:"``), a ``postgresql://`` URL (PostgreSQL) or a
    store object. ``readonly`` (reading commands: nothing is created or changed) and ``create=False`` (a missing
    SQLite file, or a PostgreSQL database without flowrt's tables, is an error, not a new store): see
    ``SQLiteStore`` and ``PostgresStore``."""
    if spec is None:
        return None
    if isinstance(spec, (str, bytes, os.PathLike)):
        spec = os.fsdecode(spec)
        from .postgres import PostgresStore, is_postgres_url

        if is_postgres_url(spec):
            return PostgresStore(spec, readonly=readonly, create=create)
        from .sqlite import SQLiteStore

        return SQLiteStore(spec, readonly=readonly, create=create)
    if isinstance(spec, CheckpointStore):
        return spec
    raise TypeError(f"checkpoint must be a database path, a postgresql:// URL or a CheckpointStore, "
                    f"got {type(spec).__name__}")


class RunCheckpoint:
    """Saves a run's state to ``store`` after every step; ``resume`` continues a stored run.

    The run is held by ``holder`` (flowrt.checkpoint.lease) while it executes: ``held()`` renews the lease
    and gives it back at the end, and every save is refused once another holder has taken the run over."""

    def __init__(self, store: CheckpointStore, run_id: str, *, record: RunRecord | None = None,
                 answer: Any = NO_ANSWER, kv: KVCheckpoint | None = None,
                 answers: dict[str, Any] | None = None, holder: str | None = None,
                 ttl: float = LEASE_TTL_S) -> None:
        self.store = store
        self.run_id = run_id
        self.record = record
        self.answer = answer
        self.holder = holder
        self.ttl = ttl
        self.answers = answers or {}          # by step, for a run waiting at several interrupts
        self.kv = kv                          # KV saved with the checkpoints (flowrt.checkpoint.kv)
        self.kv_load: KVLoad | None = None    # what a resume loaded
        self.kv_save_failed = 0               # KV blocks that could not be written (a full disk, ...)
        self.kv_save_blocked_s = 0.0          # time its saves kept the event loop on KV (flowrt.checkpoint.kv)
        self.kv_owner: str | None = None      # the run's KV reference file (flowrt.checkpoint.kv_refs)
        self._kv_kept: dict[str, Any] | None = None   # the KV reference of the state the store holds
        self._scope: InterruptScope | None = None
        self.restored_steps: list[str] = []   # steps a resume did not run again
        self.activity: Any = None             # a RunActivity (flowrt.runner.activity): LLM calls, forks

    @classmethod
    def new(cls, store: CheckpointStore, workflow: str, inputs: dict[str, Any], *, file: str | None = None,
            meta: dict[str, Any] | None = None, run_id: str | None = None,
            kv: KVCheckpoint | None = None) -> "RunCheckpoint":
        run_id = run_id or uuid.uuid4().hex[:16]
        holder = new_holder()
        store.create_run(run_id, workflow, to_jsonable(inputs), file=file, meta=meta, holder=holder, ttl=LEASE_TTL_S)
        return cls(store, run_id, kv=kv, holder=holder)

    @classmethod
    def resume(cls, store: CheckpointStore, run_id: str, *, answer: Any = NO_ANSWER,
               kv: KVCheckpoint | None = None, answers: dict[str, Any] | None = None) -> "RunCheckpoint":
        """Claim the stored run (``claim_run``: one atomic transition, so of two resumes one wins and the
        other gets ``RunBusyError`` naming the winner); a holder of this host whose process died is taken
        over at once, others when their lease runs out."""
        holder = new_holder()
        waiting = answer is not NO_ANSWER or bool(answers)
        try:
            record = store.claim_run(run_id, holder, LEASE_TTL_S, waiting=waiting)
        except RunBusyError as e:
            if not holder_is_dead(e.holder):
                raise
            record = store.claim_run(run_id, holder, LEASE_TTL_S, take_over=e.holder, waiting=waiting)
        run = cls(store, run_id, record=record, answer=answer, kv=kv, answers=answers, holder=holder)
        if waiting:
            try:
                run._given_answers(load(record.state) or {})
            except CheckpointError:   # answers that do not fit: the run stays interrupted, unclaimed
                store.release_run(run_id, holder, status=str(RunStatus.INTERRUPTED))
                raise
        return run

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Keep the run's lease renewed while the block runs; give it back after (a run that ended gave
        it back with its last save already)."""
        if self.holder is None:
            yield
            return
        renewer().hold(self.store, self.run_id, self.holder, self.ttl)
        try:
            yield
        finally:
            renewer().drop(self.store, self.run_id, self.holder)
            try:
                self.store.release_run(self.run_id, self.holder)
            except CheckpointError:
                pass   # the store cannot be written now: the lease runs out by itself

    @property
    def saves_kv(self) -> bool:
        """Its checkpoints save KV blocks (bound to the run's engine)."""
        return self.kv is not None and self.kv.bound

    # ------------------------------------------------------------------ executor hooks (flowrt.runner.checkpointer)
    def resources_to_continue(self, wf: Workflow) -> list[str] | None:
        """The resources to load before the run starts: for a resume those its remaining steps need
        (flowrt.checkpoint.needs), for a new run None (all of the workflow's)."""
        state = self.record.state if self.record is not None else None
        return resources_to_continue(wf, state) if state else None

    def start(self, st: RunState, scope: InterruptScope, model: Any) -> bool:
        """Fill the executor's state from the stored one (a resume); False for a new run."""
        self._scope = scope
        if self.kv is not None and model is not None:
            self.kv.bind(model.engine)
        state = load(self.record.state if self.record is not None else None)
        self._kv_kept = (state or {}).get("kv")
        self.kv_owner = owner_of(self._kv_kept, self.run_id)   # a resume keeps it, a fork gets its own
        if state and self.kv is not None:
            self.kv_load = self.kv.load(state.get("kv"))   # into the prefix cache, before any prefill
        if not state:
            if self.record is not None and (self.answer is not NO_ANSWER or self.answers):
                raise CheckpointError(f"run {self.run_id} is not waiting for an answer")
            return False
        restore(st, state, model, run_id=self.run_id)
        scope.answers = {k: list(v) for k, v in state.get("answers", {}).items()}
        for step, value in self._given_answers(state).items():
            scope.answers.setdefault(step, []).append(value)
        self.restored_steps = [n for n, s in st.status.items() if s == StepStatus.DONE and n in st.outputs]
        return True

    def _given_answers(self, state: StoredState) -> dict[str, Any]:
        """The answers given to this resume, by the step of the pending interrupt each answers."""
        first = state.get("interrupt")
        pending = state.get("interrupts") or ([first] if first else [])
        steps = [p["step"] for p in pending]
        if (self.answer is not NO_ANSWER or self.answers) and not pending:
            raise CheckpointError(f"run {self.run_id} is not waiting for an answer (status "
                                  f"{self.record.status if self.record else '?'})")
        given = dict(self.answers)
        if self.answer is not NO_ANSWER:
            if len(steps) > 1:
                raise CheckpointError(f"run {self.run_id} waits for {len(steps)} answers (steps "
                                      f"{', '.join(steps)}): answer each by step (--answer STEP=VALUE; "
                                      f"answers={{step: value}})")
            given[steps[0]] = self.answer
        unknown = [s for s in given if s not in steps]
        if unknown:
            raise CheckpointError(f"run {self.run_id} has no pending interrupt at {', '.join(map(repr, unknown))} "
                                  f"(it waits at {', '.join(map(repr, steps))})")
        return given

    def restore_into(self, st: RunState, saved: StoredState, model: Any, path: str) -> None:
        """Fill the state of the subgraph at ``path`` from the one its last run left (found by the resume)."""
        restore(st, saved, model, run_id=self.run_id, path=path)

    def record_output(self, st: RunState, step: str, value: Any) -> None:
        """Encode a step's result once, when it ends (every later checkpoint saves it as encoded here)."""
        st.encoded[step] = encode(value)

    @staticmethod
    def _threads(threads: RunThreads) -> list[dict[str, Any]]:
        out = []
        for t, step in threads.live():
            try:
                d = encode_thread(t)
            except Exception:  # noqa: BLE001 - a thread in a state that cannot be read now is left out
                continue
            d.pop("__flowrt__", None)
            out.append({"id": t.id, "step": step, "fork_index": getattr(t, "fork_index", 0), **d})
        return out

    def save(self, st: RunState, step: str | None, threads: RunThreads, run_status: RunStatus = RunStatus.RUNNING,
             *, at: RunState | None = None) -> None:
        """Checkpoint after ``step`` (None: the run's end). ``at``: the state of the subgraph that holds
        ``step`` (a path, ``research/search``), when it is not the run's own."""
        own = at if at is not None else st
        name = step.rsplit("/", 1)[-1] if step else None
        route = next((r for r in reversed(own.route_log) if r["step"] == name), None) if name else None
        status = str(own.status.get(name, "")) if name else str(run_status)
        answers = self._scope.answers if self._scope is not None else None
        live, state = self._threads(threads), dump(st, answers=answers, held_threads=self.kv is not None)
        if self.activity is not None:
            state.update(self.activity.state())
        if self.kv is not None and self.kv.bound and run_status != RunStatus.DONE:   # a finished run keeps no KV
            self.kv_owner = self.kv_owner or new_owner()
            held = [ids for lists in st.held_threads.values() for ids in lists]
            saved = self.kv.save([t["token_ids"] for t in live] + held, owner=self.kv_owner, run_id=self.run_id,
                                 kept=self._kv_kept, durable=step is None)   # the run's last: its blocks on disk
            state["kv"] = saved.ref
            self.kv_save_failed += saved.failed
            self.kv_save_blocked_s += saved.blocked_s
        elif self.kv_owner is not None:   # its reference file names the owner: any collection can drop it
            state["kv"] = {"owner": self.kv_owner, "run": self.run_id}
        self.store.save(self.run_id, step=step, visit=own.visits.get(name, 0) if name else 0, step_status=status,
                        result=own.encoded.get(name) if name and name in own.outputs else None,
                        route=route, threads=live, state=cast("dict[str, Any]", state),
                        run_status=str(run_status) if step is None else str(RunStatus.RUNNING),
                        interrupt=cast("dict[str, Any] | None", st.interrupt), holder=self.holder)
        self._kv_kept = state.get("kv")

    async def kv_flushed(self) -> None:
        """The KV blocks queued so far are on disk (waited for off the event loop; those of this run that
        could not be written are counted): the run's last checkpoint, saved next, waits only for what it adds."""
        if self.saves_kv and self.kv is not None:
            import anyio

            self.kv_save_failed += await anyio.to_thread.run_sync(self.kv.settle, self.run_id)

    def finish(self, st: RunState, status: RunStatus, threads: RunThreads) -> None:
        self.save(st, None, threads, run_status=status)
        if self.kv is not None and status == RunStatus.DONE:
            if self.kv_owner is not None:
                self.kv.release(self.kv_owner)
            self.kv.collect(self.store)   # its blocks go unless another unfinished run refers to them
