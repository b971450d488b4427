"""Engine-side state of sequences and requests.

A `Sequence` is a token list plus the KV blocks that hold the first `kv.num_computed_tokens` of them. It may
outlive a request (an open sequence handle) and be forked. A `Request` is one call to generate: its
parameters and the sequences that sample for it (n > 1 forks the prompt's sequence once it is prefilled).

A sequence's state is split into parts, each written by one module only (others read it):

- the tokens (`token_ids`): this module, through `append`/`extend`/`truncate`/`replace_last`, called by whoever
  produces tokens (the output processor, open sequences, speculative drafts, beam search);
- `sched` (`SchedState`): engine/core/scheduler.py (status, queue times, the program context);
- `kv` (`KVState`): engine/kv/cache_manager.py (blocks, computed tokens, block hashes);
- `sample` (`SampleState`): engine/core/output_processor.py (the request it samples for and what it emitted);
- `detok` (`DetokState`): engine/core/detokenizer.py (the text so far);
- `spec` (`SpecState`): engine/decoding/spec_decode.py (the unverified drafts at the end of the tokens);
- `grammar` (`GrammarState`, None when unconstrained): engine/decoding/structured_output.py.

tests/engine/test_sequence_owners.py checks, statically, that no other engine module writes a part.
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Protocol

import torch

from .outputs import FinishReason, Logprob
from .program import ProgramContext

if TYPE_CHECKING:  # sampling_params -> structured_output -> this module
    from ..core.sampling_params import SamplingParams


class SeqStatus(enum.Enum):
    IDLE = "idle"  # open handle, no request; may hold KV blocks
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"  # finished a request and is not kept open
    CLOSED = "closed"


class Matcher(Protocol):
    """What the engine uses of a grammar matcher (llguidance.LLMatcher)."""

    def consume_token(self, token: int) -> bool: ...
    def try_consume_tokens(self, tokens: list[int]) -> int: ...
    def rollback(self, num_tokens: int) -> bool: ...
    def is_stopped(self) -> bool: ...
    def is_error(self) -> bool: ...
    def get_error(self) -> str: ...
    def deep_copy(self) -> "Matcher": ...
    def unsafe_compute_mask_ptr(self, trg_ptr: int, trg_bytes: int) -> None: ...


@dataclass(eq=False, slots=True)
class SchedState:
    """Written by the scheduler."""

    status: SeqStatus = SeqStatus.IDLE
    program: ProgramContext | None = None  # run, step, thread and state (engine/request/program.py)
    idle_since: float = 0.0  # when it last became idle (monotonic)
    enqueued_at: float = 0.0  # when it last joined the waiting queue (monotonic)
    enqueued_step: int = 0  # scheduler step at which it last joined the waiting queue


@dataclass(eq=False, slots=True)
class KVState:
    """Written by the KV cache manager."""

    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_hashes: list[bytes] = field(default_factory=list)  # content hashes of full blocks (prefix-named)
    num_registered_blocks: int = 0  # leading blocks of block_table already in the prefix cache
    max_computed_tokens: int = 0  # high-water mark of num_computed_tokens: below it, computing is recomputing


@dataclass(eq=False, slots=True)
class SampleState:
    """One request's sampling state of a sequence (a fresh one per request). Written by the output processor."""

    request: "Request | None" = None
    index: int = 0  # which of the request's samples
    prompt_len: int = 0
    generator: torch.Generator | None = None
    output_logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None


@dataclass(eq=False, slots=True)
class DetokState:
    """Incremental detokenization. Written by engine/core/detokenizer.py."""

    text: str = ""
    prefix: int = 0
    read: int = 0


@dataclass(eq=False, slots=True)
class SpecState:
    """Written by speculative decoding (engine/decoding/spec_decode.py)."""

    num_draft_tokens: int = 0  # the last tokens are unverified drafts


@dataclass(eq=False, slots=True)
class GrammarState:
    """A constrained sample's grammar. Written by engine/decoding/structured_output.py."""

    matcher: Matcher
    mask: torch.Tensor | None = None  # the matcher's next-token bitmask (int32 row), once computed


_seq_ids = itertools.count()


@dataclass(eq=False, slots=True)
class Sequence:
    token_ids: list[int]
    persistent: bool = False  # an open handle: keeps its blocks between requests
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    sched: SchedState = field(default_factory=SchedState)
    kv: KVState = field(default_factory=KVState)
    sample: SampleState = field(default_factory=SampleState)
    detok: DetokState = field(default_factory=DetokState)
    spec: SpecState = field(default_factory=SpecState)
    grammar: GrammarState | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.sample.prompt_len :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.sample.prompt_len

    # ---- the tokens --------------------------------------------------------------------------------------
    def append(self, token: int) -> None:
        self.token_ids.append(token)

    def extend(self, tokens: list[int]) -> None:
        self.token_ids.extend(tokens)

    def truncate(self, num_tokens: int) -> None:
        """Keep the first num_tokens tokens (the caller forgets what the KV state derived from the rest)."""
        del self.token_ids[num_tokens:]

    def replace_last(self, token: int) -> None:
        self.token_ids[-1] = token


@dataclass(eq=False)
class Request:
    request_id: str
    params: SamplingParams
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[Sequence]
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    num_cached_tokens: int = 0
    scheduled: bool = False  # has been in a step (num_cached_tokens is then known)
    forked: bool = False  # n > 1: the samples have been forked off the prompt's sequence
    finished: bool = False
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    prompt_logprob_start: int = 0  # absolute position of the first token whose logprob is reported
    on_output: Callable[["Request"], Any] | None = None  # called (engine thread) after each step
    on_error: Callable[[BaseException], Any] | None = None  # called instead when the engine fails it
    needs_text_each_step: bool = False
