"""The router: which replica a new run or a plain request goes to.

* ``routing="prefix"`` (default): the replica holding the longest cached prefix of the prompt's first
  blocks (``PrefixIndex``), ties broken by load; unless that replica's load exceeds the least loaded
  replica's by both ``load_abs`` (requests) and ``load_rel`` (ratio), or nothing matches: then power of two
  choices (the less loaded of two random live replicas).
* ``routing="round_robin"``: live replicas in turn.

A run stays where it was first routed (affinity: its threads share KV) while that replica is healthy; the
client (client.py) does that binding, the router only picks. When the load fallback sends a run away from the
replica holding its prefix, the router also plans a pull of that prefix's blocks from the holder (pull.py) where
the cost estimate says copying beats computing. Load: see ``ReplicaHandle.load``. A prompt that
matches nothing goes to the least loaded replica (ties: the one whose index holds fewest blocks, which
spreads distinct prefixes over the replicas).
"""

from __future__ import annotations

import random
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Sequence

from .index import PrefixIndex
from .pull import PullCost, PullPlan

ROUTING_POLICIES = ("prefix", "round_robin")
PULL_WAIT_FACTOR = 4.0
MAX_PULL_WAIT_S = 2.0


class NoReplicaError(RuntimeError):
    """No replica is healthy (every node gone, or every replica dead): nothing can run the request."""


@dataclass(eq=False)
class ReplicaHandle:
    """The runtime's view of one replica (its actor, incarnation, health and load)."""

    index: int
    actor: Any
    node: str = "?"                   # host name
    node_id: str = ""                 # the Ray node it runs on (several nodes may share a host)
    fingerprint: str = ""             # its engine's kv_fingerprint (blocks move only between equal ones)
    block_bytes: int = 0
    pid: int = 0
    cores: list[int] | None = None     # the cores it is pinned to (None: not pinned)
    epoch: str | None = None          # None while dead / restarting
    lost_epoch: str | None = None     # the epoch it was marked dead in (ended when it rejoins)
    healthy: bool = False
    error: str | None = None          # why it is not healthy
    in_flight: int = 0                # requests submitted and not finished (client side)
    runs: int = 0                     # runs bound to it and not finished
    runs_busy: int = 0                # of those, runs with a request in flight
    restarts: int = 0
    deaths: int = 0
    routed: int = 0
    stats: dict[str, Any] = field(default_factory=dict)
    batch: int = 0                    # next operation-batch number of this epoch
    ops: deque = field(default_factory=deque)  # queued sequence operations (lock-free: GC finalizers add)
    lock: threading.RLock = field(default_factory=threading.RLock)

    @property
    def name(self) -> str:
        node = f"{self.node} {self.node_id[:8]}" if self.node_id else self.node
        return f"replica {self.index} (node {node}, pid {self.pid})"

    @property
    def load(self) -> int:
        """Requests in flight, plus one for each bound run that has none in flight right now (it will
        send more): a run with one thread counts 1, a run with 8 forks generating counts 8."""
        return self.in_flight + max(0, self.runs - self.runs_busy)

    def take_batch(self) -> tuple[str, int, list]:
        """(epoch, batch number, queued operations); call with ``lock`` held and submit before releasing."""
        ops = []
        q = self.ops
        while q:  # an op a finalizer adds meanwhile goes with this batch or the next: both keep the order
            try:
                ops.append(q.popleft())
            except IndexError:
                break
        b = self.batch
        self.batch += 1
        return self.epoch, b, ops  # type: ignore[return-value]


class Router:
    def __init__(self, replicas: Sequence[ReplicaHandle], index: PrefixIndex, routing: str = "prefix",
                 load_abs: int = 8, load_rel: float = 1.5, seed: int = 0, pull: PullCost | None = None) -> None:
        if routing not in ROUTING_POLICIES:
            raise ValueError(f"routing must be one of {ROUTING_POLICIES}, got {routing!r}")
        self.replicas = list(replicas)
        self.index = index
        self.routing = routing
        self.load_abs = load_abs
        self.load_rel = load_rel
        self.pull = pull if pull is not None else PullCost()
        self._rng = random.Random(seed)
        self._rr = 0
        self.lock = threading.RLock()
        self.counters = {"routed_prefix": 0, "routed_load": 0, "routed_round_robin": 0, "routed_cold": 0,
                         "pulls_planned": 0}

    def live(self) -> list[ReplicaHandle]:
        return [r for r in self.replicas if r.healthy]

    def _no_replica(self) -> NoReplicaError:
        why = "; ".join(f"{r.name}: {r.error or 'not ready'}" for r in self.replicas)
        return NoReplicaError(f"no healthy engine replica ({why})")

    def _p2c(self, live: list[ReplicaHandle]) -> ReplicaHandle:
        if len(live) == 1:
            return live[0]
        a, b = self._rng.sample(live, 2)
        return a if a.load <= b.load else b

    def pick(self, token_ids: Sequence[int] | None) -> ReplicaHandle:
        return self.place(token_ids)[0]

    def _plan_pull(self, r: ReplicaHandle, holder: ReplicaHandle, have: int, best_len: int) -> PullPlan | None:
        blocks = best_len - have
        if holder is r or not holder.fingerprint or holder.fingerprint != r.fingerprint:
            return None
        if not self.pull.worth_it(blocks, self.index.block_size, r.block_bytes):
            return None
        self.counters["pulls_planned"] += 1
        # The holder is often still computing them (a burst routed there before its prefill ended): wait for
        # them about as long as computing them here would take, an estimate kept generous (a busy core is slower).
        wait = min(MAX_PULL_WAIT_S, PULL_WAIT_FACTOR * self.pull.prefill_s(blocks * self.index.block_size))
        return PullPlan(holder.index, best_len, wait_s=wait)

    def place(self, token_ids: Sequence[int] | None) -> tuple[ReplicaHandle, PullPlan | None]:
        """The replica for a new run or request, and the pull (if any) that brings its prefix there."""
        return self.place_hashes(self.index.hashes(token_ids) if token_ids else [])

    def place_hashes(self, hashes: Sequence[bytes]) -> tuple[ReplicaHandle, PullPlan | None]:
        """``place`` for a prompt given by its blocks' prefix hashes (KV loaded from a checkpoint)."""
        plan = None
        with self.lock:
            live = self.live()
            if not live:
                raise self._no_replica()
            if self.routing == "round_robin":
                r = live[self._rr % len(live)]
                self._rr += 1
                self.counters["routed_round_robin"] += 1
            else:
                match = self.index.match(hashes, [x.index for x in live]) if hashes else {}
                best_len = max(match.values(), default=0)
                if best_len == 0:  # nothing cached anywhere: the least loaded, then the emptiest index
                    r = min(live, key=lambda x: (x.load, self.index.size(x.index)))
                    self.counters["routed_cold"] += 1
                else:
                    best = min((x for x in live if match[x.index] == best_len), key=lambda x: x.load)
                    least = min(live, key=lambda x: x.load)
                    if best.load > least.load + self.load_abs and best.load > least.load * self.load_rel:
                        r = self._p2c([x for x in live if x is not best]) if len(live) > 2 else least
                        self.counters["routed_load"] += 1
                        plan = self._plan_pull(r, best, match.get(r.index, 0), best_len)
                    else:
                        r = best
                        self.counters["routed_prefix"] += 1
                if hashes:
                    self.index.add(r.index, hashes)  # predicted: the request will store these blocks there
            r.routed += 1
            return r, plan
