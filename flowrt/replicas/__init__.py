"""Scale-out: engine replicas as Ray actors, with program-affinity and prefix-aware routing.

    rt = fr.Runtime(model=PATH, replicas=2)              # or `flowrt run|serve --replicas 2`

Ray (``pip install 'flowrt[ray]'``) is imported only when replicas are used. Layout: actor.py (the replica:
an ``AsyncLLM`` in a Ray actor), client.py (``ReplicaSet``, the ``EngineClient`` proxies and the remote
``SequenceHandle``), router.py (routing policies), index.py (the approximate prefix index).
"""

from __future__ import annotations

from typing import Any

__all__ = ["ReplicaSet", "RouterClient", "RunClient", "RemoteSequence", "ReplicaDiedError", "NoReplicaError",
           "PrefixIndex", "Router", "ray_available"]


def ray_available() -> bool:
    try:
        import ray  # noqa: F401
    except ImportError:
        return False
    return True


def __getattr__(name: str) -> Any:
    if name in ("ReplicaSet", "RouterClient", "RunClient", "RemoteSequence", "ReplicaDiedError", "NoReplicaError"):
        from . import client

        return getattr(client, name)
    if name == "PrefixIndex":
        from .index import PrefixIndex

        return PrefixIndex
    if name == "Router":
        from .router import Router

        return Router
    raise AttributeError(name)
