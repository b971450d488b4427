"""Scheduling policies: what differs between "fcfs" and "program" in the scheduler's one step.

The scheduler (engine/core/scheduler.py) runs one loop for running sequences and one admission loop; a policy
answers the questions the loops ask (as vLLM v1's one `schedule()` asks its policy for the queue order and
the preemption victim, and SGLang's schedule_policy ranks the waiting queue for its one admission path):

- `starved`: which waiting sequences go before everything (and may preempt);
- `rank`: how the waiting queue is ordered (and which cached prefixes it will hit);
- `victim`: which running sequence is preempted when memory runs out;
- `skip_unfit`: whether a waiting sequence that cannot get memory is skipped (the rest of the queue is
  still tried) or blocks the queue behind it;
- `idle_to_release`: which idle open sequence gives up its KV next;
- `admission_may_take_retained`: whether admitting new work may take KV that will be used again;
- `room_to_enter`: whether memory leaves room for a thread entering it (new, or back without its KV)
  to grow.

A policy reads the scheduler's state and answers with a decision (a `Ranking`, a victim, a `Release`); the
scheduler applies it. No policy changes the queue, the pool or a sequence.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from ..kv.block_pool import BlockHash
from ..request.program import ProgramState
from ..request.sequence import Sequence

if TYPE_CHECKING:
    from .scheduler import Scheduler

SERVICE_QUANTUM = 2048  # tokens: attained-service level 0 is [0, Q), then [Q, 4Q), [4Q, 16Q), ...


@dataclass
class Ranking:
    """The waiting queue's new order, and the prefix-cache hashes it will hit (evicted last)."""

    order: list[Sequence]
    protected: set[BlockHash]


class Release(NamedTuple):
    """An idle sequence to free, and whether its cached blocks go to the prefix cache with low priority."""

    seq: Sequence
    low_priority: bool


class FcfsPolicy:
    """vLLM's: first come first served; the queue blocks at the first request that cannot get memory;
    idle KV is released least recently used first; the most recently admitted running sequence is
    preempted."""

    name = "fcfs"
    skip_unfit = False

    def __init__(self, sched: "Scheduler"):
        self.sched = sched

    def starved(self, seq: Sequence) -> bool:
        return False

    def rank(self) -> Ranking | None:
        """Arrival order (a preempted sequence was put back at the front): no change."""
        return None

    def victim(self, candidates: list[Sequence]) -> Sequence:
        return candidates[-1]

    def idle_to_release(self, expendable_only: bool) -> Release | None:
        """The least recently used idle sequence holding blocks."""
        for seq in self.sched.idle.values():
            if seq.kv.block_table:
                return Release(seq, False)
        return None

    def admission_may_take_retained(self, alone: bool) -> bool:
        return True

    def room_to_enter(self, seq: Sequence, n: int) -> bool:
        return True


