"""A checkpointed run whose replica died (its node lost, its process killed) is taken over by a live replica.

The workflow's steps run in the caller's process (``rt.run``, ``flowrt serve``), which holds the run's lease;
its model calls go to the run's replica. When that replica dies mid-step, the step fails with
``ReplicaDiedError`` and the run ends failed, with its last checkpoint saved. ``Runtime.execute`` then claims
the run again (the store's atomic failed -> running transition, as ``flowrt resume`` does) and continues it from
that checkpoint on a live replica: the steps that finished are not run again, the one that died runs from its
start, its threads restored from their token ids (their KV loaded from the shared KV directory with
``--checkpoint-kv``, else recomputed). A run that cannot be taken over because no replica comes back within
``takeover_wait_s`` raises ``NoReplicaError``, naming the run, which stays failed in the store (``flowrt resume``
it later). A caller that dies itself leaves its lease to run out: another process resumes the run then.
"""

from __future__ import annotations

import time
from typing import Any

import anyio

from .router import NoReplicaError

__all__ = ["lost_to_replica", "replica_set_of", "wait_for_replica"]

# A replica died under the step, or none was up when it asked for one (all restarting, every node gone).
DEATH_ERRORS = ("ReplicaDiedError", "RayActorError", "ActorDiedError", "ActorUnavailableError", "NoReplicaError")


def lost_to_replica(result: Any) -> bool:
    """The run failed because a replica died under it: each failed step's error is (or, from ``fr.gather``,
    groups) a replica's death."""
    failed = [e for e in result.errors.values() if e.kind != "skipped"]
    return bool(failed) and all(any(f"{name}:" in e.message for name in DEATH_ERRORS) for e in failed)


def replica_set_of(llm: Any) -> Any:
    """The ``ReplicaSet`` behind a runtime's shared ``fr.Model`` (None: not on replicas)."""
    engine = getattr(llm, "engine", None)
    return getattr(engine, "replica_set", None)


async def wait_for_replica(rs: Any, run_id: str | None) -> None:
    """Until some replica is healthy (Ray restarts the dead one where there is room, or a node joins); after
    ``rs.takeover_wait_s`` a ``NoReplicaError`` naming the run."""
    deadline = time.monotonic() + rs.takeover_wait_s
    while not rs.router.live():
        if time.monotonic() >= deadline:
            why = "; ".join(f"{r.name}: {r.error or 'not ready'}" for r in rs.replicas)
            raise NoReplicaError(f"run {run_id}: its replica died and no replica came back within "
                                 f"{rs.takeover_wait_s:g}s to take it over ({why}); the run is saved as failed at "
                                 f"its last checkpoint: resume it (flowrt resume {run_id}) once a replica is up")
        await anyio.sleep(min(0.1, rs.poll_interval))
