"""Engine-side state of sequences and requests.

A `Sequence` is a token list plus the KV blocks that hold the first `num_computed_tokens` of them. It may
outlive a request (an open sequence handle) and be forked. A `Request` is one call to generate: its
parameters and the sequences that sample for it (n > 1 forks the prompt's sequence once it is prefilled).
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .outputs import Logprob
from .sampling_params import SamplingParams


class SeqStatus(enum.Enum):
    IDLE = "idle"  # open handle, no request; may hold KV blocks
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"  # finished a request and is not kept open
    CLOSED = "closed"


_seq_ids = itertools.count()


@dataclass(eq=False)
class Sequence:
    token_ids: list[int]
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_hashes: list[bytes] = field(default_factory=list)  # content hashes of full blocks (prefix-named)
    num_registered_blocks: int = 0  # leading blocks of block_table already in the prefix cache
    num_draft_tokens: int = 0  # speculative decoding: the last tokens are unverified drafts (spec_decode.py)
    status: SeqStatus = SeqStatus.IDLE
    persistent: bool = False  # an open handle: keeps its blocks between requests
    # --- program-aware scheduling (engine/program.py) ---
    program: Any = None  # ProgramContext | None: run, step, thread and state
    max_computed_tokens: int = 0  # high-water mark of num_computed_tokens: below it, computing is recomputing
    idle_since: float = 0.0  # when it last became idle (monotonic)
    enqueued_at: float = 0.0  # when it last joined the waiting queue (monotonic)
    enqueued_step: int = 0  # scheduler step at which it last joined the waiting queue

    # --- per-request sampling state (reset by Request.attach) ---
    request: "Request | None" = None
    sample_index: int = 0
    prompt_len: int = 0
    generator: torch.Generator | None = None
    output_logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    text: str = ""
    detok_prefix: int = 0
    detok_read: int = 0
    matcher: Any = None  # structured outputs: this sample's llguidance matcher (None = unconstrained)
    grammar_mask: torch.Tensor | None = None  # the matcher's next-token bitmask (int32 row), once computed

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len


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
