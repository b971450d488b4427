"""Speculative decoding from the context: n-gram prompt lookup (vLLM's `ngram` method), verified exactly.

Before a step, a decoding sequence whose last `n` tokens (prompt_lookup_max down to prompt_lookup_min) occurred
earlier in its own tokens (prompt and output, so a fork drafts from its own history) gets the tokens that
followed that occurrence appended as drafts (at most num_speculative_tokens). Where its own tokens have no such
match, the same lookup runs over the outputs of recently finished requests (the suffix cache,
engine/decoding/ngram_index.py: repeated output structures, e.g. a JSON template); where that finds none either, and a
row is cheap by the adaptive rule, what followed the latest earlier occurrence of its last token alone (at most
fallback_tokens). The lookups use per-sequence n-gram indices updated as tokens append (engine/decoding/ngram_index.py),
not a scan of the context.

The step computes the pending token and the drafts together, with logits for every one of them (the scheduler
plans the rows, and trims drafts it could not schedule). Then, per draft in order, against the target
distribution p of its row:
- greedy: accepted while it is the argmax; the first mismatch is replaced by the argmax. Output is token for
  token what decoding without drafts gives.
- sampled: the standard rule for a deterministic proposal: accepted with probability p(draft); on rejection
  the token is drawn from p without the draft, renormalized. If every draft passes, the last row's sample
  (the ordinary one) follows them. Each token's distribution is exactly p.
Rejected drafts' KV is rolled back (num_computed_tokens truncated, blocks past it released, block hashes
trimmed, all by the KV cache manager); blocks holding unverified drafts are never registered in the prefix cache.
This module is the only writer of a sequence's `spec` part (SpecState: how many of its last tokens are drafts).

Structured output: a constrained sequence's draft is cut at the first token its grammar does not accept (and
after one that completes it); `grammar_rejected_tokens` counts the tokens cut. Each row of its drafts is then
masked by the grammar state after the drafts before it (StructuredOutputManager.apply_drafts), so both rules
above see the constrained distribution decoding without drafts samples from; the emitted tokens advance the
matcher as usual (and a token the grammar then forces is appended without the model, as without drafts).

Sequences draft only where every row's distribution is the plain one or a grammar's: no
repetition/presence/frequency penalty, min_tokens already reached. Others decode as before. A sequence with tokens
its grammar forced after its pending one (not yet computed) drafts after them: the step computes the pending token,
the forced ones and the drafts, and the drafts are checked on the rows after the last forced token.

How many drafts a step takes (`adaptive`, the default): engine/decoding/spec_policy.py's DraftBudget, from the measured
cost of a step's rows and each sequence's acceptance rate; `adaptive: false` takes every draft found. Sampled requests
with their own seed always take every draft (their draws must not depend on timing); other sampled requests stay
distributed exactly, but which draws they get depends on the batch, as without speculation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from .ngram_index import NgramIndex, SuffixCache
from .sampler import filter_logits, greedy_tokens
from .spec_policy import Acceptance, DraftBudget
from .structured_output import draft_prefix

if TYPE_CHECKING:
    from ..core.scheduler import SchedulerOutput
    from ..decoding.sampler import SampleResult
    from ..kv.cache_manager import KVCacheManager
    from ..request.sequence import Sequence


MAX_DRAFTS = 32                      # drafts per step (num_speculative_tokens, fallback_tokens)
MAX_LOOKUP = 16                      # n-gram length (prompt_lookup_min, prompt_lookup_max)
MAX_SUFFIX_CACHE_TOKENS = 1 << 18    # 16x the default: the cache indexes every n-gram of what it keeps


class SpeculativeConfig(BaseModel):
    """vLLM's speculative_config keys for the ngram method. Every size is bounded (a field out of range is a
    ValidationError naming it and its range): an unbounded one costs memory and time in every step."""

    model_config = ConfigDict(extra="forbid")

    method: Literal["ngram"] = "ngram"
    num_speculative_tokens: int = Field(8, ge=1, le=MAX_DRAFTS)  # the engine's default; the adaptive rule trims
    # Bounded: indexing a token costs (max - min + 1) n-grams of up to max tokens, kept per running sequence
    prompt_lookup_min: int = Field(2, ge=1, le=MAX_LOOKUP)
    prompt_lookup_max: int = Field(4, ge=1, le=MAX_LOOKUP)
    # flowrt: draft only as much as the measured step cost and acceptance say pays (engine/decoding/spec_policy.py)
    adaptive: bool = True
    # flowrt: where the context has no match, draft from the outputs of recently finished requests (at most this
    # many tokens of them remembered; 0: off). Cross-request: a request's drafts may come from other requests'
    # outputs (verified like any draft, so outputs are unchanged; only step timing can tell)
    suffix_cache_tokens: int = Field(16384, ge=0, le=MAX_SUFFIX_CACHE_TOKENS)
    # flowrt: where neither found a match, up to this many drafts after the latest earlier occurrence of the last
    # token alone, in steps where the adaptive rule says a row is cheap (0: off)
    fallback_tokens: int = Field(3, ge=0, le=MAX_DRAFTS)

    @model_validator(mode="after")
    def _range(self) -> "SpeculativeConfig":
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min ({self.prompt_lookup_min}) must be <= prompt_lookup_max "
                             f"({self.prompt_lookup_max})")
        return self


def _decoding(seq: Sequence) -> bool:
    """Whether seq's uncomputed tokens are all new output: its pending sample and any tokens its grammar forced
    after it (structured output), not a prompt being prefilled nor tokens recomputed after a preemption."""
    kv = seq.kv
    return max(seq.sample.prompt_len, kv.max_computed_tokens, 1) <= kv.num_computed_tokens < seq.num_tokens


def strip_drafts(seq: Sequence, keep: int, kv: KVCacheManager) -> None:
    """Drop all but the first `keep` drafts from seq's tokens, and the hashes of blocks they reached (the
    caller rolls back their KV, if any was computed)."""
    drop = seq.spec.num_draft_tokens - keep
    if drop > 0:
        seq.truncate(seq.num_tokens - drop)
        kv.forget_hashes(seq, seq.num_tokens)
    seq.spec.num_draft_tokens = keep


@dataclass
class Verified:
    """One drafting sequence's step result: the accepted drafts (their rows' log-probabilities, when asked)
    and the token that follows them (replacing the ordinary sample)."""

    accepted: list[int]
    final: int
    logprob_rows: torch.Tensor | None  # [len(accepted) + 1, V]: rows of the accepted tokens, then the final


class NgramSpeculator:
    def __init__(self, cfg: SpeculativeConfig, kv: KVCacheManager, max_model_len: int):
        self.cfg = cfg
        self.kv = kv
        self.max_model_len = max_model_len
        self.draft_tokens = 0  # drafts verified (computed by a step)
        self.accepted_tokens = 0
        self.grammar_rejected_tokens = 0  # drafted tokens cut because a sequence's grammar forbids them
        self.budget = DraftBudget() if cfg.adaptive else None
        # per running sequence: its tokens' NgramIndex (the sequence kept to notice when it finishes)
        self._index: dict[int, tuple[Sequence, NgramIndex]] = {}
        self._n_lo = 1 if cfg.fallback_tokens else cfg.prompt_lookup_min
        self.suffix = (SuffixCache(cfg.suffix_cache_tokens, cfg.prompt_lookup_min, cfg.prompt_lookup_max)
                       if cfg.suffix_cache_tokens else None)
        # the adaptive rule's acceptance rates, per source of drafts (their accuracy differs: a one-token match's
        # drafts must not make a sequence's context drafts look worse); the draft in flight's source per sequence
        self._acceptance = {src: self.budget.acceptance if src == "context" else Acceptance()
                            for src in ("context", "suffix", "fallback")} if self.budget is not None else {}
        self._source: dict[int, str] = {}

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts over verified drafts (0 before any)."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    # ---- before the step ---------------------------------------------------------------------------
    def eligible(self, seq: Sequence) -> bool:
        req = seq.sample.request
        if req is None or not _decoding(seq):
            return False
        p = req.params
        return (p.repetition_penalty == 1.0 and not p.presence_penalty and not p.frequency_penalty
                and seq.num_output_tokens >= p.min_tokens)

    def propose(self, running: list[Sequence]) -> None:
        """Appends drafts to the eligible running sequences (seq.spec.num_draft_tokens of them)."""
        self._forget(running)
        base = self._base(running)
        # one-token drafts only where a row is cheap for what such drafts are accepted at (the adaptive rule)
        fallback = self.cfg.fallback_tokens > 0 and (
            self.budget is None or self.budget.pays(self._acceptance["fallback"].overall(), *base))
        found = []
        for seq in running:
            if self.eligible(seq):
                draft, src = self._draft(seq, fallback)
                if draft:
                    found.append((seq, draft, src))
        if self.budget is not None:
            found = self._budgeted(running, found, base)
        free = self.kv.pool.num_free
        for seq, draft, src in found:
            need = self.kv.blocks_needed(seq, 1 + len(draft)) - self.kv.blocks_needed(seq, 1)
            if need > free:  # drafts never take memory that would force a preemption
                continue
            free -= need
            seq.extend(draft)
            seq.spec.num_draft_tokens = len(draft)
            self._source[seq.seq_id] = src

    def _forget(self, running: list[Sequence]) -> None:
        """Drops the indices of sequences that left the batch; those that finished a request give its output to
        the suffix cache."""
        if len(self._index) <= len(running) and all(s.seq_id in self._index for s in running):
            return  # nothing left (the common step: the same batch)
        ids = {s.seq_id for s in running}
        for sid in [sid for sid in self._index if sid not in ids]:
            seq, _ = self._index.pop(sid)
            self._source.pop(sid, None)
            if (self.suffix is not None and seq.sample.finish_reason not in (None, "abort")
                    and not seq.spec.num_draft_tokens):
                self.suffix.add(seq.output_token_ids)

    def _draft(self, seq: Sequence, fallback: bool) -> tuple[list[int], str]:
        """The draft of an eligible sequence, cut to what max_tokens and max_model_len leave room for (every
        accepted draft plus the token after them must fit): what followed the latest earlier occurrence of its
        last prompt_lookup_max..prompt_lookup_min tokens in its own tokens; else in the suffix cache; else (if
        `fallback`) of its last token alone, at most fallback_tokens. A sampled request with its own seed drafts from
        its own tokens by prompt_lookup_min..max only: its random draws (consumed per draft) must not depend on other
        requests' outputs or on measured times. Returns the draft and its source."""
        req = seq.sample.request
        assert req is not None  # a running sequence samples for a request
        cfg, p = self.cfg, req.params
        room = min(cfg.num_speculative_tokens, p.max_tokens - seq.num_output_tokens - 1,
                   self.max_model_len - seq.num_tokens - 1)
        if room <= 0:
            return [], ""
        entry = self._index.get(seq.seq_id)
        if entry is None:
            entry = self._index[seq.seq_id] = (seq, NgramIndex(self._n_lo, cfg.prompt_lookup_max))
        index, tokens = entry[1], seq.token_ids
        index.extend(tokens)
        draft: list[int] = []
        src = "context"
        if (s := index.find(tokens, cfg.prompt_lookup_max, cfg.prompt_lookup_min)) is not None:
            draft = tokens[s:s + room]
        elif seq.sample.generator is None or p.greedy:  # a seeded sample's draws may depend on nothing but its tokens
            if self.suffix is not None:
                draft, src = self.suffix.draft(tokens, room), "suffix"
            if not draft and fallback and (s := index.find(tokens, 1, 1)) is not None:
                draft, src = tokens[s:s + min(room, cfg.fallback_tokens)], "fallback"
        if draft and seq.grammar is not None:  # only what the grammar allows
            ok = draft_prefix(seq.grammar.matcher, draft)
            self.grammar_rejected_tokens += len(draft) - ok
            draft = draft[:ok]
        return draft, src

    @staticmethod
    def _base(running: list[Sequence]) -> tuple[int, int]:
        """A step's rows (the running sequences' uncomputed tokens) and output tokens (a decoding sequence's pending
        token and those its grammar forced), without drafts. Fewer tokens than rows: a prefill chunk (or a recompute)
        runs."""
        rows = tokens = 0
        for s in running:
            k = s.num_tokens - s.kv.num_computed_tokens
            rows += k
            tokens += k if _decoding(s) else 0
        return rows, tokens

    def _budgeted(self, running: list[Sequence], found: list[tuple[Sequence, list[int], str]],
                  base: tuple[int, int]):
        """The drafts cut to what the DraftBudget keeps (base: _base(running)). A request with its own seed keeps
        every draft (counted as rows that pay for themselves): its random draws must not depend on measured times."""
        ids = {s.seq_id for s in running}
        for acc in self._acceptance.values():
            acc.keep_only(ids)
        assert self.budget is not None  # called only with the adaptive rule on
        fixed: list[tuple[Sequence, list[int], str]] = []
        rest: list[tuple[Sequence, list[int], str]] = []
        for f in found:
            req = f[0].sample.request
            assert req is not None
            (fixed if f[0].sample.generator is not None and not req.params.greedy else rest).append(f)
        extra = sum(len(d) for _, d, _ in fixed)
        rows, tokens = base[0] + extra, base[1] + extra
        keep = self.budget.plan([(len(d), self._acceptance[src].rate(seq.seq_id)) for seq, d, src in rest],
                                rows, tokens)
        return fixed + [(seq, d[:k], src) for (seq, d, src), k in zip(rest, keep) if k]

    def forget_outputs(self) -> None:
        """Empties the suffix cache, and forgets the sequences that would add to it (benchmarks: no request drafts
        from an earlier run of the same prompt)."""
        self._index.clear()
        self._source.clear()
        if self.suffix is not None:
            self.suffix = SuffixCache(self.suffix.max_tokens, self.cfg.prompt_lookup_min, self.cfg.prompt_lookup_max)

    def observe_step(self, rows: int, seconds: float) -> None:
        """A decode step's rows (drafts included) and wall time, for the adaptive rule's cost model."""
        if self.budget is not None:
            self.budget.cost.observe(rows, seconds)

    def observe_schedule(self, so: SchedulerOutput, seconds: float) -> None:
        """A step's cost when it was a decode step (every sequence computes one token, or its pending token and
        drafts): the other steps say nothing about the cost of drafts."""
        rows = sum(so.num_new_tokens)
        if rows == len(so.seqs) + sum(m for _, _, m in so.spec_rows):
            self.observe_step(rows, seconds)

    def verify_step(self, so: SchedulerOutput, logits: torch.Tensor, live: list[Sequence],
                    result: SampleResult | None, generator: torch.Generator) -> dict[int, Verified]:
        """Each drafting sequence of the step's drafts checked against its logit rows: {index in live: what it
        emits}. A sequence aborted while the model ran (finishing stripped its drafts) is skipped."""
        if result is None:  # nothing samples this step: every drafting sequence was aborted
            return {}
        index = {seq.seq_id: i for i, seq in enumerate(live)}
        out = {}
        for seq, first, m in so.spec_rows:
            i = index.get(seq.seq_id)
            if i is None or seq.spec.num_draft_tokens != m:
                continue
            req = seq.sample.request
            assert req is not None
            out[i] = self.verify(seq, logits[first:first + m + 1], result.token_ids[i], req.params.logprobs is not None,
                                 generator)
        return out

    # ---- after the step ----------------------------------------------------------------------------
    def verify(self, seq: Sequence, rows: torch.Tensor, sampled: int, want_logprobs: bool,
               generator: torch.Generator) -> Verified:
        """rows: [m + 1, V] processed logits: row j predicts the token after draft j (row 0: after the
        pending token). `sampled`: the ordinary sample of the last row. Leaves seq without drafts, its
        KV rolled back to the pending token and the accepted drafts."""
        m = seq.spec.num_draft_tokens
        drafts = seq.token_ids[seq.num_tokens - m:]
        req = seq.sample.request
        assert req is not None
        p = req.params
        accepted: list[int] = []
        final = sampled
        if p.greedy:
            best = greedy_tokens(rows[:m]).tolist()
            for d, b in zip(drafts, best):
                if d != b:
                    final = b
                    break
                accepted.append(d)
        else:
            probs = torch.softmax(filter_logits(rows[:m].clone(), [seq] * m), dim=-1)
            g = seq.sample.generator if seq.sample.generator is not None else generator
            for j, d in enumerate(drafts):
                if float(torch.rand(1, generator=g)) < float(probs[j, d]):
                    accepted.append(d)
                    continue
                residual = probs[j].clone()
                residual[d] = 0.0
                cdf = residual.cumsum(0)
                u = torch.rand(1, generator=g) * cdf[-1]
                final = int(torch.searchsorted(cdf, u, right=True).clamp_(max=len(cdf) - 1))
                break
        a = len(accepted)
        self.draft_tokens += m
        self.accepted_tokens += a
        src = self._source.pop(seq.seq_id, "context")
        if self.budget is not None:
            self._acceptance[src].record(seq.seq_id, m, a)
        lps = torch.log_softmax(rows[: a + 1], dim=-1) if want_logprobs else None
        # back to [.., pending]: process() appends the accepted drafts and the final token; the KV of the
        # pending token and the accepted drafts stays, the rest is rolled back
        strip_drafts(seq, 0, self.kv)
        keep = seq.num_tokens + a
        if seq.kv.num_computed_tokens > keep:
            self.kv.truncate_computed(seq, keep)
        return Verified(accepted, final, lps)
