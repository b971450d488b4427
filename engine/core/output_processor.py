"""Post-sampling processing: what a step's results do to requests.

`OutputProcessor.process` takes the step's plan (SchedulerOutput), the sequences whose tokens were computed,
the logits (ModelRunnerOutput) and the sampled tokens, and: records prompt log-probabilities, appends each
sampled token, applies stop conditions (stop strings, stop token ids, EOS, max_tokens, max_model_len; none
of the first three before min_tokens), detokenizes incrementally, records logprobs, finishes samples and
requests, and notifies each request's listener. `make_output` builds the user-facing RequestOutput.

It owns the registry of live requests and the token counters, and is the only writer of a sequence's `sample`
part (engine/request/sequence.py's SampleState: a fresh one per request). Sequences it finishes go back to the
scheduler (`Scheduler.finish`), which releases or parks their KV; their tokens, text and grammar change through
their owners (Sequence's methods, engine/core/detokenizer.py, engine/decoding/structured_output.py).
"""

from __future__ import annotations

import logging
import time

import torch

from . import detokenizer
from ..decoding import structured_output
from ..model.runner import ModelRunnerOutput
from ..request.outputs import CompletionOutput, FinishReason, Logprob, RequestOutput
from ..decoding.sampler import SampleResult
from .scheduler import Scheduler, SchedulerOutput
from ..request.sequence import Request, SampleState, Sequence, SeqStatus
from ..decoding.spec_decode import Verified, strip_drafts

logger = logging.getLogger("flowrt.engine")


