"""SIGTERM ends ``flowrt run`` / ``flowrt resume`` as Ctrl-C does: the run is cancelled, so it saves a
checkpoint (with ``--checkpoint-kv``, the KV of the threads it holds) before the process exits, where the
default action would end the process at once and lose what the running steps computed."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from typing import Iterator

import anyio


@contextlib.contextmanager
def cancel_on_sigterm(scope: anyio.CancelScope) -> Iterator[None]:
    """Cancel ``scope`` on SIGTERM while the block runs (in the event loop: the handler itself runs no
    flowrt code, so it cannot interrupt the engine holding a lock)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, scope.cancel)
    try:
        yield
    finally:
        loop.remove_signal_handler(signal.SIGTERM)
