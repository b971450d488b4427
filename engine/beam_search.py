"""Beam search over copy-on-write forks (vLLM's `LLM.beam_search` API; transformers' selection rule).

Each round, every live beam (an open engine sequence) runs one request that computes its pending token(s)
and returns the log-probabilities of its 2W most likely next tokens (the request also appends its greedy
token, not yet computed). The W best (parent, token) continuations by cumulative log-probability become the
next beams: a parent with k children is forked k - 1 times and itself becomes the last child (each child's
last, uncomputed token is set to its own), a parent with none is closed. So the prompt is held once, beams
sharing a history share its blocks, and a dropped beam frees only its own tail. Scores add in float32, as
transformers does, so that the same logits give the same beams.

With `ignore_eos=False`, a continuation by EOS among the W best ends that beam ("stop"); the others go on
until `max_tokens` ("length"), or until no live beam can beat the W best finished ones. With
`structured_outputs`, each beam carries its own grammar state (forked with it): its candidates are the tokens
the grammar allows, and a beam whose grammar is complete ends ("stop").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
from .request.outputs import Logprob, RequestOutput
from .core.sampling_params import MAX_BEAM_WIDTH, BeamSearchParams, SamplingParams

if TYPE_CHECKING:
    from .llm_engine import LLMEngine
    from .request.sequence import Sequence

__all__ = ["BeamSearch", "BeamSearchOutput", "BeamSearchParams", "BeamSearchSequence", "MAX_BEAM_WIDTH"]


@dataclass
class BeamSearchSequence:
    """One beam. As in vLLM, `tokens` include the prompt and `text` is the decoded `tokens`; `output_tokens`
    and `output_text` are the generated part. `sequence`: the beam's open engine sequence (AsyncLLM with
    keep=True), else None."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]]
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    output_text: str | None = None
    score: float = 0.0
    sequence: Any = None

    @property
    def output_tokens(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens:]


@dataclass
class BeamSearchOutput:
    """The beams of one prompt, best first."""

    sequences: list[BeamSearchSequence] = field(default_factory=list)


def beam_score(cum_logprob: float, num_generated: int, length_penalty: float) -> float:
    """transformers' score: the generated length counts a final EOS."""
    return cum_logprob / (max(1, num_generated) ** length_penalty)


@dataclass(eq=False)
class _Beam:
    """A live beam: its open sequence (the last token not yet computed)."""

    seq: Sequence
    cum: np.float32
    logprobs: list[dict[int, Logprob]]
    matcher: Any = None  # structured outputs: the grammar state after this beam's tokens


@dataclass(eq=False)
class _Finished:
    """A finished beam: its tokens, and its sequence while the search keeps it (keep=True)."""

    seq: Sequence | None
    cum: np.float32
    logprobs: list[dict[int, Logprob]]
    tokens: list[int]
    finish_reason: str