class OutputProcessor:
    def __init__(self, tokenizer, scheduler: Scheduler, eos_ids: tuple[int, ...], max_model_len: int,
                 structured=None, enable_forced_tokens: bool = True):
        self.tokenizer = tokenizer
        self.structured = structured  # StructuredOutputManager (grammar masks of constrained sequences)
        self.enable_forced_tokens = enable_forced_tokens
        self.scheduler = scheduler
        self.eos_ids = eos_ids
        self.max_model_len = max_model_len
        self.requests: dict[str, Request] = {}
        self.counters = dict(prompt_tokens=0, prefill_tokens_computed=0, decode_tokens_computed=0,
                             generated_tokens=0, forced_tokens=0, steps=0)

    # ---- request lifecycle ----------------------------------------------------------------------
    def add(self, req: Request) -> int:
        """Registers a new request (its one sequence samples as index 0). Returns how many of the sequence's
        tokens keep their KV: the logits of every token after that are recomputed (the next token's, and
        those of the prompt tokens scored for prompt_logprobs: all of a fresh prompt, the pending ones of an
        open sequence)."""
        seq = req.seqs[0]
        self.attach(req, seq, 0)
        keep = min(seq.kv.num_computed_tokens, seq.num_tokens - 1)
        if req.params.prompt_logprobs is not None:
            start = max(1, keep) if seq.persistent else 1
            req.prompt_logprob_start = start
            req.prompt_logprobs = [None] * (seq.num_tokens - start)
            keep = min(keep, start - 1)
        self.counters["prompt_tokens"] += seq.num_tokens - keep
        self.requests[req.request_id] = req
        return keep

    def attach(self, req: Request, seq: Sequence, index: int) -> None:
        """seq samples for req as its sample `index`: fresh per-request output state (its grammar is set by
        whoever attaches it: engine/decoding/structured_output.py's constrain or fork)."""
        p = req.params
        seq.sample = SampleState(
            request=req, index=index, prompt_len=seq.num_tokens,
            generator=torch.Generator().manual_seed(p.seed + index) if p.seed is not None else None,
            output_logprobs=[] if p.logprobs is not None else None)
        detokenizer.start(seq)

    def detach(self, seq: Sequence) -> None:
        """An open sequence is closed: its request, if still generating, is aborted, and it forgets it."""
        req = seq.sample.request
        if req is not None and not req.finished:
            self.abort(req)
        seq.sample.request = None

    def finish_seq(self, seq: Sequence, reason: FinishReason | None = None) -> None:
        """A sample is done (its finish_reason set, or `reason`): final text, and it leaves the batch."""
        sample = seq.sample
        if reason is not None:
            sample.finish_reason = reason
        if seq.spec.num_draft_tokens:  # aborted with speculative drafts in flight: they were never its tokens
            kv = self.scheduler.kv
            strip_drafts(seq, 0, kv)
            if seq.kv.num_computed_tokens > seq.num_tokens - 1:
                kv.truncate_computed(seq, max(0, seq.num_tokens - 1))
        req = sample.request
        assert req is not None  # a sequence in the batch samples for a request
        if not req.needs_text_each_step and sample.finish_reason != "abort":
            detokenizer.update(self.tokenizer, seq, req.params.skip_special_tokens)
        structured_output.release(seq)
        self.scheduler.finish(seq)

    def finish_request(self, req: Request) -> None:
        req.finished = True
        self.requests.pop(req.request_id, None)
        if req.on_output is not None:
            req.on_output(req)

    def abort(self, req: Request) -> None:
        for seq in req.seqs:
            if seq.sample.finish_reason is None:
                self.finish_seq(seq, "abort")
        self.finish_request(req)

    def fail(self, req: Request, exc: BaseException) -> None:
        """The engine broke: the request ends (aborted) and its listener gets the error, not an output."""
        on_error, req.on_output = req.on_error, None
        self.abort(req)
        if on_error is not None:
            on_error(exc)

    def fail_unfit(self, seq: Sequence) -> None:
        """A sequence that outgrew the whole KV pool ends like one that reached max_model_len. (Submission
        refuses requests that could; this is the safety net.)"""
        logger.warning("sequence %d (%d tokens) no longer fits in the KV cache; ending it", seq.seq_id, seq.num_tokens)
        req = seq.sample.request
        self.finish_seq(seq, "length")
        if req is not None and all(s.sample.finish_reason is not None for s in req.seqs):
            self.finish_request(req)

    # ---- one step's results ------------------------------------------------------------------------
    def process(self, so: SchedulerOutput, computed: list[tuple[Sequence, int]], mo: ModelRunnerOutput,
                sampled: list[Sequence], result: SampleResult | None,
                verified: dict[int, Verified] | None = None) -> list[Request]:
        """Applies a step; returns the requests that made progress. `sampled[i]` drew result.token_ids[i];
        `verified[i]`, where given (speculative decoding), replaces it: accepted drafts, then a final token."""
        self.counters["steps"] += 1
        touched: dict[str, Request] = {}
        drafting = {seq.seq_id for seq, _, _ in so.spec_rows}
        for seq, n in computed:
            # A decode computes one just-sampled token (and its drafts); everything else (prompts, appended
            # text, recomputation after preemption) is prefill.
            decode = (n == 1 and seq.kv.num_computed_tokens - 1 >= seq.sample.prompt_len) or seq.seq_id in drafting
            self.counters["decode_tokens_computed" if decode else "prefill_tokens_computed"] += n
            req = seq.sample.request
            assert req is not None
            touched[req.request_id] = req
        for seq, first_row, pos in so.prompt_logprob_rows:
            if seq.sched.status is SeqStatus.RUNNING:
                self._record_prompt_logprobs(seq, mo.logits, first_row, pos)
        if result is not None:
            now = time.monotonic()
            for i, (seq, tok) in enumerate(zip(sampled, result.token_ids)):
                req = seq.sample.request
                assert req is not None
                if req.first_token_time is None:
                    req.first_token_time = now
                v = verified.get(i) if verified else None
                if v is None:
                    self._emit(seq, tok, result.logprobs[i] if result.logprobs is not None else None)
                    continue
                rows = v.logprob_rows
                for j, t in enumerate([*v.accepted, v.final]):
                    self._emit(seq, t, rows[j] if rows is not None else None)
                    if seq.sample.finish_reason is not None:
                        break
                if seq.kv.block_table and seq.kv.num_computed_tokens > seq.num_tokens - 1:  # stopped on a draft
                    self.scheduler.kv.truncate_computed(seq, seq.num_tokens - 1)
            if self.structured is not None:
                self._next_masks([s for s in sampled if s.grammar is not None and s.sample.finish_reason is None])
        for req in touched.values():
            for seq in req.seqs:
                if (seq.sched.status is SeqStatus.RUNNING and seq.sample.finish_reason is None
                        and req.params.max_tokens == 0 and seq.kv.num_computed_tokens == seq.num_tokens):
                    self.finish_seq(seq, "length")  # max_tokens=0: done once its tokens are computed
            if all(s.sample.finish_reason is not None for s in req.seqs) and req.forked == (req.params.n > 1):
                self.finish_request(req)
            elif req.on_output is not None:
                req.on_output(req)
        return list(touched.values())

    def _emit(self, seq: Sequence, tok: int, logprobs: torch.Tensor | None) -> None:
        """One generated token: appended, its logprobs recorded, its grammar advanced, stops checked."""
        seq.append(tok)
        self.counters["generated_tokens"] += 1
        sample = seq.sample
        if sample.output_logprobs is not None:
            assert logprobs is not None and sample.request is not None  # logprobs are computed when requested
            sample.output_logprobs.append(self._logprob_entry(logprobs, tok, sample.request.params.logprobs))
            sample.cumulative_logprob += float(logprobs[tok])
        if seq.grammar is not None:
            self._consume(seq, tok)
        self._check_stop(seq, tok)

    # ---- structured outputs ------------------------------------------------------------------------
    def _consume(self, seq: Sequence, tok: int) -> None:
        if not structured_output.consume(seq, tok):
            assert seq.grammar is not None
            logger.warning("structured output: sequence %d: token %d rejected by its grammar: %s", seq.seq_id, tok,
                           seq.grammar.matcher.get_error())

    def _next_masks(self, seqs: list[Sequence]) -> None:
        """The next-step masks of constrained sequences that go on, in one batch; with forcing on, a sequence
        whose mask allows one token only gets it appended now (computed next step as part of a chunk)."""
        while seqs:
            self.structured.fill_masks(seqs)
            if not self.enable_forced_tokens:
                return
            forced = []
            for seq, tok in zip(seqs, self.structured.single_tokens(seqs)):
                if tok is None:
                    continue
                seq.append(tok)
                self.counters["generated_tokens"] += 1
                self.counters["forced_tokens"] += 1
                if seq.sample.output_logprobs is not None:  # the only token the mask allows: probability 1
                    seq.sample.output_logprobs.append({tok: Logprob(0.0, 1, self.tokenizer.decode([tok]))})
                self._consume(seq, tok)
                self._check_stop(seq, tok)
                if seq.sample.finish_reason is None:
                    forced.append(seq)
            seqs = forced

    def _check_stop(self, seq: Sequence, tok: int) -> None:
        sample = seq.sample
        req = sample.request
        assert req is not None
        p = req.params
        n_out = seq.num_output_tokens
        may_stop = n_out >= p.min_tokens  # no stop of any kind before min_tokens
        if req.needs_text_each_step:
            delta = detokenizer.update(self.tokenizer, seq, p.skip_special_tokens)
            if p.stop and delta and may_stop:
                text = seq.detok.text
                window = max(map(len, p.stop)) + len(delta)
                lo = max(0, len(text) - window)
                hits = [(text.find(s, lo), s) for s in p.stop]
                hits = [(i, s) for i, s in hits if i >= 0]
                if hits:
                    i, s = min(hits)
                    detokenizer.cut(seq, i + len(s) if p.include_stop_str_in_output else i)
                    sample.finish_reason, sample.stop_reason = "stop", s
        g = seq.grammar
        if sample.finish_reason is None and g is not None and g.matcher.is_stopped():
            # The grammar is complete (nothing but EOS may follow): a finished, valid output. A matcher in an
            # error state (a bug: a token outside its mask) ends the sample as aborted, never as "stop".
            if g.matcher.is_error():
                sample.finish_reason, sample.stop_reason = "abort", "structured output error"
            else:
                sample.finish_reason = "stop"
                if tok in self.eos_ids or tok in p.stop_token_ids:
                    sample.stop_reason = tok if tok in p.stop_token_ids else None
        if sample.finish_reason is None and may_stop:
            if tok in p.stop_token_ids:
                sample.finish_reason, sample.stop_reason = "stop", tok
            elif not p.ignore_eos and tok in self.eos_ids:
                sample.finish_reason = "stop"
        if sample.finish_reason is None and (n_out >= p.max_tokens or seq.num_tokens >= self.max_model_len):
            sample.finish_reason = "length"
        if sample.finish_reason is not None:
            self.finish_seq(seq)

    # ---- logprobs --------------------------------------------------------------------------------
    def _logprob_entry(self, row: torch.Tensor, tok: int, k: int | None) -> dict[int, Logprob]:
        entry: dict[int, Logprob] = {}
        if k:
            vals, idx = torch.topk(row, k)
            for rank, (t, v) in enumerate(zip(idx.tolist(), vals.tolist()), start=1):
                entry[t] = Logprob(v, rank, self.tokenizer.decode([t]))
        if tok not in entry:
            lp = float(row[tok])
            rank = int((row > lp).sum()) + 1
            entry[tok] = Logprob(lp, rank, self.tokenizer.decode([tok]))
        return entry

    def _record_prompt_logprobs(self, seq: Sequence, logits, first_row: int, pos: int) -> None:
        req = seq.sample.request
        assert req is not None and req.prompt_logprobs is not None  # scored rows are for prompt_logprobs requests
        k = req.params.prompt_logprobs
        hi = min(seq.kv.num_computed_tokens, seq.sample.prompt_len - 1)
        lps = torch.log_softmax(logits[first_row : first_row + (hi - pos)], dim=-1)
        for j, p in enumerate(range(pos, hi)):
            tok = seq.token_ids[p + 1]
            req.prompt_logprobs[p + 1 - req.prompt_logprob_start] = self._logprob_entry(lps[j], tok, k)

    # ---- outputs ----------------------------------------------------------------------------------
    def make_output(self, req: Request) -> RequestOutput:
        outs = [
            CompletionOutput(
                index=s.index,
                text=seq.detok.text,
                token_ids=seq.token_ids[s.prompt_len :],
                finish_reason=s.finish_reason,
                stop_reason=s.stop_reason,
                logprobs=list(s.output_logprobs) if s.output_logprobs is not None else None,
                cumulative_logprob=s.cumulative_logprob if s.output_logprobs is not None else None,
            )
            for seq, s in ((seq, seq.sample) for seq in req.seqs)
        ]
        metrics = {"arrival_time": req.arrival_time}
        if req.first_token_time is not None:
            metrics["first_token_time"] = req.first_token_time
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=outs,
            finished=req.finished,
            num_cached_tokens=req.num_cached_tokens,
            prompt_logprobs=list(req.prompt_logprobs) if req.prompt_logprobs is not None else None,
            metrics=metrics,
        )
