"""Threads: prompt states whose KV cache lives in the engine and is shared copy-on-write.

A ``Thread`` is an engine sequence (a ``SequenceHandle``, from ``Model.open_sequence``) plus text bookkeeping:

* ``t += text`` appends text. Nothing is tokenized or computed yet: text appended between two model calls
  is tokenized *as one piece* when the next call (or ``fork``) needs it, so ``t += "a"; t += "b"`` gives
  the same tokens as ``t += "ab"``. The first piece of a thread gets the tokenizer's special prefix (BOS),
  later pieces never do.
* Pieces are joined at token boundaries: tokens already in the KV cache (an earlier piece, generated text)
  are never re-tokenized. A later piece is tokenized as a continuation (for SentencePiece tokenizers
  without the leading "▁" a standalone encode would add), so ``" world"`` after ``"Hello"`` is one word
  token ``▁world``, exactly as in ``"Hello world"``; only a boundary that falls *inside* a word (``"Hel"`` +
  ``"lo"``) tokenizes differently from the whole text.
* ``await t.gen(...)`` generates onto the sequence: the returned text excludes a stop string, the KV cache
  (and ``t.token_ids`` / ``t.text``) keep every generated token.
* ``t.fork(n)`` returns n threads sharing every KV block so far. Forking is lazy: the shared prefix is
  computed once, by whichever branch first needs it, and then forked copy-on-write, so
  ``fr.gather(*(b.gen() for b in t.fork(8)))`` prefills the prompt once, not eight times.
* ``await t.select(options)`` scores each option by the total log-probability of its tokens (``by="mean"``
  for the per-token mean) with every option's branch sharing the prefix, and appends the winner.
* Closing a thread, or dropping its last reference, releases its blocks to the engine's prefix cache.

A thread runs one model call at a time (fork it for parallel work); all its methods must be called from
the event loop that runs the workflow.
"""

from __future__ import annotations

import itertools
import math
from contextlib import aclosing, contextmanager
from typing import TYPE_CHECKING, Any, AsyncGenerator, Iterable, Iterator

import anyio

from ..aio import gather
from ..context import current_step, current_tracer, token_sink, track
from ..events import Token
from .structured import split_constraint

if TYPE_CHECKING:
    from ..engine import Logprob, RequestOutput, SamplingParams, SequenceHandle
    from .model import Model

__all__ = ["Thread"]

_thread_ids = itertools.count(1)



class _Base:
    """A frozen prefix that several threads fork from (the state behind a lazy fork).

    Either ``seq`` holds it, or it is ``parent``'s prefix plus ``extra`` tokens (a fork of a fork that
    was never materialized). ``users`` counts the threads that will still take a sequence from it; the
    last one takes ``seq`` itself instead of forking it.
    """

    __slots__ = ("model", "seq", "uncomputed", "parent", "extra", "users", "lock")

    def __init__(self, model: "Model", *, seq: SequenceHandle | None = None, uncomputed: int = 0,
                 parent: "_Base | None" = None, extra: list[int] | None = None, users: int = 1) -> None:
        self.model = model
        self.seq = seq
        self.uncomputed = uncomputed
        self.parent = parent
        self.extra = list(extra or ())
        self.users = users
        self.lock = anyio.Lock()

    def token_ids(self) -> list[int]:
        if self.seq is not None:
            return self.seq.token_ids
        assert self.parent is not None
        return self.parent.token_ids() + self.extra

    def num_tokens(self) -> int:
        if self.seq is not None:
            return len(self.seq)
        assert self.parent is not None
        return self.parent.num_tokens() + len(self.extra)

    async def acquire(self) -> tuple[SequenceHandle, int]:
        """A sequence of its own for one user: (sequence, its number of uncomputed tokens)."""
        async with self.lock:
            if self.seq is None:
                assert self.parent is not None
                seq, unc = await self.parent.acquire()
                self.parent = None
                if self.extra:
                    seq.append(self.extra)
                    unc += len(self.extra)
                self.seq, self.uncomputed = seq, unc
            self.users -= 1
            if self.users == 0:  # the last user takes the sequence itself
                seq, self.seq = self.seq, None
                return seq, self.uncomputed
            if not self.model.share_kv:
                # Sharing off (benchmark baseline): a fresh sequence with the same tokens, computed anew.
                return self.model.open_sequence(self.seq.token_ids), len(self.seq)
            if self.uncomputed > 1:
                # Compute the shared prefix once, before forking; forks share its blocks copy-on-write.
                await self.model.prefill(self.seq, self.uncomputed)
                self.uncomputed = 0
            return self.seq.fork(1)[0], self.uncomputed

    def release(self, hard: bool = True) -> None:
        """A user leaves without taking a sequence (closed, or garbage-collected when ``hard`` is False:
        then the sequence is only dropped and the engine's own finalizer closes it)."""
        self.users -= 1
        if self.users <= 0:
            if self.seq is not None:
                seq, self.seq = self.seq, None
                if hard:
                    try:
                        seq.close()
                    except Exception:  # noqa: BLE001 - best-effort release: the engine may be gone already
                        pass
            elif self.parent is not None:
                parent, self.parent = self.parent, None
                parent.release(hard)


