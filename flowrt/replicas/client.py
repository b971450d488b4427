"""Client side of the replicas: ``ReplicaSet`` (starts the actors, health/event poller), ``RouterClient`` (an
``EngineClient`` over all replicas), ``RunClient`` (an ``EngineClient`` bound to one replica for one workflow
run) and ``RemoteSequence`` (a ``SequenceHandle`` on a replica, by id).

Sequences mirror their token ids here, so ``token_ids`` / ``len`` need no round trip, and a sequence whose
replica died can be restored on another one from its token ids (the KV is recomputed there).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import threading
import uuid
import weakref
from collections import deque
from typing import Any, AsyncIterator, Iterable, Sequence

from .actor import actor_class
from .index import PrefixIndex, chain_hashes
from .pull import PullCost, PullPlan
from .router import NoReplicaError, ReplicaHandle, Router

logger = logging.getLogger("flowrt.replicas")

__all__ = ["ReplicaSet", "RouterClient", "RunClient", "RemoteSequence", "ReplicaDiedError", "NoReplicaError"]


class ReplicaDiedError(RuntimeError):
    """The replica a request ran on died (or restarted) while it ran; the message names the replica."""


def _ray():
    import ray

    return ray


def _is_actor_death(e: BaseException) -> bool:
    ray = _ray()
    if isinstance(e, ray.exceptions.RayTaskError):
        return "StaleEpochError" in type(e).__name__ or "StaleEpochError" in str(e)
    return isinstance(e, ray.exceptions.RayError)


def _cause(e: BaseException) -> BaseException:
    ray = _ray()
    if isinstance(e, ray.exceptions.RayTaskError):
        cause = getattr(e, "cause", None)
        if isinstance(cause, BaseException):
            return cause
    return e


def _cpu_nodes() -> list[tuple[str, float]]:
    """The cluster's live nodes that have CPUs: (node id, CPUs), most CPUs first (then by id: stable)."""
    out = []
    for nd in _ray().nodes():
        cpus = float((nd.get("Resources") or {}).get("CPU", 0))
        if nd.get("Alive") and cpus >= 1:
            out.append((nd["NodeID"], cpus))
    return sorted(out, key=lambda x: (-x[1], x[0]))


