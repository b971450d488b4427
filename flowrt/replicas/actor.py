"""One engine replica: an ``AsyncLLM`` with its own KV pool, run inside a Ray actor.

``ReplicaServer`` is plain Python (no Ray import), so it can be tested in-process; ``actor_class()`` wraps it
as a Ray actor class (imported only when replicas are used).

Protocol with the client (flowrt/replicas/client.py):

* Sequence operations (open / append / fork / close / state) are cheap and synchronous on the client, which
  queues them and sends them, in order, with its next call (``call``). Sequence ids are chosen by the client,
  so no round trip is needed to open or fork. Every call carries ``(epoch, batch)``: ``epoch`` names this
  incarnation of the actor (a restarted actor has a new one and none of the old sequences); ``batch`` is a
  per-epoch counter that puts the operation batches back in submission order (Ray does not promise ordered
  execution on async actors).
* ``call`` with a generate request returns the final ``RequestOutput``; with a stream request it returns
  once the request is queued (a bad request raises there), and ``poll(rid)`` long-polls its snapshots.
* ``state()`` is the router's health check and event feed: stats, and the prefix-cache events (blocks
  stored / evicted) of the block pool since the last call, or a full snapshot after an overflow.
* ``rejoin(epoch)`` is how the client takes a replica back that it gave up on (it died, or only did not
  answer in time): the client dropped what it had queued for that epoch (appends, closes), so if this
  incarnation is the one it gave up on, it ends here (its sequences closed, once their requests are over)
  and a new epoch begins; its sequences are restored from their token ids wherever they are used next.
* KV between replicas: a ``("pull", None, source_actor, token_ids, wait_s)`` operation copies the prefix's blocks
  from another replica (its ``export_kv``, through Ray's object store) into this one's prefix cache before the
  batch's other operations; ``export_kv`` / ``import_kv`` also serve KV checkpoints (the client side writes
  and reads the shared block directory). Blocks move only between equal ``kv_fingerprint`` s.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import uuid
from typing import Any

from .index import chain_hashes

logger = logging.getLogger("flowrt.replicas")

BATCH_ORDER_TIMEOUT_S = 30.0
PULL_TIMEOUT_S = 10.0


def _ray_node_id() -> str:
    """The Ray node this process runs on ("" outside Ray: the in-process tests)."""
    try:
        import ray

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""
    except Exception:  # noqa: BLE001 - informational
        return ""


class StaleEpochError(RuntimeError):
    """The call was meant for an earlier incarnation of this replica (it restarted)."""


class ReplicaServer:
    def __init__(self, index: int, model: str | None, engine_kwargs: dict[str, Any],
                 cores: list[int] | None = None) -> None:
        self.index = index
        self.cores = None
        if cores and hasattr(os, "sched_setaffinity"):  # its share of the node's cores (the engine's threads too)
            try:
                os.sched_setaffinity(0, cores)
                self.cores = sorted(os.sched_getaffinity(0))
            except OSError:
                pass
        self.node = socket.gethostname()
        self.pid = os.getpid()
        self.epoch = uuid.uuid4().hex
        self.model = model
        self.start_error: str | None = None
        self.engine = None
        self.seqs: dict[str, Any] = {}
        self.busy: dict[str, asyncio.Event] = {}
        self.streams: dict[str, asyncio.Queue] = {}
        self.tasks: set[asyncio.Task] = set()
        self._next_batch = 0
        self._cond: asyncio.Condition | None = None
        self._retired: dict[str, Any] = {}   # sequences of an ended epoch, closed once their request is over
        if model is not None and not os.path.exists(model):
            self.start_error = (f"replica {index}: the model path {model!r} does not exist on node {self.node} "
                                f"(pid {self.pid}); it must exist at the same path on every node")
            return
        try:
            from flowrt.engine import AsyncLLM

            self.engine = AsyncLLM(model=model, **engine_kwargs)
        except Exception as e:  # noqa: BLE001 - reported by info(), so the client fails with a clear error, not a restart loop
            self.start_error = (f"replica {index} on node {self.node}: the engine failed to start: "
                                f"{type(e).__name__}: {e}")
            return
        self.pool = self.engine.engine.pool
        self.pool.enable_events()
        self.fingerprint = self.engine.kv_fingerprint()
        self.node_id = _ray_node_id()
        self.pull_stats = {"kv_blocks_pulled": 0, "kv_pulls": 0, "kv_pull_failures": 0, "kv_pull_s": 0.0,
                           "kv_blocks_imported": 0, "kv_blocks_exported": 0}
        self._dropped_seen = 0
        self._need_snapshot = True

    # ------------------------------------------------------------------ lifecycle / info
    def info(self) -> dict[str, Any]:
        if self.start_error is not None:
            raise RuntimeError(self.start_error)
        st = self.engine.stats()
        return {"index": self.index, "epoch": self.epoch, "node": self.node, "pid": self.pid,
                "max_model_len": self.engine.max_model_len, "block_size": st["block_size"],
                "num_kv_blocks": st["num_kv_blocks"], "model_path": self.engine.model_path, "cores": self.cores,
                "node_id": self.node_id, "fingerprint": self.fingerprint,
                "block_bytes": self.engine.kv_block_bytes()}

    async def rejoin(self, epoch: str | None) -> dict[str, Any]:
        """``info()`` for a client taking this replica back after giving up on ``epoch``: that epoch ends here
        if it is this incarnation's (a slow replica, not a restarted one), so that no sequence of it, missing
        the operations the client dropped, is used again."""
        if epoch is not None and epoch == self.epoch:
            self.epoch, self._next_batch = uuid.uuid4().hex, 0
            old, self.seqs = self.seqs, {}
            for sid, seq in old.items():
                if sid in self.busy:
                    self._retired[sid] = seq   # generating: closed when its request ends (_unmark_busy)
                else:
                    seq.close()
            if self._cond is not None:
                async with self._cond:
                    self._cond.notify_all()   # calls of the old epoch waiting for their turn fail now
        return self.info()

    def tokenizer(self) -> Any:
        if self.start_error is not None:
            raise RuntimeError(self.start_error)
        return self.engine.tokenizer

    def reset_cache(self) -> int:
        """Drop every unreferenced block from the prefix cache (benchmarks); the next state() resyncs."""
        n = self.engine.engine.reset_prefix_cache()
        self._need_snapshot = True
        return n

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()

    def state(self) -> dict[str, Any]:
        """Health check + stats + the prefix-cache events since the last call (drained here)."""
        if self.start_error is not None:
            raise RuntimeError(self.start_error)
        pool = self.pool
        ev = pool.events
        out: dict[str, Any] = {"epoch": self.epoch, "stats": {**self.engine.stats(), **self.pull_stats},
                               "pid": self.pid}
        if self._need_snapshot or pool.events_dropped != self._dropped_seen:
            with self.engine.engine.lock:
                ev.clear()
                self._dropped_seen = pool.events_dropped
                out["snapshot"] = list(pool.cached)
            self._need_snapshot = False
        else:
            events = []
            for _ in range(len(ev)):
                try:
                    events.append(ev.popleft())
                except IndexError:
                    break
            out["events"] = events
        return out

    # ------------------------------------------------------------------ ordered calls
    def _check_epoch(self, epoch: str) -> None:
        if epoch != self.epoch:
            raise StaleEpochError(f"replica {self.index} restarted (its sequences are gone)")

    async def _in_order(self, epoch: str, batch: int) -> None:
        self._check_epoch(epoch)
        if self._cond is None:
            self._cond = asyncio.Condition()
        async with self._cond:
            if self._next_batch < batch:
                try:
                    await asyncio.wait_for(
                        self._cond.wait_for(lambda: self._next_batch >= batch or epoch != self.epoch),
                        BATCH_ORDER_TIMEOUT_S)
                except asyncio.TimeoutError:
                    logger.error("replica %d: operation batch %d never came; going on", self.index, self._next_batch)
        self._check_epoch(epoch)

    async def _advance(self, epoch: str, batch: int) -> None:
        assert self._cond is not None   # _in_order made it
        async with self._cond:
            if epoch == self.epoch:   # a call of an ended epoch does not move the new one's count
                self._next_batch = max(self._next_batch, batch + 1)
            self._cond.notify_all()

    def _apply(self, ops: list[tuple]) -> None:
        for op in ops:
            try:
                kind, sid = op[0], op[1]
                if kind == "open":
                    self.seqs[sid] = (self.engine.open(op[2], program=op[3]) if op[3] is not None
                                      else self.engine.open(op[2]))
                elif kind == "append":
                    self.seqs[sid].append(op[2])
                elif kind == "fork":
                    for cid, child in zip(op[2], self.seqs[sid].fork(len(op[2]))):
                        self.seqs[cid] = child
                elif kind == "close":
                    seq = self.seqs.pop(sid, None)
                    if seq is not None:
                        seq.close()
                elif kind == "state":
                    seq = self.seqs.get(sid)
                    if seq is not None and hasattr(seq, "set_state"):
                        seq.set_state(op[2], **op[3])
            except Exception:  # one bad operation must not stop the others; the request on it fails clearly
                logger.exception("replica %d: sequence operation %r failed", self.index, op[:2])

    def _target(self, req: dict[str, Any]) -> Any:
        sid = req.get("sid")
        if sid is None:
            return req["prompt"]
        seq = self.seqs.get(sid)
        if seq is None:
            raise RuntimeError(f"replica {self.index}: unknown sequence {sid} (closed, or lost in a restart)")
        return seq

    def _kwargs(self, req: dict[str, Any]) -> dict[str, Any]:
        kw: dict[str, Any] = {"request_id": req["rid"]}
        if req.get("program") is not None:
            kw["program"] = req["program"]
        return kw

    # ------------------------------------------------------------------ KV in and out
    async def export_kv(self, token_ids: list[int], skip: list[bytes], fingerprint: str,
                        wait_s: float = 0.0) -> list[tuple[bytes, bytes | None]]:
        """The full blocks of ``token_ids`` this replica holds, in chain order ((hash, None) for those in
        ``skip``); nothing for a caller of another fingerprint (its weights or dtype differ). ``wait_s``: wait
        up to that long for blocks still being computed here (the router sends a pull as soon as it routed the
        prefix here, often before its prefill is done)."""
        if self.engine is None or fingerprint != self.fingerprint:
            return []
        have = set(skip)
        want = len(token_ids) // self.engine.engine.block_size
        deadline = asyncio.get_running_loop().time() + wait_s
        while True:
            out = self.engine.kv_export(token_ids, skip=have.__contains__ if have else None)
            if len(out) >= want or asyncio.get_running_loop().time() >= deadline:
                break
            await asyncio.sleep(0.005)
        self.pull_stats["kv_blocks_exported"] += sum(1 for _, d in out if d is not None)
        return out

    def import_kv(self, blocks: list[tuple[bytes, bytes]], fingerprint: str) -> int:
        """Blocks of an engine with ``fingerprint`` into the prefix cache (none of a foreign one)."""
        if self.engine is None or fingerprint != self.fingerprint:
            return 0
        n = self.engine.kv_import([(h, d) for h, d in blocks if d is not None])
        self.pull_stats["kv_blocks_imported"] += n
        return n

    async def _pull(self, source: Any, token_ids: list[int], wait_s: float) -> None:
        """Copy a prefix's blocks from ``source`` (another replica); on any failure the prefill computes them."""
        import time

        t0 = time.perf_counter()
        st = self.pull_stats
        try:
            chain = chain_hashes(token_ids, self.engine.engine.block_size)
            have = [h for h in chain if self.pool.lookup(h) is not None]   # not sent again
            blocks = await asyncio.wait_for(source.export_kv.remote(token_ids, have, self.fingerprint, wait_s),
                                            PULL_TIMEOUT_S + wait_s)
            n = self.engine.kv_import([(h, d) for h, d in blocks if d is not None])
        except Exception as e:  # noqa: BLE001 - an optimisation: the prefill computes what did not come
            st["kv_pull_failures"] += 1
            logger.warning("replica %d: pulling KV from another replica failed (%s: %s); computing it",
                           self.index, type(e).__name__, e)
            return
        st["kv_pulls"] += 1
        st["kv_blocks_pulled"] += n
        st["kv_pull_s"] += time.perf_counter() - t0

    async def call(self, epoch: str, batch: int, ops: list[tuple], req: dict[str, Any] | None) -> Any:
        await self._in_order(epoch, batch)
        try:
            for op in ops:
                if op[0] == "pull":
                    await self._pull(op[2], op[3], op[4])
            self._check_epoch(epoch)   # not rejoined meanwhile: the ops are of this epoch's sequences
            self._apply([op for op in ops if op[0] != "pull"])
            if req is None:
                return None
            target = self._target(req)
            sid = req.get("sid")
            if req["kind"] == "stream":
                it = self.engine.stream(target, req["params"], **self._kwargs(req))  # validates now
                q: asyncio.Queue = asyncio.Queue()
                self.streams[req["rid"]] = q
                self._mark_busy(sid)
                task = asyncio.get_running_loop().create_task(self._pump(it, q, sid))
                self.tasks.add(task)
                task.add_done_callback(self.tasks.discard)
                return None
            coro = self.engine.generate(target, req["params"], **self._kwargs(req))
        finally:
            await self._advance(epoch, batch)
        self._mark_busy(sid)
        try:
            return await coro
        finally:
            self._unmark_busy(sid)

    def _mark_busy(self, sid: str | None) -> None:
        if sid is not None:
            self.busy[sid] = asyncio.Event()

    def _unmark_busy(self, sid: str | None) -> None:
        if sid is not None:
            ev = self.busy.pop(sid, None)
            if ev is not None:
                ev.set()
            retired = self._retired.pop(sid, None)
            if retired is not None:
                retired.close()

    async def _pump(self, it, q: asyncio.Queue, sid: str | None) -> None:
        try:
            async for out in it:
                q.put_nowait(out)
        except BaseException as e:  # noqa: BLE001 - delivered to the poller
            q.put_nowait(e if isinstance(e, Exception) else RuntimeError(f"stream ended: {type(e).__name__}"))
        finally:
            self._unmark_busy(sid)

    async def poll(self, rid: str) -> list[Any]:
        """The stream's snapshots since the last poll (waits for at least one); the last is finished."""
        q = self.streams.get(rid)
        if q is None:
            raise RuntimeError(f"replica {self.index}: unknown stream {rid}")
        items = [await q.get()]
        while not q.empty():
            items.append(q.get_nowait())
        done = False
        for i, item in enumerate(items):
            if isinstance(item, BaseException):
                self.streams.pop(rid, None)
                raise item
            if item.finished:
                done = True
                items = items[:i + 1]
                break
        if done:
            self.streams.pop(rid, None)
        return items

    def abort(self, rid: str) -> bool:
        return bool(self.engine.abort(rid)) if self.engine is not None else False

    async def seq_tokens(self, sid: str) -> list[int] | None:
        """A sequence's token ids once its current request (if any) is over."""
        ev = self.busy.get(sid)
        if ev is not None:
            await ev.wait()
        seq = self.seqs.get(sid)
        return None if seq is None else seq.token_ids

    def pid_of(self) -> int:
        return self.pid


_ACTOR_CLASS = None


def actor_class():
    """``ReplicaServer`` as a Ray actor class (created once; imports ray)."""
    global _ACTOR_CLASS
    if _ACTOR_CLASS is None:
        import ray

        _ACTOR_CLASS = ray.remote(ReplicaServer)
    return _ACTOR_CLASS
