"""Scheduling policies: what differs between "fcfs" and "program" in the scheduler's one step.

The scheduler (engine/scheduler.py) runs one loop for running sequences and one admission loop; a policy
answers the questions the loops ask (as vLLM v1's one `schedule()` asks its policy for the queue order and
the preemption victim, and SGLang's schedule_policy ranks the waiting queue for its one admission path):

- `starved`: which waiting sequences go before everything (and may preempt);
- `rank`: how the waiting queue is ordered;
- `victim`: which running sequence is preempted when memory runs out;
- `skip_unfit`: whether a waiting sequence that cannot get memory is skipped (the rest of the queue is
  still tried) or blocks the queue behind it;
- `idle_to_release`: which idle open sequence gives up its KV next;
- `admission_may_take_retained`: whether admitting new work may take KV that will be used again;
- `room_for_new_thread`: whether memory leaves room for a new thread to grow.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from .program import ProgramState
from .sequence import Sequence

if TYPE_CHECKING:
    from .scheduler import Scheduler

SERVICE_QUANTUM = 2048  # tokens: attained-service level 0 is [0, Q), then [Q, 4Q), [4Q, 16Q), ...


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

    def rank(self) -> None:
        """Arrival order (a preempted sequence was put back at the front)."""

    def victim(self, candidates: list[Sequence]) -> Sequence:
        return candidates[-1]

    def idle_to_release(self, expendable_only: bool) -> tuple[Sequence, bool] | None:
        """(the idle sequence to free, whether its blocks go to the prefix cache with low priority)."""
        for seq in self.sched.idle.values():
            if seq.block_table:
                return seq, False
        return None

    def admission_may_take_retained(self, alone: bool) -> bool:
        return True

    def room_for_new_thread(self, seq: Sequence, n: int) -> bool:
        return True


class ProgramPolicy(FcfsPolicy):
    """Uses what requests say about their workflow run, step and thread (see engine/scheduler.py's module
    docstring for the rules)."""

    name = "program"
    skip_unfit = True

    def starved(self, seq: Sequence) -> bool:
        return self.sched.step_no - seq.enqueued_step >= self.sched.max_wait_steps

    def _level(self, seq: Sequence) -> tuple[int, float]:
        """(attained-service level of seq's run, the run's age key): lower goes first."""
        run = seq.program.run_id if seq.program is not None else None
        rec = self.sched.tracker.runs.get(run) if run is not None else None
        if rec is None:
            return 0, seq.enqueued_at
        q = rec.service_tokens // SERVICE_QUANTUM
        return (q.bit_length() + 1) // 2, rec.first_seen

    def rank(self) -> None:
        """Sort the waiting queue (best first) and protect the cached prefixes it will hit."""
        s = self.sched
        kv = s.kv
        protected = kv.pool.protected
        protected.clear()
        keys = {}
        for seq in s.waiting:
            hashes = kv.cached_prefix_hashes(seq) if s.enable_prefix_caching else []
            protected.update(hashes)
            if self.starved(seq):
                keys[seq.seq_id] = (0, seq.enqueued_step, 0, 0.0, seq.enqueued_at)
                continue
            ready = seq.num_computed_tokens + len(hashes) * kv.block_size
            quarter = (4 * ready) // max(1, seq.num_tokens)
            level, age = self._level(seq)
            keys[seq.seq_id] = (1, level, -quarter, age, seq.enqueued_at)
        ranked = sorted(s.waiting, key=lambda q: keys[q.seq_id])
        s.waiting.clear()
        s.waiting.extend(ranked)

    def victim(self, candidates: list[Sequence]) -> Sequence:
        """The lowest ranked: not admitted for starving, most service, newest run, newest."""
        boosted = self.sched.boosted

        def key(seq: Sequence):
            level, age = self._level(seq)
            return (seq.seq_id not in boosted, level, age, seq.enqueued_at)
        return max(candidates, key=key)

    def idle_to_release(self, expendable_only: bool) -> tuple[Sequence, bool] | None:
        """The idle sequence used again last: a finished thread (longest idle first, to the prefix cache
        with low priority), else the waiting one whose expected next use is farthest. `expendable_only`:
        finished, context-less or overdue ones only."""
        tracker = self.sched.tracker
        now = time.monotonic()
        best, best_key = None, None
        for seq in self.sched.idle.values():
            if not seq.block_table:
                continue
            waited = now - seq.idle_since
            if seq.program is not None and seq.program.state is ProgramState.FINISHED:
                key = (2, waited)
            elif expendable_only and seq.program is not None and not tracker.overdue(waited):
                continue  # a thread between calls (no context: no promise, so it may go)
            else:
                key = (1, tracker.expected_return_s(waited))
            if best_key is None or key > best_key:
                best, best_key = seq, key
        return None if best is None else (best, best_key[0] == 2)

    def admission_may_take_retained(self, alone: bool) -> bool:
        """New work never takes KV that will be used again, unless nothing runs."""
        return alone

    def room_for_new_thread(self, seq: Sequence, n: int) -> bool:
        """A new thread (nothing of it ever computed) is admitted only if memory also leaves room for the
        threads already resident (running, or idle and waiting) to grow to their expected final length,
        and for its own growth: otherwise its growth would later take a waiting thread's KV (recomputed
        when that thread returns). Expected lengths come from closed threads of the same step."""
        s = self.sched
        if seq.program is None or seq.max_computed_tokens != 0:
            return True
        tracker, bs = s.tracker, s.kv.block_size

        def growth(q: Sequence) -> int:
            est = tracker.expected_final(q.program.step) if q.program is not None else None
            return 0 if est is None else max(0, int(est) - q.num_tokens + bs - 1) // bs

        if tracker.expected_final(seq.program.step) is None:
            return True
        reserve = growth(seq) + s.kv.blocks_needed(seq, n)
        for q in s.running:
            reserve += growth(q)
        for q in s.idle.values():
            if q.program is not None and q.program.state is not ProgramState.FINISHED:
                reserve += growth(q)
        return s.kv.pool.num_free >= reserve


POLICIES = {p.name: p for p in (FcfsPolicy, ProgramPolicy)}
