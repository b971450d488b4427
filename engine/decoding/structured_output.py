"""Structured outputs: generation constrained to a JSON schema, a regex, a choice of strings or a Lark grammar.

`StructuredOutputsParams` (in SamplingParams.structured_outputs, vLLM's names) says what the output must match.
At submission `StructuredOutputManager.compile` turns it into an llguidance grammar and a template matcher
(a ValueError naming the field on a bad spec, a too large spec, or a compile that runs too long); compiled
templates are cached by spec. Each constrained sequence owns an `llguidance.LLMatcher` (a deep copy of the
template; n > 1 samples deep-copy their parent's) in `seq.grammar.matcher`, and the token mask of its next step in
`seq.grammar.mask` (an int32 bitmask row, one bit per token id). This module is the only writer of a sequence's
`grammar` part (engine/request/sequence.py's GrammarState): `constrain`, `fork`, `consume` and `release` below, and the
manager's mask computation.

The matcher advances only on tokens appended to the sequence (sampled or forced), never on computation, so
recomputation after preemption leaves it alone. After a sequence's tokens are consumed, the mask of its next
step is computed at once (all constrained rows of the step in one batch); a row whose mask allows exactly one
token (the grammar forces it) gets that token appended without sampling when forcing is on: it is then
computed as part of a prefill chunk. A forced token is exactly what sampling under the mask would have picked
(the only allowed token), so greedy output is the same with forcing on and off.

With speculative decoding (engine/decoding/spec_decode.py), a constrained sequence's drafts are cut to what its grammar
accepts (`draft_prefix`), and `apply_drafts` masks each draft row by the grammar's state after the drafts before
it; the matcher still advances only on the tokens emitted.

Unconstrained rows pay nothing: no mask work unless some row of the step is constrained.
"""

from __future__ import annotations

import collections
import concurrent.futures
import copy
import json
import logging
import threading
import time
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from . import json_bounds
from ..request.sequence import GrammarState, Matcher, Sequence

if TYPE_CHECKING:
    import llguidance
    from llguidance._lib import JsonCompileOptions

logger = logging.getLogger("flowrt.engine")

MAX_SPEC_BYTES = 64 * 1024  # a schema / regex / grammar / choice list larger than this is refused
COMPILE_TIMEOUT_S = 10.0  # a compile that runs longer is refused
_KINDS = ("json", "regex", "choice", "grammar", "json_object")


class StructuredOutputsParams(BaseModel):
    """Exactly one of: `json` (a JSON schema, as a dict or a JSON string), `regex`, `choice` (a list of strings:
    the output is one of them), `grammar` (a Lark grammar in llguidance's dialect), `json_object=True` (any
    JSON object). For JSON (engine/decoding/json_bounds.py):

    * `disable_any_whitespace` (default True here): generated compact (no free whitespace between tokens),
      which keeps small models from padding forever; False allows whitespace, at most 24 characters a gap;
    * `strict` (default True): an object that names its properties and does not say
      ``additionalProperties`` gets only those (False: any other keys too, as JSON Schema reads it);
    * `bound_numbers` (default True): an integer without bounds stays within the signed 64-bit range, a
      number without bounds has at most 17 digits and a 3-digit exponent; False lifts these bounds."""

    json_: dict | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = True
    strict: bool = True
    bound_numbers: bool = True

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    @model_validator(mode="after")
    def _exactly_one(self) -> "StructuredOutputsParams":
        given = [k for k in _KINDS if self._value(k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"give exactly one of json, regex, choice, grammar, json_object (got "
                             f"{', '.join(given) or 'none'})")
        if self.choice is not None and (not self.choice or any(not isinstance(c, str) or not c for c in self.choice)):
            raise ValueError("choice must be a non-empty list of non-empty strings")
        return self

    def _value(self, kind: str):
        return self.json_ if kind == "json" else getattr(self, kind)

    @property
    def json(self):  # noqa: A003 - vLLM's name
        return self.json_

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if self._value(k) not in (None, False))

    def spec_text(self) -> str:
        """The constraint as one canonical string (the cache key's body and what the size cap measures)."""
        kind = self.kind
        if kind == "json":
            v = self.json_
            if isinstance(v, dict):
                return json.dumps(v, separators=(",", ":"))
            assert v is not None  # the validator: exactly one kind is given
            return v
        if kind == "choice":
            return json.dumps(self.choice)
        if kind == "json_object":
            return '{"type":"object"}'
        return self._value(kind)