class ProgramPolicy(FcfsPolicy):
    """Uses what requests say about their workflow run, step and thread (see engine/core/scheduler.py's module
    docstring for the rules)."""

    name = "program"
    skip_unfit = True

    def starved(self, seq: Sequence) -> bool:
        return self.sched.step_no - seq.sched.enqueued_step >= self.sched.max_wait_steps

    def _level(self, seq: Sequence) -> tuple[int, float]:
        """(attained-service level of seq's run, the run's age key): lower goes first."""
        run = seq.sched.program.run_id if seq.sched.program is not None else None
        rec = self.sched.tracker.runs.get(run) if run is not None else None
        if rec is None:
            return 0, seq.sched.enqueued_at
        q = rec.service_tokens // SERVICE_QUANTUM
        return (q.bit_length() + 1) // 2, rec.first_seen

    def rank(self) -> Ranking:
        """The waiting queue sorted (best first), and the cached prefixes it will hit."""
        s = self.sched
        kv = s.kv
        protected: set[BlockHash] = set()
        keys = {}
        for seq in s.waiting:
            hashes = kv.cached_prefix_hashes(seq) if s.enable_prefix_caching else []
            protected.update(hashes)
            if self.starved(seq):
                keys[seq.seq_id] = (0, seq.sched.enqueued_step, 0, 0.0, seq.sched.enqueued_at)
                continue
            ready = seq.kv.num_computed_tokens + len(hashes) * kv.block_size
            quarter = (4 * ready) // max(1, seq.num_tokens)
            level, age = self._level(seq)
            keys[seq.seq_id] = (1, level, -quarter, age, seq.sched.enqueued_at)
        return Ranking(sorted(s.waiting, key=lambda q: keys[q.seq_id]), protected)

    def victim(self, candidates: list[Sequence]) -> Sequence:
        """The lowest ranked: not admitted for starving, most service, newest run, newest."""
        boosted = self.sched.boosted

        def key(seq: Sequence):
            level, age = self._level(seq)
            return (seq.seq_id not in boosted, level, age, seq.sched.enqueued_at)
        return max(candidates, key=key)

    def idle_to_release(self, expendable_only: bool) -> Release | None:
        """The idle sequence used again last: a finished thread (longest idle first, to the prefix cache
        with low priority), else the waiting one whose expected next use is farthest. `expendable_only`:
        finished, context-less or overdue ones only."""
        tracker = self.sched.tracker
        now = time.monotonic()
        best, best_key = None, None
        for seq in self.sched.idle.values():
            if not seq.kv.block_table:
                continue
            waited = now - seq.sched.idle_since
            if seq.sched.program is not None and seq.sched.program.state is ProgramState.FINISHED:
                key = (2, waited)
            elif expendable_only and seq.sched.program is not None and not tracker.overdue(waited):
                continue  # a thread between calls (no context: no promise, so it may go)
            else:
                key = (1, tracker.expected_return_s(waited))
            if best_key is None or key > best_key:
                best, best_key = seq, key
        if best is None:
            return None
        assert best_key is not None  # set with best
        return Release(best, best_key[0] == 2)

    def admission_may_take_retained(self, alone: bool) -> bool:
        """New work never takes KV that will be used again, unless nothing runs."""
        return alone

    def room_to_enter(self, seq: Sequence, n: int) -> bool:
        """A thread entering memory (new, or back after its KV was evicted or preempted) is admitted only
        if memory also leaves room for the threads already resident (running, or idle and waiting) and for
        itself to grow to their expected final length: otherwise their growth would later take a waiting
        thread's KV (recomputed when that thread returns), and the pool thrashes. A step's expected length
        is learned from its earlier requests: the median length of its threads now open (a typical thread
        gets at least that far), or the typical length of its closed threads where that is longer."""
        s = self.sched
        entering = seq.kv.max_computed_tokens == 0 or seq.kv.num_computed_tokens < seq.kv.max_computed_tokens
        if seq.sched.program is None or not entering:
            return True
        resident = list(s.running) + [q for q in s.idle.values() if q.sched.program is not None
                                      and q.sched.program.state is not ProgramState.FINISHED]
        lengths: dict[str | None, list[int]] = {}
        for q in (*resident, *s.waiting):
            if q.sched.program is not None:
                lengths.setdefault(q.sched.program.step, []).append(q.num_tokens)
        median = {step: sorted(ls)[len(ls) // 2] for step, ls in lengths.items()}
        bs = s.kv.block_size

        def growth(q: Sequence) -> int:
            if q.sched.program is None:
                return 0
            est = max(s.tracker.expected_final(q.sched.program.step) or 0, median.get(q.sched.program.step, 0))
            return max(0, int(est) - q.num_tokens + bs - 1) // bs

        reserve = growth(seq) + s.kv.blocks_needed(seq, n) + sum(growth(q) for q in resident)
        return s.kv.pool.num_free >= reserve


POLICIES = {p.name: p for p in (FcfsPolicy, ProgramPolicy)}