class BeamSearch:
    """The search state of one prompt over an LLMEngine. Drive it: run `step_params` on each of `pending()`
    (one request per sequence, all in flight together), then `advance(outputs)`; until `done`; then `result()`.
    It owns the sequences it holds: `close()` releases them (after a failure)."""

    def __init__(self, engine: LLMEngine, root: Sequence, params: BeamSearchParams, keep: bool = False):
        self.engine = engine
        self.params = params
        self.keep = keep
        self.prompt_len = root.num_tokens
        self.max_tokens = min(params.max_tokens, engine.max_model_len - root.num_tokens)
        W = params.beam_width
        matcher = engine.inputs.constraint_matcher(SamplingParams(structured_outputs=params.structured_outputs))
        self.beams = [_Beam(root, np.float32(0.0), [], matcher)]
        self.finished: list[_Finished] = []
        self.rounds = 0
        self.peak_blocks = 0
        self.step_params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=2 * W, ignore_eos=True,
                                          structured_outputs=params.structured_outputs)
        if self.max_tokens <= 0:
            self._finish_all()

    @property
    def done(self) -> bool:
        return not self.beams

    def pending(self) -> list[tuple[Sequence, Any]]:
        """(sequence, a copy of its grammar state or None) of every live beam, for this round's requests."""
        return [(b.seq, b.matcher.deep_copy() if b.matcher is not None else None) for b in self.beams]

    # ---- one round ---------------------------------------------------------------------------------
    def advance(self, outs: list[RequestOutput]) -> None:
        """outs[i]: the finished request of beam i this round."""
        with self.engine.lock:
            self._advance(outs)

    def _advance(self, outs: list[RequestOutput]) -> None:
        last: list[dict[int, Logprob]] = []  # each beam's top 2W next tokens
        for o in outs:
            co = o.outputs[0]
            if co.finish_reason == "abort" or not co.logprobs:
                raise RuntimeError(f"beam search step aborted: {co.stop_reason or 'aborted by the engine'}")
            last.append(co.logprobs[-1])
        self._count_blocks()
        p, W = self.params, self.params.beam_width
        eos = () if p.ignore_eos else self.engine.eos_ids
        cands = []
        for i, (b, top) in enumerate(zip(self.beams, last)):
            for tok, lp in top.items():
                if lp.logprob == float("-inf"):
                    continue
                cands.append((np.float32(b.cum + np.float32(lp.logprob)), i, tok, lp))
        # best first; equal scores in transformers' flattened (beam, token) order
        cands.sort(key=lambda c: (-c[0], c[1], c[2]))
        children: list[list[tuple[np.float32, int, Logprob]]] = [[] for _ in self.beams]
        new_order = []
        n_live = 0
        for rank, (score, i, tok, lp) in enumerate(cands[: 2 * W]):
            if n_live == W:
                break
            if tok in eos:
                if rank < W:  # an ending among the W best continuations
                    self._finish_eos(self.beams[i], tok, score, lp)
                continue
            children[i].append((score, tok, lp))
            new_order.append((i, len(children[i]) - 1))
            n_live += 1
        made: dict[tuple[int, int], _Beam] = {}
        for i, (b, kids) in enumerate(zip(self.beams, children)):
            for j, (score, tok, lp) in enumerate(kids):
                seq = b.seq if j == len(kids) - 1 else self.engine.fork(b.seq, 1)[0]
                self._set_last_token(seq, tok)
                matcher = None
                if b.matcher is not None:
                    matcher = b.matcher if j == len(kids) - 1 else b.matcher.deep_copy()
                    matcher.consume_token(tok)
                made[(i, j)] = _Beam(seq, score, b.logprobs + [{tok: lp}], matcher)
            if not kids:
                self.engine.close(b.seq)
        self.beams = []
        for k in new_order:
            beam = made[k]
            if beam.matcher is not None and beam.matcher.is_stopped():  # the grammar is complete
                self._finish(beam, "stop")
            else:
                self.beams.append(beam)
        self.rounds += 1
        if self.rounds >= self.max_tokens or not self.beams:
            self._finish_all()
        elif self._cannot_improve():
            for b in self.beams:
                self.engine.close(b.seq)
            self.beams = []
        self._prune_finished()

    def _set_last_token(self, seq: Sequence, tok: int) -> None:
        """The request appended its greedy token, not yet computed: the beam's own token replaces it."""
        assert seq.kv.num_computed_tokens < seq.num_tokens
        seq.replace_last(tok)
        self.engine.kv_manager.forget_hashes(seq, seq.num_tokens - 1)

    def _finish_eos(self, parent: _Beam, tok: int, score: np.float32, lp: Logprob) -> None:
        seq = None
        if self.keep:
            seq = self.engine.fork(parent.seq, 1)[0]
            self._set_last_token(seq, tok)
        tokens = parent.seq.token_ids[:-1] + [tok]
        self.finished.append(_Finished(seq, score, parent.logprobs + [{tok: lp}], tokens, "stop"))

    def _finish(self, b: _Beam, reason: str) -> None:
        tokens = list(b.seq.token_ids)
        if not self.keep:
            self.engine.close(b.seq)
        self.finished.append(_Finished(b.seq if self.keep else None, b.cum, b.logprobs, tokens, reason))

    def _finish_all(self) -> None:
        for b in self.beams:
            self._finish(b, "length")
        self.beams = []

    def _score(self, b: _Finished) -> float:
        n = len(b.tokens) - self.prompt_len
        return beam_score(float(b.cum), n, self.params.length_penalty)

    def _prune_finished(self) -> None:
        W = self.params.beam_width
        if len(self.finished) <= W:
            return
        self.finished.sort(key=self._score, reverse=True)
        for b in self.finished[W:]:
            if b.seq is not None:
                self.engine.close(b.seq)
        del self.finished[W:]

    def _cannot_improve(self) -> bool:
        """W beams have finished and no live beam can score above the worst of them: log-probabilities only
        fall, so a live beam's best reachable score is cum / L ** length_penalty at the most favourable
        length L it can still reach."""
        W, lp = self.params.beam_width, self.params.length_penalty
        if len(self.finished) < W or not self.beams:
            return False
        worst = min(self._score(b) for b in self.finished)
        n_now = self.beams[0].seq.num_tokens - self.prompt_len
        best_len = self.max_tokens if lp > 0 else n_now + 1
        return all(float(b.cum) / (best_len ** lp) <= worst for b in self.beams)

    def _count_blocks(self) -> None:
        held: set[int] = set()
        for b in self.beams + self.finished:
            if b.seq is not None:
                held.update(b.seq.kv.block_table)
        self.peak_blocks = max(self.peak_blocks, len(held))
        self.engine.note_beam_peak(self.peak_blocks)

    # ---- the end -------------------------------------------------------------------------------------
    def result(self, wrap=None) -> BeamSearchOutput:
        """The W best beams, best first. `wrap(seq)`: what to return for a kept beam's sequence."""
        tok = self.engine.tokenizer
        seqs = []
        for b in sorted(self.finished, key=self._score, reverse=True):
            out = b.tokens[self.prompt_len:]
            seqs.append(BeamSearchSequence(
                tokens=list(b.tokens), logprobs=b.logprobs, cum_logprob=float(b.cum),
                text=tok.decode(b.tokens, skip_special_tokens=True), finish_reason=b.finish_reason,
                num_prompt_tokens=self.prompt_len, output_text=tok.decode(out, skip_special_tokens=True),
                score=self._score(b), sequence=wrap(b.seq) if (wrap is not None and b.seq is not None) else None))
        self.finished = []
        return BeamSearchOutput(seqs)

    def close(self) -> None:
        """Release every sequence the search still holds."""
        with self.engine.lock:
            self._close()

    def _close(self) -> None:
        for b in self.beams:
            self.engine.close(b.seq)
        self.beams = []
        for f in self.finished:
            if f.seq is not None:
                self.engine.close(f.seq)
                f.seq = None
        self.finished = []