def _grammar(p: StructuredOutputsParams) -> str:
    """The llguidance grammar (a JSON string) for a spec; raises ValueError for a malformed spec."""
    import llguidance

    kind = p.kind
    if kind in ("json", "json_object"):
        text = p.spec_text()
        try:
            schema = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"not valid JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError(f"a JSON schema must be an object, got {type(schema).__name__}")
        if p.strict:
            schema = json_bounds.close_objects(schema)
        if p.bound_numbers:
            schema = json_bounds.bound_integers(schema)
            if json_bounds.needs_lark(schema):
                return llguidance.LLMatcher.grammar_from_lark(
                    json_bounds.lark_grammar(schema, compact=p.disable_any_whitespace))
        opts: JsonCompileOptions = {"whitespace_flexible": not p.disable_any_whitespace}
        if p.disable_any_whitespace:
            opts["item_separator"] = ", "
            opts["key_separator"] = ": "
        else:
            opts["whitespace_pattern"] = json_bounds.WHITESPACE
        return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=opts)
    if kind == "regex":
        assert p.regex is not None
        return llguidance.LLMatcher.grammar_from_regex(p.regex)
    if kind == "choice":
        assert p.choice is not None
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in p.choice))
    assert p.grammar is not None
    return llguidance.LLMatcher.grammar_from_lark(p.grammar)


