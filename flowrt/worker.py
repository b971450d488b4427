"""Sync steps in daemon threads, so a step that overruns its timeout cannot keep the process alive.

Python cannot stop a thread. ``anyio.to_thread`` workers are non-daemon threads that the interpreter
joins at exit, so one hung sync step would hang ``flowrt run`` forever after its timeout. Here each call
gets a daemon thread: when the caller is cancelled (a step timeout, a cancelled run) the thread is
abandoned: it runs on in the background, its result or exception is dropped, and it dies with the
process instead of holding it open.
"""

from __future__ import annotations

import contextvars
import threading
from typing import Any, Callable, TypeVar

import anyio
import anyio.from_thread
import anyio.lowlevel
import anyio.to_thread

__all__ = ["run_sync_abandonable"]

T = TypeVar("T")


async def run_sync_abandonable(fn: Callable[[], T], name: str = "flowrt sync step") -> T:
    """``fn()`` in a daemon thread (context variables copied, at most anyio's default thread limit at
    once); cancelling the caller abandons the thread (see the module docstring)."""
    token = anyio.lowlevel.current_token()
    ctx = contextvars.copy_context()
    done = anyio.Event()
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = ctx.run(fn)
        except BaseException as e:  # noqa: BLE001 - handed to the caller, who re-raises it
            box["error"] = e
        try:
            anyio.from_thread.run_sync(done.set, token=token)
        except Exception:  # noqa: BLE001 - abandoned and the event loop is gone: nobody waits for the result
            pass

    async with anyio.to_thread.current_default_thread_limiter():
        threading.Thread(target=target, name=name, daemon=True).start()
        await done.wait()
    if "error" in box:
        raise box.pop("error")
    return box["value"]
