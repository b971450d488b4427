"""Concurrency helpers for workflow code (anyio based, so they work wherever flowrt runs)."""

from __future__ import annotations

import inspect
import sys
from typing import Any, Awaitable, Iterable

import anyio

if sys.version_info >= (3, 11):
    _BaseExceptionGroup = BaseExceptionGroup  # noqa: F821
    _ExceptionGroup = ExceptionGroup  # noqa: F821
else:  # pragma: no cover - anyio depends on the backport on 3.10
    from exceptiongroup import BaseExceptionGroup as _BaseExceptionGroup
    from exceptiongroup import ExceptionGroup as _ExceptionGroup

__all__ = ["gather"]


def _leaves(eg: BaseException) -> list[BaseException]:
    if isinstance(eg, _BaseExceptionGroup):
        out: list[BaseException] = []
        for e in eg.exceptions:
            out.extend(_leaves(e))
        return out
    return [eg]


async def gather(*awaitables: Awaitable[Any] | Iterable[Awaitable[Any]], return_exceptions: bool = False) -> list[Any]:
    """Run awaitables concurrently (in an anyio task group) and return their results in order.

    ``await fr.gather(a.gen(), b.gen())`` or ``await fr.gather(*(t.gen() for t in ts))``; a single
    iterable of awaitables is accepted too. If one raises, the others are cancelled (their engine
    requests aborted) and that exception propagates as itself, not wrapped in an exception group, unless
    several failed at once. With ``return_exceptions=True`` exceptions are returned in place of results.
    """
    if len(awaitables) == 1 and not inspect.isawaitable(awaitables[0]) and hasattr(awaitables[0], "__iter__"):
        aws: list[Any] = list(awaitables[0])
    else:
        aws = list(awaitables)
    for i, aw in enumerate(aws):
        if not inspect.isawaitable(aw):
            for other in aws:  # do not leave "coroutine was never awaited" warnings behind
                if inspect.iscoroutine(other):
                    other.close()
            raise TypeError(f"gather() argument {i} is not awaitable: {aw!r} (did you forget to call it?)")
    results: list[Any] = [None] * len(aws)
    if not aws:
        return results

    async def run(i: int, aw: Awaitable[Any]) -> None:
        try:
            results[i] = await aw
        except Exception as e:
            if not return_exceptions:
                raise
            results[i] = e

    try:
        async with anyio.create_task_group() as tg:
            for i, aw in enumerate(aws):
                tg.start_soon(run, i, aw)
    except _BaseExceptionGroup as eg:
        cancelled = anyio.get_cancelled_exc_class()
        real = [e for e in _leaves(eg) if not isinstance(e, cancelled)]
        if len(real) == 1:
            raise real[0] from None
        if real and all(isinstance(e, Exception) for e in real):  # a group whose message says what failed
            parts = [f"{type(e).__name__}: {e}" for e in real]
            shown = "; ".join(dict.fromkeys(parts))  # the same error from several awaitables: once
            raise _ExceptionGroup(f"{len(real)} of {len(aws)} awaitables failed: {shown}", real) from None
        raise
    return results