def unpack_mask(mask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[R, W] int32 bitmask -> [R, vocab] bool (True = allowed)."""
    shifts = torch.arange(32, dtype=torch.int32)
    bits = (mask.unsqueeze(-1) >> shifts) & 1
    return bits.view(mask.shape[0], -1)[:, :vocab].bool()


def _tokenizer_json(tokenizer) -> str:
    """tokenizer.json text of a fast tokenizer (flowrt's or transformers'), padding and truncation off: what
    ``llguidance.hf.from_tokenizer`` passes to LLTokenizer, without that module's transformers import."""
    backend = copy.copy(getattr(tokenizer, "backend_tokenizer", None))
    if backend is None:
        raise ValueError("structured outputs need a fast tokenizer (one with a tokenizer.json)")
    backend.no_padding()
    backend.no_truncation()
    return backend.to_str()


class StructuredOutputManager:
    """One per engine: the llguidance tokenizer (built on first use), the compile cache, mask computation."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: tuple[int, ...], cache_size: int = 128,
                 max_spec_bytes: int = MAX_SPEC_BYTES, compile_timeout_s: float = COMPILE_TIMEOUT_S):
        self.hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = eos_ids
        self.max_spec_bytes = max_spec_bytes
        self.compile_timeout_s = compile_timeout_s
        self._ll_tokenizer = None
        self._lock = threading.Lock()
        self._cache: collections.OrderedDict[tuple[str, str, bool, bool, bool], Any] = collections.OrderedDict()
        self._cache_size = cache_size
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._executor: llguidance.LLExecutor | None = None  # made with the tokenizer
        self.width = (vocab_size + 31) // 32  # int32 words per mask row (set again once the tokenizer is built)
        self.compile_seconds: list[float] = []  # uncached compiles (bench)
        self.mask_seconds = 0.0
        self.mask_rows = 0
        self.mask_log: collections.deque[tuple[float, int]] = collections.deque(maxlen=100_000)  # (s, rows)

    # ---- tokenizer ------------------------------------------------------------------------------------
    @property
    def ll_tokenizer(self):
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance

                n_vocab = max(self.vocab_size, len(self.hf_tokenizer))
                eos = list(self.eos_ids) or self.hf_tokenizer.eos_token_id
                self._ll_tokenizer = llguidance.LLTokenizer(_tokenizer_json(self.hf_tokenizer), n_vocab=n_vocab,
                                                            eos_token=eos)
                self.width = (self._ll_tokenizer.vocab_size + 31) // 32
                self._executor = llguidance.LLExecutor()
            return self._ll_tokenizer

    # ---- compile (submission) -----------------------------------------------------------------------
    def compile(self, p: StructuredOutputsParams, use_cache: bool = True) -> Matcher:
        """A fresh matcher for a request with constraint `p` (ValueError "structured_outputs.KIND: ...")."""
        kind = p.kind
        field = f"structured_outputs.{kind}"
        text = p.spec_text()
        if len(text.encode()) > self.max_spec_bytes:
            raise ValueError(f"{field}: the spec is {len(text.encode())} bytes, more than the limit of "
                             f"{self.max_spec_bytes}")
        key = (kind, text, p.disable_any_whitespace, p.strict, p.bound_numbers)
        if use_cache:
            with self._lock:
                tmpl = self._cache.get(key)
                if tmpl is not None:
                    self._cache.move_to_end(key)
                    return tmpl.deep_copy()
        tok = self.ll_tokenizer
        t0 = time.perf_counter()
        try:
            grammar = _grammar(p)
        except ValueError as e:
            raise ValueError(f"{field}: {e}") from None
        with self._lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="flowrt-grammar")
        fut = self._pool.submit(_new_matcher, tok, grammar)
        try:
            m = fut.result(timeout=self.compile_timeout_s)
        except concurrent.futures.TimeoutError:
            raise ValueError(f"{field}: compiling the constraint took longer than {self.compile_timeout_s:g} s "
                             "(simplify it)") from None
        self.compile_seconds.append(time.perf_counter() - t0)
        if m.is_error():
            raise ValueError(f"{field}: {m.get_error().strip()}")
        if use_cache:
            with self._lock:
                self._cache[key] = m
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
            return m.deep_copy()
        return m

    # ---- masks (engine step) ------------------------------------------------------------------------
    def fill_masks(self, seqs: list[Sequence]) -> None:
        """Computes the mask of every (constrained) sequence in `seqs` (their matchers' next-token masks), in one
        batch."""
        if not seqs:
            return
        t0 = time.perf_counter()
        mask = torch.empty((len(seqs), self.width), dtype=torch.int32)
        grammars = [_grammar_of(s) for s in seqs]
        if len(seqs) == 1:
            row = mask[0]
            grammars[0].matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)
        else:
            assert self._executor is not None  # matchers exist only once the tokenizer (and executor) does
            # (GrammarState holds the Matcher protocol; every matcher this manager compiles is an LLMatcher)
            jobs = cast("list[tuple[llguidance.LLMatcher, int]]", [(g.matcher, i) for i, g in enumerate(grammars)])
            self._executor.unsafe_compute_mask_ptr(jobs,
                                                   mask.data_ptr(), self.width * 4, len(seqs))
        for i, g in enumerate(grammars):
            g.mask = mask[i]
        dt = time.perf_counter() - t0
        self.mask_seconds += dt
        self.mask_log.append((dt, len(seqs)))
        self.mask_rows += len(seqs)

    @torch.inference_mode()
    def apply(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        """Masks, in place, the logit rows of constrained sequences to the tokens their grammars allow."""
        rows = [r for r, s in enumerate(seqs) if s.grammar is not None]
        if not rows:
            return
        missing = [seqs[r] for r in rows if _grammar_of(seqs[r]).mask is None]
        self.fill_masks(missing)
        t0 = time.perf_counter()
        V = logits.shape[1]
        allowed = unpack_mask(torch.stack([_mask_of(seqs[r]) for r in rows]), V)
        if len(rows) == len(seqs):
            logits.masked_fill_(~allowed, float("-inf"))
        else:
            idx = torch.tensor(rows, dtype=torch.long)
            logits[idx] = logits[idx].masked_fill(~allowed, float("-inf"))
        self.mask_seconds += time.perf_counter() - t0

    @torch.inference_mode()
    def apply_drafts(self, logits: torch.Tensor, spec_rows: list) -> None:
        """Speculative decoding (engine/decoding/spec_decode.py): the rows of a constrained sequence's drafts are masked
        by its grammar's state after the drafts before them (row j: after j drafts; the drafts were cut to
        what the grammar accepts when proposed), so that checking a draft sees the distribution decoding
        without drafts would; the sample row's mask (after all drafts) becomes the grammar's mask for apply().
        spec_rows: (seq, first row in `logits`, drafts) as the scheduler planned them."""
        todo = [(seq.grammar, seq, first, m) for seq, first, m in spec_rows
                if seq.grammar is not None and seq.spec.num_draft_tokens == m]  # (finishing strips a seq's drafts)
        if not todo:
            return
        t0 = time.perf_counter()
        n = sum(m + 1 for _, _, _, m in todo)
        mask = torch.zeros((n, self.width), dtype=torch.int32)
        jobs, k = [], 0
        for g, seq, _, m in todo:
            jobs.append((g.matcher, k, seq.token_ids[seq.num_tokens - m:]))
            k += m + 1
        # each matcher consumes its drafts one by one, writing the mask of every state, and rolls them back
        assert self._executor is not None
        self._executor.unsafe_compute_mask_ptr_with_draft_token(jobs, mask.data_ptr(), self.width * 4, n)
        allowed = unpack_mask(mask, logits.shape[1])
        k = 0
        for g, _, first, m in todo:
            logits[first:first + m + 1].masked_fill_(~allowed[k:k + m + 1], float("-inf"))
            g.mask = mask[k + m]
            k += m + 1
        dt = time.perf_counter() - t0
        self.mask_seconds += dt
        self.mask_log.append((dt, n))
        self.mask_rows += n

    @staticmethod
    def single_tokens(seqs: list[Sequence]) -> list[int | None]:
        """For each (constrained) sequence, the one token its mask allows, or None when it allows several (or
        none)."""
        mask = torch.stack([_mask_of(s) for s in seqs]).numpy().view(np.uint32)
        nz = mask != 0
        out: list[int | None] = [None] * len(seqs)
        cand = np.flatnonzero(nz.sum(axis=1) == 1)
        for i in cand.tolist():
            w = int(np.flatnonzero(nz[i])[0])
            word = int(mask[i, w])
            if word & (word - 1) == 0:
                out[i] = w * 32 + word.bit_length() - 1
        return out

    def stats(self) -> dict:
        return {"structured_mask_seconds": self.mask_seconds, "structured_mask_rows": self.mask_rows}


# ---- a sequence's grammar state ---------------------------------------------------------------------------
def constrain(seq: Sequence, matcher: Matcher | None) -> None:
    """seq's request samples under `matcher` from now on (None: unconstrained)."""
    seq.grammar = GrammarState(matcher) if matcher is not None else None


def fork(parent: Sequence, child: Sequence) -> None:
    """child (a new sample of parent's request) continues the grammar from parent's state."""
    g = parent.grammar
    child.grammar = GrammarState(g.matcher.deep_copy(), g.mask) if g is not None else None


def consume(seq: Sequence, tok: int) -> bool:
    """A constrained sequence emitted tok: its grammar advances (its mask is then unknown). False: the grammar
    rejects it."""
    g = _grammar_of(seq)
    g.mask = None
    return g.matcher.consume_token(tok)


def release(seq: Sequence) -> None:
    """seq's sample is done: its grammar state goes."""
    seq.grammar = None


def _grammar_of(seq: Sequence) -> GrammarState:
    g = seq.grammar
    if g is None:
        raise ValueError(f"sequence {seq.seq_id} is not constrained")
    return g


def _mask_of(seq: Sequence) -> torch.Tensor:
    m = _grammar_of(seq).mask
    if m is None:
        raise ValueError(f"sequence {seq.seq_id}'s grammar mask is not computed")
    return m


def draft_prefix(matcher: Matcher, tokens: list[int]) -> int:
    """How many of `tokens` (speculative drafts) the grammar accepts in a row, the last one at most the token
    that completes it; the matcher is left as it was."""
    n = matcher.try_consume_tokens(tokens)
    if n:
        matcher.rollback(n)
    return n


def _new_matcher(tok, grammar: str):
    import llguidance

    return llguidance.LLMatcher(tok, grammar, log_level=0)