def _on_node(node_id: str) -> Any:
    """Schedule on ``node_id`` while it lives; a restart after its death goes wherever there is room."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(node_id, soft=True)


_sids = itertools.count(1)


class RemoteSequence:
    """A sequence on a replica. Operations are queued and sent in order with the next call to that replica."""

    def __init__(self, rs: "ReplicaSet", replica: ReplicaHandle | None, tokens: list[int], program: Any = None,
                 open_op: bool = True) -> None:
        self._rs = rs
        self._tokens = list(tokens)
        self._program = program
        self._closed = False
        self._busy = False
        self._stale_ref: Any = None  # a pending seq_tokens call after an early-closed stream
        self.replica: ReplicaHandle | None = None
        self.epoch: str | None = None
        self.sid = ""
        self._finalizer: Any = None
        if replica is not None and open_op:
            self._place(replica)

    def _place(self, replica: ReplicaHandle) -> None:
        """Open this sequence (its current tokens) on ``replica``."""
        if self._finalizer is not None:
            self._finalizer.detach()
        self.sid = f"{self._rs.client_id}-{next(_sids)}"
        self.replica, self.epoch = replica, replica.epoch
        self._rs.queue_op(replica, replica.epoch, ("open", self.sid, list(self._tokens), self._program))
        self._finalizer = weakref.finalize(self, self._rs.queue_op, replica, replica.epoch, ("close", self.sid))

    def _adopt(self, replica: ReplicaHandle, sid: str) -> None:
        self.sid, self.replica, self.epoch = sid, replica, replica.epoch
        self._finalizer = weakref.finalize(self, self._rs.queue_op, replica, replica.epoch, ("close", sid))

    @property
    def alive(self) -> bool:
        """Its replica is up and still the incarnation it was opened on."""
        r = self.replica
        return r is not None and r.healthy and r.epoch == self.epoch

    # ---- SequenceHandle ----------------------------------------------------------------------------
    @property
    def token_ids(self) -> list[int]:
        if self._stale_ref is not None:
            self._sync_tokens()
        return list(self._tokens)

    def _sync_tokens(self) -> None:
        ref, self._stale_ref = self._stale_ref, None
        try:
            toks = _ray().get(ref, timeout=30)
        except Exception:  # noqa: BLE001 - best-effort token sync
            return
        if toks is not None:
            self._tokens = list(toks)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def program(self) -> Any:
        return self._program

    def __len__(self) -> int:
        if self._stale_ref is not None:
            self._sync_tokens()
        return len(self._tokens)

    def _check(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"cannot {what} a closed sequence")
        if self._busy:
            raise RuntimeError(f"cannot {what} a sequence while it is generating")

    def append(self, token_ids: Iterable[int]) -> None:
        self._check("append to")
        ids = [int(t) for t in token_ids]
        if self._stale_ref is not None:
            self._sync_tokens()
        self._tokens.extend(ids)
        if self.replica is not None and self.alive:
            self._rs.queue_op(self.replica, self.epoch, ("append", self.sid, ids))

    def fork(self, n: int = 1) -> list["RemoteSequence"]:
        self._check("fork")
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        if self._stale_ref is not None:
            self._sync_tokens()
        children = [RemoteSequence(self._rs, None, self._tokens, self._program, open_op=False) for _ in range(n)]
        if self.replica is not None and self.alive:
            cids = [f"{self._rs.client_id}-{next(_sids)}" for _ in range(n)]
            self._rs.queue_op(self.replica, self.epoch, ("fork", self.sid, cids))
            for c, cid in zip(children, cids):
                c._adopt(self.replica, cid)
        return children

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._finalizer is not None:
            self._finalizer()  # queues the close op once

    def set_state(self, state: str, **context: Any) -> None:
        if self.replica is not None and self.alive and not self._closed:
            self._rs.queue_op(self.replica, self.epoch, ("state", self.sid, state, context))

    def __repr__(self) -> str:
        where = self.replica.index if self.replica is not None else None
        return f"RemoteSequence(id={self.sid}, replica={where}, tokens={len(self._tokens)})"


PLACEMENTS = ("node", "pack")


class ReplicaSet:
    """N engine replicas as Ray actors, their router, and a thread that polls their health, load and cache
    events. Starts Ray locally unless it is already initialized or ``ray_address`` names a cluster.

    ``placement="node"`` (default): on a cluster of at least N nodes with CPUs, one replica per node, each
    taking the node's CPUs (soft node affinity: a replica whose node died is restarted by Ray wherever there
    is room, e.g. on a node that joins); with fewer nodes, or ``"pack"``, Ray places them by resources (each
    ``num_cpus_per_replica``, by default the cluster's CPUs / N). ``pull``: the cost estimate for copying
    a prefix's KV between replicas (pull.py; ``False``: never). ``max_takeovers``, ``takeover_wait_s``: how
    often a checkpointed run whose replica died is taken over by another, and how long it waits for a live
    replica (flowrt/replicas/takeover.py)."""

    def __init__(self, model: str | None, replicas: int, *, ray_address: str | None = None,
                 routing: str = "prefix", load_abs: int = 8, load_rel: float = 1.5, max_restarts: int = 3,
                 poll_interval: float = 0.1, num_cpus_per_replica: float | None = None,
                 num_gpus_per_replica: float | None = None, placement: str = "node",
                 pull: PullCost | bool | None = None, max_takeovers: int = 3, takeover_wait_s: float = 60.0,
                 **engine_kwargs: Any) -> None:
        if replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {replicas}")
        if placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
        ray = _ray()
        self._owns_ray = False
        if not ray.is_initialized():
            if ray_address:
                ray.init(address=ray_address, log_to_driver=False)
            else:
                ray.init(num_cpus=os.cpu_count() or 1, log_to_driver=False, include_dashboard=False)
            self._owns_ray = True
        self.client_id = uuid.uuid4().hex[:8]
        self.poll_interval = poll_interval
        self.max_takeovers, self.takeover_wait_s = max_takeovers, takeover_wait_s
        res = ray.cluster_resources()
        cpus = float(res.get("CPU", os.cpu_count() or 1))
        gpus = float(res.get("GPU", 0))
        if num_gpus_per_replica is None:
            on_gpu = gpus >= replicas and engine_kwargs.get("device") in (None, "auto", "cuda")
            num_gpus_per_replica = 1.0 if on_gpu else 0.0
        nodes = _cpu_nodes() if placement == "node" and not num_gpus_per_replica else []
        spread = len(nodes) >= replicas > 1
        if num_cpus_per_replica is None:
            if num_gpus_per_replica:
                num_cpus_per_replica = 1.0
            elif spread:  # one per node: the smallest of the nodes used, whole
                num_cpus_per_replica = max(1.0, min(n[1] for n in nodes[:replicas]))
            else:
                num_cpus_per_replica = max(1.0, float(int(cpus) // replicas))
        if not num_gpus_per_replica and engine_kwargs.get("num_threads") is None:
            engine_kwargs["num_threads"] = max(1, int(num_cpus_per_replica))
        if model is not None:
            model = os.fsdecode(model)
            if not os.path.isabs(model) and os.path.exists(model):
                model = os.path.abspath(model)
        opts = dict(num_cpus=num_cpus_per_replica, num_gpus=num_gpus_per_replica, max_restarts=max_restarts,
                    max_task_retries=0, max_concurrency=1000)
        pin = self._core_shares(replicas, num_cpus_per_replica, num_gpus_per_replica)
        handles = []
        for i in range(replicas):
            where = {"scheduling_strategy": _on_node(nodes[i][0])} if spread else {}
            cls = actor_class().options(**opts, **where)
            handles.append(ReplicaHandle(i, cls.remote(i, model, dict(engine_kwargs), pin[i])))
        self.replicas = handles
        try:
            infos = ray.get([h.actor.info.remote() for h in handles])
        except Exception as e:  # noqa: BLE001 - re-raised as RuntimeError after cleanup
            self._kill_all()
            raise RuntimeError(f"engine replicas failed to start: {_cause(e)}") from None
        for h, info in zip(handles, infos):
            self._adopt(h, info)
        self.info = infos[0]
        self.block_size = int(infos[0]["block_size"])
        self.max_model_len = int(infos[0]["max_model_len"])
        self.tokenizer = ray.get(handles[0].actor.tokenizer.remote())
        self.index = PrefixIndex(self.block_size, capacity_per_replica=2 * int(infos[0]["num_kv_blocks"]))
        cost = pull if isinstance(pull, PullCost) else PullCost(enabled=pull is not False)
        self.router = Router(handles, self.index, routing, load_abs=load_abs, load_rel=load_rel, pull=cost)
        self._stop = threading.Event()
        self._poller = threading.Thread(target=self._poll_loop, name="flowrt-replica-poller", daemon=True)
        self._poller.start()

    @staticmethod
    def _core_shares(n: int, cpus: float, gpus: float) -> list[list[int] | None]:
        """On a one-node CPU cluster, replica i is pinned to cores [i*k, (i+1)*k) (k = its num_cpus);
        elsewhere Ray places the replicas and they are not pinned."""
        ray = _ray()
        k = int(cpus)
        try:
            avail = sorted(os.sched_getaffinity(0))
            nodes = [nd for nd in ray.nodes() if nd.get("Alive")]
            one_node = len(nodes) == 1 and nodes[0].get("NodeManagerAddress") == ray.util.get_node_ip_address()
        except Exception:  # noqa: BLE001 - optional pinning probe
            return [None] * n
        if gpus or k < 1 or not one_node or n * k > len(avail):
            return [None] * n
        return [avail[i * k:(i + 1) * k] for i in range(n)]

    # ---- replica state -------------------------------------------------------------------------------
    def _adopt(self, h: ReplicaHandle, info: dict[str, Any]) -> None:
        with h.lock:
            h.epoch, h.node, h.pid, h.cores = info["epoch"], info["node"], info["pid"], info.get("cores")
            h.node_id, h.fingerprint = info.get("node_id", ""), info.get("fingerprint", "")
            h.block_bytes = int(info.get("block_bytes", 0))
            h.batch, h.lost_epoch = 0, None
            h.ops.clear()
            h.healthy, h.error = True, None

    def mark_dead(self, h: ReplicaHandle, why: str, epoch: str | None = None) -> None:
        with h.lock:
            if epoch is not None and h.epoch != epoch:
                return  # already handled (it may even be back)
            if h.healthy:
                h.deaths += 1
                logger.warning("%s is down: %s", h.name, why)
            if h.epoch is not None:   # its queued operations go: that epoch ends when it rejoins
                h.lost_epoch = h.epoch
            h.healthy, h.error, h.epoch = False, why, None
            h.ops.clear()
        with self.router.lock:
            self.index.clear(h.index)

    def queue_pull(self, h: ReplicaHandle, plan: PullPlan, token_ids: Sequence[int]) -> None:
        """Before ``h``'s next call, copy the planned prefix's blocks there from the holder."""
        src = self.replicas[plan.source]
        ids = [int(t) for t in token_ids[:plan.blocks * self.block_size]]
        if src.healthy:
            self.queue_op(h, h.epoch, ("pull", None, src.actor, ids, plan.wait_s))

    def holders_of(self, hashes: Sequence[bytes]) -> list[ReplicaHandle]:
        """The live replicas, those whose cache (by the index) holds the longest run of these leading blocks
        first (then the least loaded)."""
        live = self.router.live()
        with self.router.lock:
            match = self.index.match(list(hashes)[:self.index.max_query_blocks], [h.index for h in live])
        return sorted(live, key=lambda h: (-match.get(h.index, 0), h.load))

    def queue_op(self, h: ReplicaHandle, epoch: str | None, op: tuple) -> None:
        # No lock: garbage collection may run a sequence's finalizer anywhere, even inside submit().
        if h.epoch is not None and h.epoch == epoch:
            h.ops.append(op)

    def submit(self, h: ReplicaHandle, method: str, req: dict[str, Any] | None) -> Any:
        """Send the queued operations (and a request) to ``h`` in order; returns the ObjectRef."""
        with h.lock:
            if not h.healthy or h.epoch is None:
                raise ReplicaDiedError(f"{h.name} is down: {h.error or 'restarting'}")
            epoch, batch, ops = h.take_batch()
            try:
                ref = getattr(h.actor, method).remote(epoch, batch, ops, req)
            except Exception as e:  # noqa: BLE001 - Ray no longer knows the actor (its node is gone)
                failed = e
            else:
                return ref, epoch
        self.mark_dead(h, f"{type(failed).__name__}: {failed}", epoch)
        raise ReplicaDiedError(f"{h.name} is down: {failed}")

    def _poll_loop(self) -> None:
        """Every ``poll_interval``: each live replica's state (stats + cache events; all polled at once), and
        a health probe of each dead one (``rejoin``; answers once Ray has restarted it, or once a replica that
        only did not answer in time answers again, in a new epoch)."""
        probes: dict[int, Any] = {}  # replica index -> outstanding rejoin() call of a dead replica
        while not self._stop.wait(self.poll_interval):
            try:
                self._poll_once(probes)
            except Exception:  # noqa: BLE001 - the poller must outlive any one failure (Ray shutting down...)
                if self._stop.is_set():
                    return
                logger.exception("replica poller: one round failed; going on")

    def _poll_once(self, probes: dict[int, Any]) -> None:
        """One round: each live replica's state (stats + cache events; all polled at once), and a health probe
        of each dead one (``rejoin``: see ``_poll_loop``)."""
        ray = _ray()
        polls = []
        for h in self.replicas:
            if h.healthy:
                if h.ops:  # closes from finalizers etc. that no call has carried yet
                    try:
                        self.submit(h, "call", None)
                    except ReplicaDiedError:
                        pass
                try:
                    polls.append((h, h.epoch, h.actor.state.remote()))
                except Exception as e:  # noqa: BLE001 - Ray no longer knows the actor
                    self.mark_dead(h, f"{type(e).__name__}: {e}", h.epoch)
            elif h.index not in probes:
                try:
                    probes[h.index] = h.actor.rejoin.remote(h.lost_epoch)
                except Exception as e:  # noqa: BLE001 - gone for good (its restarts used up): stays dead
                    h.error = f"{type(e).__name__}: {e}"
        for h, epoch, ref in polls:
            if self._stop.is_set():
                return
            try:
                st = ray.get(ref, timeout=10)
            except Exception as e:  # noqa: BLE001 - dead, restarting, or not answering
                if not self._stop.is_set():
                    self.mark_dead(h, f"{type(_cause(e)).__name__}: {_cause(e)}", epoch)
                continue
            if st["epoch"] != epoch:  # restarted between two polls
                self.mark_dead(h, "restarted", epoch)
                continue
            h.stats = st["stats"]
            with self.router.lock:
                if "snapshot" in st:
                    self.index.replace(h.index, st["snapshot"])
                else:
                    for stored, bh in st["events"]:
                        (self.index.add if stored else self.index.remove)(h.index, (bh,))
        if probes:
            ready, _ = ray.wait(list(probes.values()), num_returns=len(probes), timeout=0)
            ready_set = set(ready)
            for h in self.replicas:
                ref = probes.get(h.index)
                if ref is None or ref not in ready_set:
                    continue
                del probes[h.index]
                try:
                    info = ray.get(ref)
                except Exception as e:  # noqa: BLE001 - still dead: probe again next time
                    h.error = f"{type(_cause(e)).__name__}: {_cause(e)}"
                    continue
                with self.router.lock:
                    self.index.clear(h.index)
                self._adopt(h, info)
                h.restarts += 1
                logger.warning("%s is back", h.name)

    def reset_caches(self) -> None:
        """Empty every live replica's prefix cache and the index (benchmarks)."""
        ray = _ray()
        ray.get([h.actor.reset_cache.remote() for h in self.replicas if h.healthy])
        with self.router.lock:
            for h in self.replicas:
                self.index.clear(h.index)

    def refresh(self, timeout: float = 10) -> None:
        """Fetch every live replica's stats now (benchmarks, tests)."""
        ray = _ray()
        for h in self.replicas:
            if h.healthy:
                try:
                    h.stats = ray.get(h.actor.state.remote(), timeout=timeout)["stats"]
                except Exception:  # noqa: BLE001 - stats are best-effort
                    pass

    # ---- stats -------------------------------------------------------------------------------------------
    def replica_stats(self) -> list[dict[str, Any]]:
        return [{"replica": h.index, "node": h.node, "node_id": h.node_id, "pid": h.pid, "cores": h.cores,
                 "healthy": h.healthy, "error": h.error,
                 "load": h.load, "in_flight": h.in_flight, "runs": h.runs, "routed": h.routed,
                 "restarts": h.restarts, "deaths": h.deaths, "index_blocks": self.index.size(h.index),
                 "num_running": h.stats.get("num_running", 0), "num_waiting": h.stats.get("num_waiting", 0),
                 "kv_blocks_used": h.stats.get("kv_blocks_used", 0)} for h in self.replicas]

    def stats(self) -> dict[str, Any]:
        """Counters summed over replicas (last polled values), plus ``replicas``: one dict per replica."""
        total: dict[str, Any] = {}
        for h in self.replicas:
            for k, v in h.stats.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    if k == "block_size":
                        total[k] = v
                    else:
                        total[k] = total.get(k, 0) + v
        total["replicas"] = self.replica_stats()
        total["routing"] = {"policy": self.router.routing, **self.router.counters}
        return total

    # ---- shutdown ----------------------------------------------------------------------------------
    def _kill_all(self) -> None:
        ray = _ray()
        for h in self.replicas:
            try:
                ray.kill(h.actor, no_restart=True)
            except Exception:  # noqa: BLE001 - best-effort cleanup
                pass

    def shutdown(self) -> None:
        self._stop.set()
        self._kill_all()
        if self._owns_ray:
            try:
                _ray().shutdown()
            except Exception:  # noqa: BLE001 - best-effort cleanup
                pass


class RouterClient:
    """An ``EngineClient`` over a ``ReplicaSet``. Unbound (the server, a shared ``fr.Model``): each new
    sequence or plain request is routed on its own; forks and requests on a sequence stay on its replica.
    ``RunClient`` (``bind()``) keeps everything of one run on one replica."""

    def __init__(self, rs: ReplicaSet, owns: bool = False) -> None:
        self._rs = rs
        self._owns = owns
        self._inflight: dict[str, tuple[ReplicaHandle, str]] = {}
        self.history: deque[int] = deque(maxlen=4096)  # the replica of each request (tests, debugging)

    @property
    def replica_set(self) -> ReplicaSet:
        return self._rs

    @property
    def tokenizer(self) -> Any:
        return self._rs.tokenizer

    @property
    def max_model_len(self) -> int:
        return self._rs.max_model_len

    @property
    def model_path(self) -> str:
        return self._rs.info.get("model_path", "")

    def stats(self) -> dict[str, Any]:
        return self._rs.stats()

    def shutdown(self) -> None:
        if self._owns:
            self._rs.shutdown()

    def bind(self) -> "RunClient":
        return RunClient(self._rs)

    # ---- placement ---------------------------------------------------------------------------------
    def _choose(self, token_ids: Sequence[int] | None) -> ReplicaHandle:
        replica, plan = self._rs.router.place(token_ids)
        if plan is not None and token_ids:
            self._rs.queue_pull(replica, plan, token_ids)
        return replica

    # ---- KV in and out (flowrt.checkpoint.kv: saved with checkpoints, loaded by a resume) ----------------
    # Content-routed, not by the run bound: the runtime's one KVCheckpoint is bound to the latest run's client.
    def kv_fingerprint(self) -> str:
        return str(self._rs.info.get("fingerprint", ""))

    def kv_block_bytes(self) -> int:
        return int(self._rs.info.get("block_bytes", 0))

    def kv_export(self, token_ids: Sequence[int], skip: Any = None) -> list[tuple[bytes, bytes | None]]:
        """The blocks of ``token_ids`` from the live replica whose cache holds most of them (blocking).

        The index is a step behind the replicas (the poller hears of a stored block a poll later), and a
        checkpoint exports a thread's blocks right after its generation: the replica the index names may hold
        only their shared beginning. Until one answers with every full block, the next replica is asked; the
        longest answer wins."""
        ids = [int(t) for t in token_ids]
        hashes = chain_hashes(ids, self._rs.block_size)
        skipped = [h for h in hashes if skip is not None and skip(h)]
        best = []   # the leading blocks the caller has already: still referred to when no replica answers
        for h in hashes:
            if h not in skipped:
                break
            best.append((h, None))
        for holder in self._rs.holders_of(hashes):
            if len(best) >= len(hashes):
                break
            try:
                got = _ray().get(holder.actor.export_kv.remote(ids, skipped, self.kv_fingerprint()), timeout=60)
            except Exception as e:  # noqa: BLE001 - saving KV is an optimisation: the run goes on
                logger.warning("%s: KV export failed (%s); asking the next replica", holder.name,
                               type(_cause(e)).__name__)
                continue
            if len(got) > len(best):
                best = got
        return best

    def kv_import(self, blocks: Iterable[tuple[bytes, bytes]]) -> int:
        """Load saved blocks into the replica the router places their prefix on (a ``RunClient`` binds to it, so
        the run finds them there)."""
        blocks = list(blocks)
        if not blocks:
            return 0
        replica, _ = self._rs.router.place_hashes([h for h, _ in blocks])
        self._bind_to(replica)
        try:
            return int(_ray().get(replica.actor.import_kv.remote(blocks, self.kv_fingerprint()), timeout=60))
        except Exception as e:  # noqa: BLE001 - the prefill computes what did not load
            logger.warning("%s: KV import failed (%s); computing the blocks", replica.name, type(_cause(e)).__name__)
            return 0

    def _bind_to(self, replica: ReplicaHandle) -> None:
        """Unbound clients route each sequence on its own: nothing to bind."""

    def open(self, token_ids: Iterable[int] = (), program: Any = None) -> RemoteSequence:
        ids = [int(t) for t in token_ids]
        return RemoteSequence(self._rs, self._choose(ids), ids, program)

    def _prompt_ids(self, prompt: Any) -> list[int] | None:
        if isinstance(prompt, str):
            return self.tokenizer(prompt)["input_ids"]
        if isinstance(prompt, dict):
            if prompt.get("prompt_token_ids") is not None:
                return [int(t) for t in prompt["prompt_token_ids"]]
            if isinstance(prompt.get("prompt"), str):
                return self.tokenizer(prompt["prompt"])["input_ids"]
            return None
        try:
            return [int(t) for t in prompt]
        except TypeError:
            return None

    def _request(self, prompt: Any, params: Any, rid: str, kind: str,
                 program: Any) -> tuple[ReplicaHandle, dict[str, Any], RemoteSequence | None]:
        replica, req, seq = self._route_request(prompt, params, rid, kind, program)
        self.history.append(replica.index)
        return replica, req, seq

    def _route_request(self, prompt: Any, params: Any, rid: str, kind: str,
                       program: Any) -> tuple[ReplicaHandle, dict[str, Any], RemoteSequence | None]:
        if isinstance(prompt, RemoteSequence):
            seq = prompt
            if seq._rs is not self._rs:
                raise ValueError("the sequence was opened on another engine (sequences cannot move between engines)")
            seq._check("generate on")
            if seq._stale_ref is not None:
                seq._sync_tokens()
            if not seq.alive:  # its replica died (or restarted): restore it from its token ids
                seq._place(self._choose(seq._tokens))
            return seq.replica, {"kind": kind, "sid": seq.sid, "params": params, "rid": rid, "program": program}, seq
        if hasattr(prompt, "tolist") and not isinstance(prompt, (list, tuple)):
            prompt = [int(t) for t in prompt.tolist()]
        replica = self._choose(self._prompt_ids(prompt))
        return replica, {"kind": kind, "prompt": prompt, "params": params, "rid": rid, "program": program}, None

    # ---- requests ----------------------------------------------------------------------------------------
    async def generate(self, prompt: Any, params: Any = None, request_id: str | None = None,
                       program: Any = None) -> Any:
        rid = request_id or f"rep-{uuid.uuid4().hex}"
        replica, req, seq = self._request(prompt, params, rid, "generate", program)
        ref, epoch = self._rs.submit(replica, "call", req)
        self._inflight[rid] = (replica, epoch)
        self._started(replica)
        if seq is not None:
            seq._busy = True
        try:
            out = await ref
        except asyncio.CancelledError:
            self._abort_on(replica, rid)
            raise
        except Exception as e:  # noqa: BLE001 - re-raised (ReplicaDiedError or cause)
            if _is_actor_death(e):
                self._rs.mark_dead(replica, f"{type(_cause(e)).__name__}", epoch)
                raise ReplicaDiedError(f"{replica.name} died while running request {rid} "
                                       f"({type(_cause(e)).__name__}); runs on other replicas are unaffected") from None
            raise _cause(e) from None
        finally:
            self._ended(replica)
            self._inflight.pop(rid, None)
            if seq is not None:
                seq._busy = False
        if seq is not None and out is not None and out.outputs:
            seq._tokens.extend(out.outputs[0].token_ids)
        return out

    def stream(self, prompt: Any, params: Any = None, request_id: str | None = None,
               program: Any = None) -> AsyncIterator[Any]:
        """Queues the request now (a bad request raises here, as with ``AsyncLLM``: this waits for the
        replica's answer), then long-polls its snapshots."""
        ray = _ray()
        rid = request_id or f"rep-{uuid.uuid4().hex}"
        replica, req, seq = self._request(prompt, params, rid, "stream", program)
        ref, epoch = self._rs.submit(replica, "call", req)
        try:
            ray.get(ref)
        except Exception as e:  # noqa: BLE001 - re-raised (ReplicaDiedError or cause)
            if _is_actor_death(e):
                self._rs.mark_dead(replica, type(_cause(e)).__name__, epoch)
                raise ReplicaDiedError(f"{replica.name} died while queueing request {rid}") from None
            raise _cause(e) from None
        return self._poll(replica, epoch, rid, seq)

    async def _poll(self, replica: ReplicaHandle, epoch: str, rid: str,
                    seq: RemoteSequence | None) -> AsyncIterator[Any]:
        self._inflight[rid] = (replica, epoch)
        self._started(replica)
        base = list(seq._tokens) if seq is not None else None
        if seq is not None:
            seq._busy = True
        finished = False
        try:
            while not finished:
                try:
                    items = await replica.actor.poll.remote(rid)
                except Exception as e:  # noqa: BLE001 - re-raised (ReplicaDiedError or cause)
                    if _is_actor_death(e):
                        self._rs.mark_dead(replica, type(_cause(e)).__name__, epoch)
                        raise ReplicaDiedError(f"{replica.name} died while streaming request {rid}; runs on "
                                               f"other replicas are unaffected") from None
                    raise _cause(e) from None
                for out in items:
                    if seq is not None and out.outputs:
                        seq._tokens = base + list(out.outputs[0].token_ids)
                    finished = bool(out.finished)
                    yield out
        finally:
            self._ended(replica)
            self._inflight.pop(rid, None)
            if seq is not None:
                seq._busy = False
            if not finished:
                self._abort_on(replica, rid)
                if seq is not None and seq.alive:  # tokens generated past what we saw stay in the sequence
                    try:
                        seq._stale_ref = replica.actor.seq_tokens.remote(seq.sid)
                    except Exception:  # noqa: BLE001 - best-effort prefetch
                        pass

    def _started(self, replica: ReplicaHandle) -> None:
        replica.in_flight += 1

    def _ended(self, replica: ReplicaHandle) -> None:
        replica.in_flight -= 1

    def _abort_on(self, replica: ReplicaHandle, rid: str) -> None:
        try:
            replica.actor.abort.remote(rid)
        except Exception:  # noqa: BLE001 - best-effort abort
            pass

    def abort(self, request_id: str) -> bool:
        entry = self._inflight.get(request_id)
        if entry is None:
            return False
        self._abort_on(entry[0], request_id)
        return True


class RunClient(RouterClient):
    """Everything of one workflow run on one replica: bound when the run opens its first sequence (or sends
    its first request), by the router; rebound only when that replica is down (a retried step then reruns on
    a live replica, its threads restored from their token ids). ``release()`` when the run is over."""

    def __init__(self, rs: ReplicaSet) -> None:
        super().__init__(rs, owns=False)
        self.replica: ReplicaHandle | None = None
        self._busy_on: dict[int, int] = {}  # replica index -> this run's requests in flight there
        self._slot: list[ReplicaHandle | None] = [None]
        self._finalizer = weakref.finalize(self, RunClient._unbind, rs, self._slot)

    @staticmethod
    def _unbind(rs: ReplicaSet, slot: list) -> None:
        h = slot[0]
        if h is not None:
            h.runs -= 1
            slot[0] = None

    def _choose(self, token_ids: Sequence[int] | None) -> ReplicaHandle:
        r = self.replica
        if r is not None and r.healthy:
            return r
        new = super()._choose(token_ids)
        self._bind_to(new)
        return new

    def _bind_to(self, replica: ReplicaHandle) -> None:
        if self.replica is replica:
            return
        self._unbind(self._rs, self._slot)
        self.replica = replica
        self._slot[0] = replica
        replica.runs += 1

    def bind(self) -> "RunClient":
        return self

    def _started(self, replica: ReplicaHandle) -> None:
        replica.in_flight += 1
        n = self._busy_on.get(replica.index, 0)
        if n == 0:
            replica.runs_busy += 1
        self._busy_on[replica.index] = n + 1

    def _ended(self, replica: ReplicaHandle) -> None:
        replica.in_flight -= 1
        n = self._busy_on.get(replica.index, 1) - 1
        self._busy_on[replica.index] = n
        if n == 0:
            replica.runs_busy -= 1

    def release(self) -> None:
        self._finalizer()