class Thread:
    """A prompt state on the model (see the module docstring). Create with ``llm.thread(text)``."""

    _special_prefix = True   # the first piece gets the tokenizer's BOS

    def __init__(self, model: "Model", text: str = "") -> None:
        if not isinstance(text, str):
            raise TypeError(f"thread text must be a str, got {type(text).__name__}")
        self.model = model
        self.id = next(_thread_ids)
        self.fork_index = 0             # position among the siblings of the fork that made it
        self._seq: SequenceHandle | None = None  # our own engine sequence, or
        self._base: _Base | None = None  # a lazy fork we take a sequence from, or neither (empty)
        self._uncomputed = 0            # tokens of _seq whose KV is not computed yet
        self._text = ""                 # text whose tokens are in _seq / _base
        self._pending = text            # appended, not tokenized yet
        self._busy = False
        self._closed = False
        self.last_output: RequestOutput | None = None  # the engine's output of the last gen/stream
        self.score: float | None = None  # a beam from beam(): its beam score and cumulative log-probability
        self.cum_logprob: float | None = None
        # a stream in progress: (sequence, start, end) of its tokens
        self._live: tuple[SequenceHandle, int, int] | None = None
        track(self)                     # a cancelled run closes the threads it opened

    # ------------------------------------------------------------------ introspection
    @property
    def text(self) -> str:
        """Everything the thread holds: prompt pieces and generated text (stop strings included)."""
        return self._text + self._live_text() + self._pending

    def _live_text(self) -> str:
        """The text of a stream's tokens so far: what the consumer has seen, and nothing the engine
        generated after it (so ``text`` matches ``token_ids`` even right after a loop is left early,
        before the event loop finalizes the stream)."""
        if self._live is None:
            return ""
        seq, start, end = self._live
        return self._decode_tail(seq.token_ids[:end], start)

    def _decode_tail(self, ids: list[int], start: int) -> str:
        """The text of ``ids[start:]`` as it reads after ``ids[:start]``: decoded with a few tokens of
        context, since a SentencePiece tokenizer drops the leading space of a word that starts a decode."""
        decode = self.model.tokenizer.decode
        ctx = max(0, start - 4)
        head = decode(ids[ctx:start], skip_special_tokens=False)
        full = decode(ids[ctx:], skip_special_tokens=False)
        if full.startswith(head):
            return full[len(head):]
        return decode(ids[start:], skip_special_tokens=False)

    @property
    def token_ids(self) -> list[int]:
        """Token ids of the thread, including the pending text as it will be tokenized."""
        ids = self._state_ids()
        if self._pending:
            ids = ids + self._encode_piece(self._pending, first=not ids)
        return ids

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def closed(self) -> bool:
        return self._closed

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("busy" if self._busy else "idle")
        tail = self.text[-40:]
        return f"<{type(self).__name__} #{self.id} {state} ...{tail!r}>"

    def _state_ids(self) -> list[int]:
        if self._live is not None:
            seq, _, end = self._live
            return seq.token_ids[:end]
        if self._seq is not None:
            return self._seq.token_ids
        if self._base is not None:
            return self._base.token_ids()
        return []

    def _has_tokens(self) -> bool:
        if self._seq is not None:
            return len(self._seq) > 0
        return self._base is not None

    def _encode_piece(self, text: str, *, first: bool) -> list[int]:
        return self.model.encode(text, first=first, special_prefix=self._special_prefix)

    # ------------------------------------------------------------------ appending / forking
    def _check_usable(self) -> None:
        if self._closed:
            raise RuntimeError(f"thread #{self.id} is closed")
        if self._busy and self._live is not None:
            raise RuntimeError(f"thread #{self.id} is still streaming: a stream left early ends when the event "
                               f"loop finalizes it; `async with contextlib.aclosing(t.stream(...)) as s:` ends it "
                               f"as the loop is left")
        if self._busy:
            raise RuntimeError(f"thread #{self.id} is busy with a model call (one call at a time per "
                               f"thread; fork it for parallel work)")

    def append(self, text: str) -> "Thread":
        if not isinstance(text, str):
            raise TypeError(f"can only append str to a thread, got {type(text).__name__}")
        from ..engine.model.tokenizer import check_text

        check_text(text, "text appended to the thread")  # fails here, not at the next model call
        self._check_usable()
        self._pending += text
        return self

    def __iadd__(self, text: str) -> "Thread":
        return self.append(text)

    def __add__(self, text: str) -> "Thread":
        """A fork with ``text`` appended; this thread is unchanged."""
        if not isinstance(text, str):
            return NotImplemented
        child = self.fork(1)[0]
        child.append(text)
        return child

    def _push_ids(self, ids: list[int]) -> None:
        """Append tokens to the thread's state (not to its text)."""
        if not ids:
            return
        if self._seq is not None:
            self._seq.append(ids)
            self._uncomputed += len(ids)
        elif self._base is not None:
            # Fork of a fork not taken yet: chain a base holding the extra tokens (we are its only user).
            self._base = _Base(self.model, parent=self._base, extra=ids, users=1)
        else:
            self._seq = self.model.open_sequence(ids, thread_id=self.id)
            self._uncomputed = len(ids)

    def _flush(self) -> None:
        """Tokenize the pending text into the state."""
        if not self._pending and self._has_tokens():
            return
        text = self._pending
        first = not self._has_tokens()
        ids = self._encode_piece(text, first=first)
        if first and not ids:
            raise ValueError("the thread is empty: append a prompt before calling the model")
        self._push_ids(ids)
        self._text += text
        self._pending = ""

    def _new_like(self) -> "Thread":
        child = type(self).__new__(type(self))
        Thread.__init__(child, self.model)
        return child

    def _fork_raw(self, n: int) -> list["Thread"]:
        """n children sharing the current state (pending text must be flushed by the caller)."""
        if self._seq is not None:
            self._base = _Base(self.model, seq=self._seq, uncomputed=self._uncomputed, users=n + 1)
            self._seq, self._uncomputed = None, 0
        elif self._base is not None:
            self._base.users += n
        children = []
        for i in range(n):
            c = self._new_like()
            c._base, c._text, c.fork_index = self._base, self._text, i
            children.append(c)
        return children

    def fork(self, n: int = 1) -> list["Thread"]:
        """n threads that share everything so far (copy-on-write); each then evolves on its own."""
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"fork needs n >= 1, got {n!r}")
        self._check_usable()
        if self._pending or self._has_tokens():
            self._flush()
        children = self._fork_raw(n)
        for c in children:
            self._copy_extra_state(c)
        tracer = current_tracer.get()
        if tracer is not None:   # the run viewer's fork tree (flowrt.ui)
            base = self._base
            tracer.fork(current_step.get(), self.id, [c.id for c in children], base.num_tokens() if base else 0)
        return children

    def copy(self) -> "Thread":
        return self.fork(1)[0]

    def _copy_extra_state(self, child: "Thread") -> None:
        pass

    # ------------------------------------------------------------------ model calls
    @contextmanager
    def _op(self) -> Iterator[None]:
        self._check_usable()
        self._busy = True
        try:
            yield
        finally:
            self._busy = False

    async def _materialize(self) -> SequenceHandle:
        """Our own sequence with the pending text appended (taking it from a lazy fork if needed)."""
        self._flush()
        if self._seq is None:
            assert self._base is not None
            base, self._base = self._base, None
            try:
                self._seq, self._uncomputed = await base.acquire()
            except BaseException:
                base.release()
                raise
        return self._seq

    def _params(self, sampling: dict[str, Any]) -> SamplingParams:
        from ..engine import SamplingParams

        params = sampling.pop("sampling_params", None)
        if params is not None:
            if sampling:
                raise TypeError("pass either sampling_params= or sampling keywords, not both")
        else:
            params = SamplingParams(**sampling)
        if params.n != 1:
            raise ValueError(f"n={params.n}: a thread generates one sample; use t.fork(n) for several")
        return params

    def _record_generation(self, out: RequestOutput, params: SamplingParams) -> None:
        self.last_output = out
        co = out.outputs[0]
        self._text += self.model.kv_text(co, params)
        self._uncomputed = 1 if co.token_ids else 0

    async def gen(self, **sampling: Any) -> Any:
        """Generate onto the thread (any SamplingParams field as a keyword: max_tokens, temperature,
        stop, seed, top_p, ...). Returns the generated text without the stop string; the thread keeps
        every generated token.

        Constrained (flowrt/llm/structured.py): ``json=`` a pydantic model class (returns a validated
        instance), a type such as ``list[Record]`` (the validated value) or a JSON schema dict (the parsed
        value); ``regex=``, ``choice=[...]``, ``grammar=`` (Lark) return the text. Output cut off by
        max_tokens raises ``IncompleteOutputError``; a bad constraint, ValueError naming the keyword."""
        con, sampling = split_constraint(sampling)
        if con is not None:
            sampling = con.sampling(sampling)
            with con.translating("gen"):
                await Thread.gen(self, **sampling)
            assert self.last_output is not None
            return con.result(self.last_output, "gen", sampling.get("max_tokens"))
        if token_sink() is not None:  # a run streams its tokens (flowrt.events): generate as a stream
            async with aclosing(Thread.stream(self, **sampling)) as pieces:
                async for _ in pieces:
                    pass
            assert self.last_output is not None
            return self.last_output.outputs[0].text
        params = self._params(sampling)
        with self._op():
            seq = await self._materialize()
            n_before = len(seq)
            try:
                out = await self.model.run(seq, params, kind="gen", uncomputed=self._uncomputed, thread_id=self.id)
            except BaseException:
                self._after_interrupt(n_before)
                raise
            self._record_generation(out, params)
            return out.outputs[0].text

    async def stream(self, **sampling: Any) -> AsyncGenerator[str, None]:
        """Generate onto the thread, yielding text as it is produced (same keywords as ``gen``).

        Leaving the loop early aborts the request (when the event loop finalizes the stream, at once
        under ``contextlib.aclosing``); the tokens generated so far stay in the thread. Until then
        ``text`` and ``token_ids`` show what the loop has seen, consistently. With ``json=`` / ``regex=`` /
        ``choice=`` / ``grammar=`` it yields the constrained text (and raises at the end if max_tokens
        cut it off)."""
        con, sampling = split_constraint(sampling)
        if con is not None:
            sampling = con.sampling(sampling)
            with con.translating("stream"):
                async with aclosing(Thread.stream(self, **sampling)) as pieces:
                    async for piece in pieces:
                        yield piece
            assert self.last_output is not None
            con.check(self.last_output, "stream", sampling.get("max_tokens"))
            return
        params = self._params(sampling)
        with self._op():
            seq = await self._materialize()
            n_before = len(seq)
            prev = ""
            final = None
            sink, step, n_ids = token_sink(), None, 0
            if sink is not None:
                step = current_step.get()
            self._live = (seq, n_before, n_before)
            # aclosing: when this stream is closed, the engine request is aborted then, not at finalization
            try:
                outs = self.model.stream(seq, params, kind="stream", uncomputed=self._uncomputed, thread_id=self.id)
                async with aclosing(outs):
                    async for out in outs:
                        final = out
                        self._live = (seq, n_before, n_before + len(out.outputs[0].token_ids))
                        text = out.outputs[0].text
                        delta = text[len(prev):] if text.startswith(prev) else text
                        prev = text
                        if sink is not None and len(out.outputs[0].token_ids) > n_ids:
                            ids = list(out.outputs[0].token_ids)
                            sink(Token(step, self.id, self.fork_index, delta, ids[n_ids:]))
                            n_ids = len(ids)
                        if delta:
                            yield delta
            finally:
                self._live = None
                if final is not None and final.finished:
                    self._record_generation(final, params)
                else:  # left early or failed: the KV holds whatever was generated
                    self.last_output = final
                    self._after_interrupt(n_before)

    def _after_interrupt(self, n_before: int) -> None:
        """A call was cancelled or failed part way: the tokens it generated stay in the sequence (their
        ids are authoritative); add their text to the thread's text."""
        seq = self._seq
        if seq is None:
            return
        try:
            ids = seq.token_ids
        except Exception:  # noqa: BLE001 - a remote or closed sequence: nothing to recover
            return
        if len(ids) > n_before:
            self._text += self._decode_tail(ids, n_before)
            self._uncomputed = 1

    async def beam(self, *, width: int = 4, max_tokens: int = 16, length_penalty: float = 1.0,
                   ignore_eos: bool = False, **constraint: Any) -> list["Thread"]:
        """Beam search from the thread (flowrt.engine's beam search): the ``width`` best continuations of
        ``max_tokens`` tokens at most, best first, as threads forked from this one (sharing its KV
        copy-on-write) with ``score`` (cum_logprob / generated length ** length_penalty) and ``cum_logprob``
        set. The thread itself is unchanged. ``json=`` / ``regex=`` / ``choice=`` / ``grammar=`` constrain every
        beam (each beam forks its grammar state); the beams' text is then the constrained output."""
        from ..engine import BeamSearchParams

        con, rest = split_constraint(constraint)
        if rest:
            raise TypeError(f"beam() got unexpected keywords: {', '.join(rest)}")
        search = self.model.beam_search
        params = BeamSearchParams(beam_width=width, max_tokens=max_tokens, length_penalty=length_penalty,
                                  ignore_eos=ignore_eos, structured_outputs=con.params if con is not None else None)
        with self._op():
            seq = await self._materialize()
            n_before = len(seq)
            if con is not None:
                with con.translating("beam"):
                    out = await search(seq, params, keep=True)
            else:
                out = await search(seq, params, keep=True)
            self._uncomputed = min(self._uncomputed, 1)
            beams = []
            for i, b in enumerate(out.sequences):
                child = self._new_like()
                self._copy_extra_state(child)
                child._seq, child._uncomputed, child.fork_index = b.sequence, 1, i
                child._text = self._text + self._decode_tail(b.tokens, n_before)
                child.score, child.cum_logprob = b.score, b.cum_logprob
                self._record_beam(child, b)
                beams.append(child)
            return beams

    def _record_beam(self, child: "Thread", beam: Any) -> None:
        """What a beam thread keeps of its beam (a ``BeamSearchSequence``) besides tokens and text."""

    async def scores(self, options: Iterable[str], *, by: str = "total") -> dict[str, float]:
        """Log-probability of each option as a continuation of the thread (``by="total"``: sum over the
        option's tokens; ``"mean"``: per-token mean). The thread is unchanged."""
        result, _ = await self._score(list(options), by=by, keep=False)
        return result

    async def select(self, options: Iterable[str], *, by: str = "total", append: bool = True) -> str:
        """The most likely option (see ``scores``; ties go to the earlier option). With ``append`` (the
        default) the winner is appended to the thread, reusing the KV its scoring computed."""
        scores, _ = await self._score(list(options), by=by, keep=append)
        return max(scores, key=lambda o: scores[o])  # dicts keep option order; max keeps the first

    async def _score(self, options: list[str], *, by: str, keep: bool) -> tuple[dict[str, float], str]:
        from ..engine import SamplingParams

        if by not in ("total", "mean"):
            raise ValueError(f"by must be 'total' or 'mean', got {by!r}")
        if not options:
            raise ValueError("select needs at least one option")
        for o in options:
            if not isinstance(o, str) or not o:
                raise ValueError(f"select options must be non-empty strings, got {o!r}")
        with self._op():
            pending = self._pending
            self._pending = ""
            first = not self._has_tokens()
            # Tokenize pending text + option together, so that the option's boundary matches the full
            # text's tokenization (e.g. "Answer: " + "yes" -> "▁yes", not "▁" "yes").
            # The shared part is what the options and the context alone tokenize alike; everything after
            # it is scored (so a score is the log-probability of the option's text, whole).
            joint = [self._encode_piece(pending + o, first=first) for o in options]
            context = self._encode_piece(pending, first=first) if (pending or first) else []
            k = 0
            shortest = min(len(j) for j in joint)
            limit = min(shortest - 1, len(context))
            while k < limit and all(j[k] == context[k] for j in joint):
                k += 1
            if shortest == 0:
                self._pending = pending
                raise ValueError("an option tokenizes to nothing")
            branches: list[Thread] = []
            holder = None
            try:
                holder = self._fork_raw(1)[0]
                holder._push_ids(joint[0][:k])
                branches = holder._fork_raw(len(options))
                holder.close()
                for b, ids in zip(branches, joint):
                    b._push_ids(ids[k:])
                params = SamplingParams(max_tokens=0, prompt_logprobs=0)

                async def score_one(b: Thread, ids: list[int]) -> float:
                    seq = await b._materialize()
                    out = await self.model.run(seq, params, kind="select", uncomputed=b._uncomputed)
                    b._uncomputed = 0
                    return _sum_logprobs(out.prompt_logprobs or [], ids)

                totals = await gather(*(score_one(b, ids[k:]) for b, ids in zip(branches, joint)))
            except BaseException:
                self._pending = pending
                for b in branches:
                    b.close()
                if holder is not None:
                    holder.close()
                raise
            result = {}
            for o, ids, total in zip(options, joint, totals):
                if o not in result:
                    result[o] = total / max(1, len(ids) - k) if by == "mean" else total
            winner_i = max(range(len(options)), key=lambda i: (result[options[i]], -i))
            winner = options[winner_i]
            if keep:
                self._drop_state()
                win = branches[winner_i]
                self._seq, self._uncomputed = win._seq, 0
                win._seq = None
                self._text += pending + winner
                self._pending = ""
            else:
                self._pending = pending
            for b in branches:
                b.close()
            return result, winner

    @classmethod
    def from_tokens(cls, model: "Model", token_ids: list[int], text: str, **state: Any) -> "Thread":
        """A thread holding ``token_ids`` (whose text is ``text``), e.g. restored from a checkpoint: nothing
        is computed until a call needs it, and then the engine's prefix cache supplies the blocks it
        still holds."""
        t = cls(model, **state) if state else cls(model)
        t._push_ids(list(token_ids))
        t._text = text
        return t

    # ------------------------------------------------------------------ closing
    def _drop_state(self, hard: bool = True) -> None:
        seq, base = self._seq, self._base
        self._seq, self._base, self._uncomputed = None, None, 0
        if seq is not None and hard:
            try:
                seq.close()
            except Exception:  # noqa: BLE001 - best-effort release: the engine may be gone already
                pass
        if base is not None:
            base.release(hard)

    def _hint_state(self, state: str) -> None:
        """Tell the engine how soon this thread's KV is needed ("waiting" / "finished"; a hint)."""
        seq = self._seq
        if seq is not None and not self._closed and hasattr(seq, "set_state"):
            seq.set_state(state)

    def close(self) -> None:
        """Release the thread's KV blocks (to the prefix cache). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._drop_state()

    def __enter__(self) -> "Thread":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        # Garbage collection may run anywhere (even inside the engine's locked step): only drop the
        # references; the EngineSequence finalizer hands the blocks back at the engine's next step.
        try:
            if not self._closed:
                self._closed = True
                self._drop_state(hard=False)
        except Exception:  # noqa: BLE001 - runs from __del__: must never raise
            pass


def _sum_logprobs(entries: list[dict[int, Logprob] | None], ids: list[int]) -> float:
    """Sum of the log-probabilities of ``ids``, the last tokens scored in ``entries``."""
    if not ids:
        return 0.0
    tail = entries[-len(ids):]
    if len(tail) < len(ids):
        raise RuntimeError(f"the engine scored {len(entries)} tokens, expected at least {len(ids)}")
    total = 0.0
    for tok, entry in zip(ids, tail):
        if entry is None:
            continue  # the very first token of a sequence has no context to score it
        lp = entry.get(tok)
        if lp is None:
            raise RuntimeError(f"the engine's prompt logprobs lack token {tok}")
        v = lp.logprob if hasattr(lp, "logprob") else float(lp)
        total += v if math.isfinite(v) else -1e30
    return total
