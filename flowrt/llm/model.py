"""``fr.Model``: the handle steps receive (``llm: fr.Model``) on one shared in-process engine.

``Model`` is both the annotation that asks the executor to inject the model and the object injected::

    @wf.step
    async def answer(question: str, llm: fr.Model) -> str:
        t = llm.thread("Q: " + question + "\\nA:")
        return await t.gen(max_tokens=64, stop="\\n")

Every thread, chat and one-shot call of every step (and of every concurrent run sharing the runtime)
goes to the same ``AsyncLLM``, so the engine batches them and shares their common prefixes.
"""

from __future__ import annotations

import itertools
import os
from typing import TYPE_CHECKING, Any, AsyncGenerator, Iterable

import anyio

from ..context import current_run_threads, current_step, current_tracer
from ..render import clip

if TYPE_CHECKING:
    from ..engine import CompletionOutput, EngineClient, RequestOutput, SamplingParams, SequenceHandle
    from ..runner.trace import Tracer
    from .chat import ChatThread
    from .thread import Thread

__all__ = ["Model"]

_request_ids = itertools.count(1)
_ANCHOR = "\n"


class Model:
    """A handle on an engine (an ``EngineClient`` such as ``flowrt.engine.AsyncLLM``) for workflow code.

    ``share_kv=False`` turns the runtime's sharing off (a benchmark baseline): forks become fresh
    sequences that recompute the whole prompt.

    Threads use the engine only through this class's public methods: ``open_sequence``, ``prefill``,
    ``run``, ``stream`` (traced engine calls) and ``kv_text``.
    """

    engine: EngineClient

    def __init__(self, engine: EngineClient, *, share_kv: bool = True) -> None:
        self.engine = engine
        self.share_kv = share_kv
        self.tokenizer = engine.tokenizer
        self.counters: dict[str, int] = {"chat_turns": 0, "chat_rerenders": 0}
        self._special_prefix, self._special_suffix = self._find_special_tokens()
        self._anchor_ids = self.tokenizer(_ANCHOR, add_special_tokens=False)["input_ids"]
        self._special_ids = set(getattr(self.tokenizer, "all_special_ids", []) or [])
        self._pid = os.getpid()

    def __repr__(self) -> str:
        return f"<fr.Model on {type(self.engine).__name__}{'' if self.share_kv else ' (sharing off)'}>"

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def stats(self) -> dict[str, Any]:
        return self.engine.stats()

    # ------------------------------------------------------------------ threads
    def thread(self, text: str = "") -> "Thread":
        """A new thread starting with ``text`` (after the tokenizer's BOS, if it uses one)."""
        from .thread import Thread

        return Thread(self, text)

    def chat(self, system: str | None = None, *, messages: Iterable[dict[str, Any]] = (),
             chat_template: str | None = None) -> "ChatThread":
        """A chat thread rendered through the tokenizer's chat template (a plain ChatML template when the
        tokenizer has none)."""
        from .chat import ChatThread

        return ChatThread(self, system=system, messages=messages, chat_template=chat_template)

    async def generate(self, prompt: str, **sampling: Any) -> str:
        """One-shot completion of ``prompt`` (a throwaway thread; its prefix stays in the prefix cache)."""
        with self.thread(prompt) as t:
            return await t.gen(**sampling)

    # ------------------------------------------------------------------ tokenization
    def _find_special_tokens(self) -> tuple[list[int], list[int]]:
        """What the tokenizer adds around a text by default (BOS / EOS ids)."""
        probe = "a"
        plain = self.tokenizer(probe, add_special_tokens=False)["input_ids"]
        full = self.tokenizer(probe)["input_ids"]
        for k in range(len(full) - len(plain) + 1):
            if full[k:k + len(plain)] == plain:
                return list(full[:k]), list(full[k + len(plain):])
        return [], []

    def encode(self, text: str, *, first: bool = False, special_prefix: bool = True) -> list[int]:
        """Token ids of a piece of a thread.

        ``first``: the thread's first piece, tokenized as a whole text (with the tokenizer's special
        prefix, e.g. BOS, when ``special_prefix``). Otherwise a continuation: tokenized after an anchor
        ("\\n") that is then dropped, so SentencePiece tokenizers do not add a word-start "▁" that the
        full text would not have; tokenizers whose anchor merges with the text fall back to plain encode.
        """
        if first:
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] if text else []
            return (list(self._special_prefix) if special_prefix else []) + list(ids)
        if not text:
            return []
        a = self._anchor_ids
        ids = self.tokenizer(_ANCHOR + text, add_special_tokens=False)["input_ids"]
        if a and ids[:len(a)] == a:
            return list(ids[len(a):])
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def kv_text(self, co: CompletionOutput, params: SamplingParams) -> str:
        """The text of a completion's tokens as they sit in the KV cache: the returned text plus a stop
        string it excludes and a final special token (EOS / end-of-turn) it skips."""
        text = co.text
        if co.finish_reason == "stop" and isinstance(co.stop_reason, str) and not params.include_stop_str_in_output:
            text += co.stop_reason
        if co.token_ids and params.skip_special_tokens and co.token_ids[-1] in self._special_ids:
            text += self.tokenizer.convert_ids_to_tokens(co.token_ids[-1])
        return text

    # ------------------------------------------------------------------ engine calls (traced)
    def open_sequence(self, token_ids: Iterable[int] = (), *, thread_id: Any = None) -> SequenceHandle:
        """A new engine sequence holding ``token_ids`` (nothing computed until a call runs on it)."""
        program = self.program_context(thread_id)
        return self.engine.open(token_ids) if program is None else self.engine.open(token_ids, program=program)

    @staticmethod
    def program_context(thread_id: Any = None) -> Any:
        """What the engine's scheduler is told about a call (engine/request/program.py): the executing run, the
        step (flowrt.context.current_step) and the thread; None outside a workflow run."""
        run = current_run_threads.get()
        step = current_step.get()
        if run is None and step is None:
            return None
        from ..engine import ProgramContext

        return ProgramContext(run_id=getattr(run, "run_id", None), step=step, thread_id=thread_id)

    def _span(self, kind: str, uncomputed: int, thread_id: Any = None) -> tuple[Tracer | None, Any]:
        tracer = current_tracer.get()
        if tracer is None:
            return None, None
        return tracer, tracer.start(kind, "llm", kind=kind, step=current_step.get(), pending_tokens=uncomputed,
                                    thread_id=thread_id)

    def _end_span(self, tracer: Tracer, span: Any, out: RequestOutput, uncomputed: int) -> None:
        """End a call's span with its token counts; its prompt text is decoded only when asked for (the run
        viewer's record of a checkpointed run, flowrt.runner.activity), not on every call."""
        if out.prompt is not None:
            text = out.prompt
            span.prompt_text = lambda: text
        else:
            ids, decode = out.prompt_token_ids or [], self.tokenizer.decode
            span.prompt_text = lambda: decode(ids)
        tracer.end(span, **self._span_fields(out, uncomputed))

    @staticmethod
    def _span_fields(out: RequestOutput, uncomputed: int) -> dict[str, Any]:
        """Token counts of one request. ``cached_tokens`` (KV reused, as the engine reports it) splits
        into tokens already in the thread's own sequence and prefix-cache hits. The first output's text,
        clipped (flowrt.render.clip), is for the run viewer."""
        prompt = len(out.prompt_token_ids or [])
        cached = int(out.num_cached_tokens or 0)
        own = max(0, prompt - uncomputed)
        gen = sum(len(o.token_ids) for o in out.outputs)
        return {"prompt_tokens": prompt, "cached_tokens": cached, "tokens_computed": max(0, prompt - cached),
                "prefix_cache_hit_tokens": max(0, cached - own), "generated_tokens": gen,
                "finish_reason": out.outputs[0].finish_reason if out.outputs else None,
                "output": clip(out.outputs[0].text or "") if out.outputs else ""}

    @staticmethod
    def _check_finished(out: RequestOutput) -> None:
        for o in out.outputs:
            if o.finish_reason == "abort":
                reason = o.stop_reason if isinstance(o.stop_reason, str) else "aborted by the engine"
                raise RuntimeError(f"generation aborted: {reason}")

    async def beam_search(self, seq: SequenceHandle, params: Any, *, keep: bool = False) -> Any:
        """The engine's beam search from ``seq`` (``BeamSearchParams``); with ``keep`` each beam's
        sequence stays open (forks of ``seq``) for the caller to continue."""
        search = getattr(self.engine, "beam_search", None)
        if search is None:
            raise NotImplementedError(f"{type(self.engine).__name__} has no beam search")
        return await search(seq, params, keep=keep)

    async def run(self, seq: SequenceHandle, params: SamplingParams, *, kind: str = "gen",
                  uncomputed: int = 0, thread_id: Any = None) -> RequestOutput:
        """Run one request on ``seq`` to completion (generated tokens are appended to it), traced as a
        span of ``kind`` ("gen", "select", "prefill", ...). ``uncomputed``: how many of ``seq``'s tokens
        have no KV yet (for the trace's token accounting). Cancellation aborts the engine request; an
        engine-side abort raises RuntimeError."""
        rid = f"flowrt-{self._pid}-{next(_request_ids)}"
        tracer, span = self._span(kind, uncomputed, thread_id)
        try:
            program = self.program_context(thread_id)
            out = await (self.engine.generate(seq, params, request_id=rid) if program is None
                         else self.engine.generate(seq, params, request_id=rid, program=program))
        except BaseException as e:
            if isinstance(e, anyio.get_cancelled_exc_class()):
                try:
                    self.engine.abort(rid)
                except Exception:  # noqa: BLE001 - best-effort cleanup: the engine may be gone already
                    pass
            if tracer is not None:
                tracer.end(span, kind="failed", error=f"{type(e).__name__}: {e}")
            raise
        if tracer is not None:
            self._end_span(tracer, span, out, uncomputed)
        self._check_finished(out)
        return out

    async def stream(self, seq: SequenceHandle, params: SamplingParams, *, kind: str = "stream",
                     uncomputed: int = 0, thread_id: Any = None) -> AsyncGenerator[RequestOutput, None]:
        """Like ``run``, yielding the engine's cumulative outputs as they come. Closing the iterator
        early aborts the engine request (the tokens generated so far stay in ``seq``)."""
        rid = f"flowrt-{self._pid}-{next(_request_ids)}"
        tracer, span = self._span(kind, uncomputed, thread_id)
        out = None
        try:
            program = self.program_context(thread_id)
            outs = (self.engine.stream(seq, params, request_id=rid) if program is None
                    else self.engine.stream(seq, params, request_id=rid, program=program))
            async for out in outs:
                yield out
        except BaseException as e:
            if tracer is not None:
                tracer.end(span, kind="failed", error=f"{type(e).__name__}: {e}")
            raise
        finally:
            if out is None or not out.finished:
                try:
                    self.engine.abort(rid)
                except Exception:  # noqa: BLE001 - best-effort cleanup: the engine may be gone already
                    pass
            if tracer is not None and out is not None:
                self._end_span(tracer, span, out, uncomputed)
        if out is not None and out.finished:
            self._check_finished(out)

    async def prefill(self, seq: SequenceHandle, uncomputed: int = 0) -> RequestOutput:
        """Compute a sequence's pending tokens without generating (before it is forked)."""
        from ..engine import SamplingParams

        return await self.run(seq, SamplingParams(max_tokens=0), kind="prefill", uncomputed=uncomputed)

