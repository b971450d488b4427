"""Engine requests of one HTTP request, from submission to their final outputs.

A ``Submission`` hands every prompt to the engine before the response starts: ``engine.stream`` validates
and queues at once, so whatever the engine refuses (a prompt the KV pool cannot hold, a bad token) is a
400 rather than an error event inside a 200 stream. Its requests are aborted when the response ends
early (client gone) or the server stops waiting for them (shutdown), which finishes them with
``finish_reason: "abort"``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import Any, AsyncGenerator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from .errors import OpenAIError, from_exception
from .state import ServerState
from .streaming import SSEResponse, guarded, until_disconnect


@dataclass
class Job:
    """One engine request: a prompt (token ids) with its sampling params."""
    index: int            # prompt index within the HTTP request
    prompt_ids: list[int]
    prompt_text: str | None
    request_id: str


def sampling_params(kw: dict[str, Any]) -> Any:
    """flowrt.engine.SamplingParams from request fields; a bad value is a 400 naming the field."""
    from flowrt.engine import SamplingParams  # the engine is imported only when a request needs it

    try:
        return SamplingParams(**kw)
    except Exception as e:  # noqa: BLE001 - ValidationError / ValueError name the field
        raise from_exception(e) from None


def _program(user: str | None) -> Any:
    """The OpenAI `user` field names the program a request belongs to: the engine's program-aware policy
    then schedules and keeps KV per user (least service first) as it does per workflow run."""
    if not user:
        return None
    from flowrt.engine import ProgramContext

    return ProgramContext(run_id=f"user:{user}")


class Submission:
    """The engine requests of one HTTP request (see above); `t0` is when the request arrived (for TTFT)."""

    def __init__(self, st: ServerState, jobs: list[Job], params: Any, t0: float, user: str | None = None) -> None:
        self.st = st
        self.jobs = jobs
        self.t0 = t0
        self._streams: list[AsyncGenerator[Any, None]] = []
        try:
            for job in jobs:
                self._streams.append(st.engine.stream(job.prompt_ids, params, request_id=job.request_id,
                                                      program=_program(user)))
        except ValueError as e:  # the engine refused the request (pydantic ValidationError is a ValueError)
            self.abort()
            raise from_exception(e, param="prompt") from None
        except RuntimeError as e:  # the engine is shut down
            self.abort()
            raise OpenAIError(f"The engine is not accepting requests: {e}", 503) from None
        st.stoppers.add(self.abort)

    def abort(self) -> None:
        """Ends every request that has not finished (a no-op for finished ones)."""
        for job in self.jobs[:len(self._streams)]:
            with contextlib.suppress(Exception):
                self.st.engine.abort(job.request_id)

    def close(self) -> None:
        self.abort()
        self.st.stoppers.discard(self.abort)

    async def outputs(self) -> AsyncGenerator[tuple[Job, Any], None]:
        """Snapshots of all requests, interleaved as they arrive."""
        if len(self.jobs) == 1:
            async with contextlib.aclosing(self._measured(0)) as it:
                async for out in it:
                    yield self.jobs[0], out
            return
        queue: asyncio.Queue = asyncio.Queue()
        end = object()

        async def pump(i: int) -> None:
            try:
                async with contextlib.aclosing(self._measured(i)) as it:
                    async for out in it:
                        queue.put_nowait((self.jobs[i], out))
            except asyncio.CancelledError:
                raise
            except BaseException as e:  # noqa: BLE001 - surfaced to the consumer
                queue.put_nowait((self.jobs[i], e))
            finally:
                queue.put_nowait((self.jobs[i], end))

        tasks = [asyncio.create_task(pump(i)) for i in range(len(self.jobs))]
        try:
            remaining = len(tasks)
            while remaining:
                job, item = await queue.get()
                if item is end:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield job, item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def finals(self) -> dict[int, Any]:
        """The final output of each request, by prompt index."""
        final: dict[int, Any] = {}
        async with contextlib.aclosing(self.outputs()) as it:
            async for job, out in it:
                if out.finished:
                    final[job.index] = out
        return final

    async def _measured(self, i: int) -> AsyncGenerator[Any, None]:
        """One request's snapshots, recording TTFT, inter-token latency and token counts."""
        job, m, t0 = self.jobs[i], self.st.metrics, self.t0
        prev_counts: list[int] = []
        t_prev: float | None = None
        async for out in self._streams[i]:
            counts = [len(o.token_ids) for o in out.outputs]
            new = max((c - (prev_counts[k] if k < len(prev_counts) else 0) for k, c in enumerate(counts)), default=0)
            if new > 0:
                t = time.perf_counter()
                if t_prev is None:
                    m.ttft.observe(t - t0)
                    for _ in range(new - 1):
                        m.itl.observe(0.0)
                else:
                    for _ in range(new):
                        m.itl.observe((t - t_prev) / new)
                t_prev = t
                prev_counts = counts
            if out.finished:
                m.e2e.observe(time.perf_counter() - t0)
                m.prompt_tokens.inc(len(out.prompt_token_ids or job.prompt_ids))
                m.generation_tokens.inc(sum(counts))
                m.cached_tokens.inc(out.num_cached_tokens or 0)
                for o in out.outputs:
                    m.finished.labels(reason=str(o.finish_reason)).inc()
            yield out
            if out.finished:
                return


async def answer(st: ServerState, request: Request, sub: Submission, events: AsyncGenerator[str, None] | None,
                 what: str, build: Any) -> Response:
    """The HTTP answer to a submission: `events` as Server-Sent Events when streaming, otherwise `build(finals)`
    as JSON once every request finished (499 when the client left first). The submission is closed either way."""
    if events is not None:
        return SSEResponse(guarded(st, request, events, what), on_close=sub.close)
    try:
        done, finals = await until_disconnect(st, request, sub.finals())
    finally:
        sub.close()
    if not done:
        return Response(status_code=499)
    return JSONResponse(build(finals))
