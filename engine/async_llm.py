"""The async engine: a background thread runs the step loop; asyncio callers submit, stream and abort.

Results cross from the engine thread to each caller's event loop with `call_soon_threadsafe`, so many
event loops (or threads) can share one engine. A request whose caller goes away (cancelled, or a stream
closed early) is aborted and its blocks released.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import weakref
from dataclasses import replace
from typing import Any, AsyncIterator

from .beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams
from .config import EngineArgs
from .cpu.threads import release_openmp_team
from .llm_engine import LLMEngine
from .request.outputs import RequestOutput
from .request.program import ProgramContext
from .core.sampling_params import SamplingParams
from .request.sequence import Request, Sequence, SeqStatus

logger = logging.getLogger("flowrt.engine")


class EngineSequence:
    """A token sequence whose KV cache outlives one call (see engine/API.md)."""

    def __init__(self, engine: LLMEngine, seq: Sequence):
        self._engine = engine
        self._seq = seq
        self._finalizer = weakref.finalize(self, engine.close_later, seq)

    @property
    def token_ids(self) -> list[int]:
        return list(self._seq.token_ids)

    @property
    def num_computed_tokens(self) -> int:
        return self._seq.kv.num_computed_tokens

    @property
    def closed(self) -> bool:
        return self._seq.sched.status is SeqStatus.CLOSED

    def __len__(self) -> int:
        return self._seq.num_tokens

    def append(self, token_ids) -> None:
        self._engine.append(self._seq, token_ids)

    def fork(self, n: int = 1) -> list["EngineSequence"]:
        return [EngineSequence(self._engine, c) for c in self._engine.fork(self._seq, n)]

    def close(self) -> None:
        self._finalizer.detach()
        self._engine.close(self._seq)

    @property
    def program(self):
        """The ProgramContext (run, step, thread, state) the engine has for this sequence, or None."""
        return self._seq.sched.program

    def set_state(self, state: str, **context) -> None:
        """A scheduling hint: "generating", "waiting" (idle, used again soon: on a tool, a sibling, a
        gather) or "finished" (its step is done); keywords (run_id, step, thread_id) update the context."""
        ctx = (self._seq.sched.program or ProgramContext())
        if context:
            ctx = replace(ctx, **context)
        self._engine.set_program(self._seq, ctx, state)

    def __repr__(self) -> str:
        seq = self._seq
        return f"EngineSequence(id={seq.seq_id}, tokens={seq.num_tokens}, status={seq.sched.status.value})"


class AsyncLLM:
    def __init__(self, model: str | None = None, **kwargs: Any):
        args = EngineArgs(model=model, **kwargs)  # bad arguments raise here, in the caller's thread
        self._wakeup = threading.Event()
        self._stopping = False
        # The engine is built on the thread that runs its steps, so that one thread starts every OpenMP parallel
        # region of the kernels and of torch (one libgomp serves both). Each thread that starts regions gets a team
        # of its own, and once the process has more OpenMP threads than cores, libgomp's workers stop spinning
        # between regions (100 spins, then a futex sleep and wake-up each time): built on the caller's thread and
        # stepped on this one, SmolLM2-135M Q8_0 decoded 1.7x slower (2 cores, Xeon, bf16: 108 vs 184 tok/s).
        built: list[LLMEngine | Exception] = []
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(args, built, ready), name="flowrt-engine",
                                        daemon=True)
        self._thread.start()
        ready.wait()
        engine = built[0] if built else RuntimeError("the engine thread stopped while building the engine")
        if not isinstance(engine, LLMEngine):
            self._thread.join()
            raise engine
        self.engine: LLMEngine = engine
        release_openmp_team()  # a team this caller's thread holds (a torch op before) would slow every step

    # ---- properties ------------------------------------------------------------------------------
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def model_path(self) -> str:
        return self.engine.model_path

    @property
    def model_config(self):
        return self.engine.model_config

    def stats(self) -> dict:
        return self.engine.stats()

    def run_stats(self, run_id: str | None = None) -> dict | None:
        return self.engine.run_stats(run_id)

    # ---- KV blocks in and out (protocol.KVTransfer; engine/kv/transfer.py) -------------------------
    def kv_fingerprint(self) -> str:
        return self.engine.kv_fingerprint()

    def kv_block_bytes(self) -> int:
        return self.engine.kv_block_bytes()

    def kv_export(self, token_ids, skip=None) -> list[tuple[bytes, bytes | None]]:
        try:
            return self.engine.kv_export(token_ids, skip)
        finally:
            self._release_callers_team()

    def kv_import(self, blocks) -> int:
        try:
            return self.engine.kv_import(blocks)
        finally:
            self._release_callers_team()

    def _release_callers_team(self) -> None:
        """After torch work on the caller's thread (the KV copies of a checkpoint's worker thread): its OpenMP team
        would slow the engine's steps (engine/cpu/threads.py release_openmp_team)."""
        if threading.current_thread() is not self._thread:
            release_openmp_team()

    # ---- the loop ----------------------------------------------------------------------------------
    def _run(self, args: EngineArgs, built: list[LLMEngine | Exception], ready: threading.Event) -> None:
        try:
            built.append(LLMEngine(args))
        except Exception as exc:  # noqa: BLE001 - any failure is raised again in the constructor's thread
            built.append(exc)
        finally:
            ready.set()
        if built and isinstance(built[0], LLMEngine):
            self._loop(built[0])

    def _loop(self, eng: LLMEngine) -> None:
        while not self._stopping:
            self._wakeup.clear()
            if not eng.has_unfinished():
                self._wakeup.wait(timeout=0.5)
                continue
            try:
                eng.step()
            except Exception as exc:  # a broken step must not hang every caller
                logger.exception("engine step failed; failing the requests in flight")
                self._fail_all(exc)

    def _fail_all(self, exc: BaseException) -> None:
        self.engine.fail_all(exc)

    def shutdown(self) -> None:
        self._stopping = True
        self._wakeup.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=10)
        self._fail_all(RuntimeError("the engine was shut down"))

    def __enter__(self) -> "AsyncLLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    async def __aenter__(self) -> "AsyncLLM":
        return self

    async def __aexit__(self, *exc) -> None:
        self.shutdown()

    # ---- requests ----------------------------------------------------------------------------------
    async def generate(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
                       program: ProgramContext | dict | str | None = None) -> RequestOutput:
        """Runs one request to completion and returns its final output. `program`: the workflow run, step
        and thread the request belongs to (a ProgramContext, a dict of its fields, or a run id)."""
        return await _final(self._submit(prompt, params, request_id, stream=False, program=program))

    def stream(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
               program: ProgramContext | dict | str | None = None) -> AsyncIterator[RequestOutput]:
        """Yields cumulative snapshots after every step that changed the request; the last has finished=True.

        The request is validated and queued when stream() is called (a bad request raises here, before
        any iteration), so a server can answer 400 before it starts a response. Call it from a coroutine.
        """
        return self._submit(prompt, params, request_id, stream=True, program=program)

    def abort(self, request_id: str) -> bool:
        return self.engine.abort(request_id)

    async def beam_search(self, prompt, params: BeamSearchParams, keep: bool = False) -> BeamSearchOutput:
        """Beam search (engine/beam_search.py) for one prompt: the beams, best first. `prompt` may be an
        EngineSequence: the beams continue it (forks of it; it is left as it was, its pending tokens computed).
        `keep`: each beam's open sequence is returned in `.sequence` (the caller closes it)."""
        eng = self.engine
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        check = SamplingParams(max_tokens=params.max_tokens, structured_outputs=params.structured_outputs)
        if isinstance(prompt, EngineSequence):
            if prompt._engine is not eng:
                raise ValueError("the sequence was opened on another engine (sequences cannot move between engines)")
            eng.open_seqs.check_can_generate(prompt._seq, check)
            if prompt.num_computed_tokens < len(prompt) - 1:  # compute the shared prefix once, then fork
                await self.generate(prompt, SamplingParams(max_tokens=0))
            root = eng.fork(prompt._seq, 1)[0]
        else:
            root = eng.open(eng.validate(prompt, check)[1])
        search = BeamSearch(eng, root, params, keep=keep)
        try:
            while not search.done:
                outs = await asyncio.gather(*(self._beam_round(seq, search.step_params, m)
                                              for seq, m in search.pending()))
                search.advance(list(outs))
            return search.result(wrap=lambda seq: EngineSequence(eng, seq))
        finally:
            search.close()

    async def _beam_round(self, seq: Sequence, params: SamplingParams, matcher) -> RequestOutput:
        return await _final(self._submit(seq, params, None, stream=False, matcher=matcher))

    def _submit(self, prompt, params, request_id, stream: bool, program=None,
                matcher=None) -> AsyncIterator[RequestOutput]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        eng = self.engine

        def deliver(item) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the caller's loop is closed: nobody is listening
                pass

        def on_output(req: Request) -> None:
            if stream or req.finished:
                deliver(eng.make_output(req))

        if self._stopping:
            raise RuntimeError("the engine is shut down")
        if isinstance(prompt, EngineSequence):
            if prompt._engine is not eng:
                raise ValueError("the sequence was opened on another engine (sequences cannot move between engines)")
            prompt = prompt._seq
        req = eng.add_request(prompt, params, request_id, on_output=on_output, on_error=deliver, stream=stream,
                              program=program, _matcher=matcher)
        self._wakeup.set()
        return self._results(req, queue)

    async def _results(self, req, queue: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            if not req.finished:
                self.engine.abort(req.request_id)

    # ---- open sequences ---------------------------------------------------------------------------
    def open(self, token_ids=(), program: ProgramContext | dict | str | None = None) -> EngineSequence:
        return EngineSequence(self.engine, self.engine.open(token_ids, program))


async def _final(outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
    """The last snapshot of a request's outputs: its final output (every request ends with one)."""
    out = None
    async for out in outputs:  # noqa: B007
        pass
    if out is None:
        raise RuntimeError("the request ended without an output")
    return out
