"""Running untrusted-speed Python work off the event loop under a time cap that really stops it.

``asyncio.wait_for(asyncio.to_thread(fn), t)`` only stops *waiting*: the thread keeps burning CPU (and
the GIL) until ``fn`` returns, so every slow request would leave a runaway behind. Here ``fn`` runs in its
own thread, and at the deadline (or when the awaiting request is cancelled) an exception is raised inside
that thread (CPython's ``PyThreadState_SetAsyncExc``), which stops pure-Python work such as rendering a
Jinja template at its next bytecode.
"""

from __future__ import annotations

import asyncio
import ctypes
import threading
from typing import Callable, TypeVar

T = TypeVar("T")


class Interrupted(BaseException):
    """Raised inside the worker thread when its time is up (BaseException: `except Exception` in the
    interrupted code does not swallow it)."""


def _interrupt(thread: threading.Thread) -> None:
    if thread.ident is not None and thread.is_alive():
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(Interrupted))


async def run_with_deadline(fn: Callable[[], T], timeout: float, name: str) -> T:
    """``fn()`` in a new thread; raises TimeoutError (and stops the thread) after `timeout` seconds."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future = loop.create_future()

    def settle(result: object, error: BaseException | None) -> None:
        if not future.done():
            future.set_exception(error) if error is not None else future.set_result(result)

    def target() -> None:
        try:
            try:
                outcome: tuple[object, BaseException | None] = (fn(), None)
            except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
                outcome = (None, e)
            loop.call_soon_threadsafe(settle, *outcome)
        except (Interrupted, RuntimeError):  # interrupted as fn returned, or the loop is gone: nobody waits
            pass

    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    try:
        return await asyncio.wait_for(asyncio.shield(future), timeout)
    finally:
        if not future.done():
            future.cancel()  # whatever the thread still reports is dropped
            _interrupt(thread)
