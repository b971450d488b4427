"""Iteration-level scheduler (continuous batching with chunked prefill).

There is no prefill/decode distinction: each sequence has tokens and a count of tokens whose KV is
computed; a step gives every running sequence up to what it lacks (1 for a decode) and then admits
waiting sequences, all under a token budget. A sequence samples in a step when the step completes it.
When blocks run out, idle open sequences give up their KV first; then the most recently admitted
running sequence is preempted (its blocks freed; it is recomputed later, mostly from the prefix cache).

The step is one loop over running sequences and one admission loop; the policy object (engine/
core/sched_policy.py) answers what differs between policies: the queue order, the preemption victim, whether an
unfit request blocks the queue, which idle KV goes first, whether an entering thread has room. It returns
decisions; the scheduler applies them. Every loop gets memory through one helper (`_allocate`), which frees
in a fixed order (idle KV, queued sequences' KV, then preemption where the caller allows it) and says how it
ended (`Alloc`).

The scheduler is the only writer of a sequence's `sched` part (status, queue times, program context);
it changes the KV part through the KV cache manager only.

The above is the "fcfs" policy (vLLM's). The "program" policy uses what requests say about their workflow
run, step and thread (engine/request/program.py):
- ranking: a waiting sequence that has waited `max_wait_steps` steps goes before everything (and may
  preempt); the others by their run's attained service (least first, over levels growing 4x from
  SERVICE_QUANTUM tokens), then by how much of the prompt is already computed or cached (quarters; more
  first), then by run age and arrival (a run's parallel branches share their run's key: they stay
  together). Waiting sequences that cannot get memory are skipped, not waited on (the bound covers them).
- retention: admitting new work never takes the KV of a sequence that will be used again (idle and
  waiting, or queued) unless the sequence is starved or nothing runs; running work may take it. A
  thread entering memory (new, or back after losing its KV) is admitted only if memory also leaves room
  for the resident threads (and itself) to grow to their expected final length (learned from earlier
  requests of the same step), so that their growth does not later take a waiting thread's KV
  (run-level admission control: a run is kept out rather than thrashing the pool). Idle
  sequences are released in order of expected next use: finished threads first, then waiting ones whose
  next use is farthest away (engine/request/program.py's estimate from recent idle gaps). Prefixes queued work
  will hit are protected in the prefix cache; a closed thread's blocks go to it with low priority.
- preemption: the lowest-ranked running sequence (most service; newest run) goes first.
"""

from __future__ import annotations

import enum
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Callable

from ..kv.cache_manager import KVCacheManager, SlotPlan
from ..request.program import ProgramContext, ProgramState, ProgramTracker
from .sched_policy import POLICIES
from ..request.sequence import Sequence, SeqStatus
from ..decoding.spec_decode import strip_drafts


@dataclass
class SchedulerOutput:
    """One step's plan: what the runner computes and which of its rows need logits.

    The runner flattens `seqs` into one token stream (`num_new_tokens[i]` tokens of seqs[i], from its
    num_computed_tokens on), performs `plan.copies` (copy-on-write block copies) before writing KV, and
    returns the logits of the flat rows `logit_rows`, in that order. `prompt_logprob_rows` and
    `sample_rows` say which of those logit rows are whose: (seq, first logit row, first position) for
    prompt log-probabilities, (seq, logit row) for sampling the next token.
    """

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    plan: SlotPlan = field(default_factory=SlotPlan)
    logit_rows: list[int] = field(default_factory=list)
    prompt_logprob_rows: list[tuple[Sequence, int, int]] = field(default_factory=list)
    sample_rows: list[tuple[Sequence, int]] = field(default_factory=list)
    # speculative decoding: (seq, first logit row, drafts): the rows predicting each draft, right before the
    # sequence's sample row (which predicts the token after the last draft)
    spec_rows: list[tuple[Sequence, int, int]] = field(default_factory=list)


class Alloc(enum.Enum):
    """How `Scheduler._allocate` ended."""

    ALLOCATED = "allocated"  # the sequence has its slots
    NO_ROOM = "no_room"  # nothing more may be freed for it: it got no slots
    PREEMPTED = "preempted"  # it was itself the victim preempted to make room: back in the queue


def _scoring(seq: Sequence) -> bool:
    """Scoring (prompt logprobs) needs the logits of every token, so it can skip no cached block."""
    req = seq.sample.request
    return req is not None and req.prompt_logprobs is not None


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_prefix_caching: bool = True, policy: str = "fcfs", max_wait_steps: int = 256):
        if policy not in POLICIES:
            raise ValueError(f"scheduling_policy must be one of {sorted(POLICIES)}, got {policy!r}")
        self.policy = policy
        self.policy_impl = POLICIES[policy](self)
        self.program = policy == "program"
        self.max_wait_steps = max_wait_steps
        self.tracker = ProgramTracker()
        self.step_no = 0
        self.boosted: set[int] = set()  # seq ids admitted because they starved: preempted last
        self.kv = kv
        self.enable_prefix_caching = enable_prefix_caching
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.idle: OrderedDict[int, Sequence] = OrderedDict()  # open sequences holding blocks, LRU first
        self.preemptions = 0
        self._unfit: list[Sequence] = []  # sequences that cannot fit in the pool even alone

    # ---- membership -------------------------------------------------------------------------------
    def add(self, seq: Sequence, front: bool = False) -> None:
        self.idle.pop(seq.seq_id, None)
        now = time.monotonic()
        st = seq.sched
        if not front:  # a new request (a preempted sequence comes back with front=True)
            if st.status is SeqStatus.IDLE and st.idle_since:
                self.tracker.observe_gap(now - st.idle_since)
            run = self._run_id(seq)
            if run is not None:
                self.tracker.run(run).requests += 1
        st.status = SeqStatus.WAITING
        st.enqueued_at = now
        st.enqueued_step = self.step_no
        (self.waiting.appendleft if front else self.waiting.append)(seq)

    @staticmethod
    def _run_id(seq: Sequence) -> str | None:
        program = seq.sched.program
        return program.run_id if program is not None else None

    def set_program(self, seq: Sequence, program: ProgramContext | None) -> None:
        """What seq's request or open sequence belongs to (a scheduling hint; engine/request/program.py)."""
        seq.sched.program = program

    def add_running(self, seq: Sequence, after: Sequence) -> None:
        """A fork that continues right away (parallel sampling): runs next to its parent."""
        seq.sched.status = SeqStatus.RUNNING
        self.running.insert(self.running.index(after) + 1, seq)

    def remove(self, seq: Sequence) -> None:
        status = seq.sched.status
        if status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        self.idle.pop(seq.seq_id, None)
        self.boosted.discard(seq.seq_id)

    def park(self, seq: Sequence) -> None:
        """An open sequence between requests: keeps its blocks until memory is needed. With a program
        context, a sequence whose thread is between calls is waiting (to be used again)."""
        st = seq.sched
        st.status = SeqStatus.IDLE
        st.idle_since = time.monotonic()
        if st.program is not None and st.program.state is ProgramState.GENERATING:
            st.program = st.program.with_state(ProgramState.WAITING)
        if seq.kv.block_table:
            self.idle[seq.seq_id] = seq
            self.idle.move_to_end(seq.seq_id)

    def close(self, seq: Sequence) -> None:
        """An open sequence is closed: it leaves every queue and its blocks go back to the pool (the program
        policy: a closed thread's blocks are the first cached ones to go); its final length is learned."""
        self.remove(seq)
        if seq.sched.program is not None and seq.kv.max_computed_tokens:
            self.tracker.observe_final(seq.sched.program.step, seq.num_tokens)
        self.kv.free(seq, low_priority=self.program)
        seq.sched.status = SeqStatus.CLOSED

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence) -> None:
        """A sample is done: it leaves the batch; an open sequence keeps its KV, others release it."""
        self.remove(seq)
        if seq.persistent:
            self.park(seq)
        else:
            self.kv.free(seq)
            seq.sched.status = SeqStatus.FINISHED

    def take_unfit(self) -> list[Sequence]:
        """Sequences taken out of the queue because they cannot fit in the whole pool (to be failed)."""
        unfit, self._unfit = self._unfit, []
        return unfit

    # ---- memory pressure -----------------------------------------------------------------------------
    def _release_idle(self, expendable_only: bool = False) -> bool:
        """Free the KV of the idle sequence the policy picks (see `idle_to_release`)."""
        pick = self.policy_impl.idle_to_release(expendable_only)
        if pick is None:
            return False
        del self.idle[pick.seq.seq_id]
        self.kv.free(pick.seq, low_priority=pick.low_priority)
        return True

    def _release_waiting(self, keep: Sequence) -> bool:
        """Free the KV a queued sequence holds (the lowest ranked first; never a starved one's)."""
        for seq in reversed(self.waiting):
            if seq is not keep and seq.kv.block_table and not self.policy_impl.starved(seq):
                self.kv.free(seq)
                return True
        return False

    def _allocate(self, seq: Sequence, n: int, plan: SlotPlan, take_retained: bool = True,
                  victims: Callable[[], list[Sequence]] | None = None) -> Alloc:
        """Slots for seq's next n tokens, freeing memory until they fit: the KV of the idle sequence the policy
        releases first (only expendable ones unless `take_retained`), then (if `take_retained`) a queued
        sequence's, then preempting the policy's victim among `victims()` (none: no preemption)."""
        while not self.kv.allocate_slots(seq, n, plan):
            if self._release_idle(expendable_only=not take_retained):
                continue
            if take_retained and self._release_waiting(keep=seq):
                continue
            candidates = victims() if victims is not None else None
            if not candidates:
                return Alloc.NO_ROOM
            victim = self.policy_impl.victim(candidates)
            self._preempt(victim)
            if victim is seq:
                return Alloc.PREEMPTED
        return Alloc.ALLOCATED

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.boosted.discard(seq.seq_id)
        self.kv.free(seq)
        self.preemptions += 1
        run = self._run_id(seq)
        if run is not None:
            self.tracker.run(run).preemptions += 1
        self.add(seq, front=True)

    def _fail_unfit(self, seq: Sequence) -> None:
        """Nothing else holds memory, so seq can never fit: hand it back to fail its request."""
        self.kv.free(seq)
        self.waiting.remove(seq)
        seq.sched.status = SeqStatus.FINISHED
        self._unfit.append(seq)

    # ---- the step ----------------------------------------------------------------------------------
    def _inflight_hashes(self) -> set[bytes]:
        """Blocks that running sequences are about to compute: a waiting sequence whose next uncached block
        is among them waits a step and then finds it in the prefix cache instead of computing it again."""
        inflight: set[bytes] = set()
        if self.enable_prefix_caching:
            for seq in self.running:
                inflight.update(self.kv.uncomputed_full_hashes(seq))
        return inflight

    def schedule(self) -> SchedulerOutput:
        batch = SchedulerOutput()
        self._schedule(batch)
        self._trim_drafts(batch)
        self._plan_logit_rows(batch)
        return batch

    def _trim_drafts(self, batch: SchedulerOutput) -> None:
        """Speculative drafts (engine/decoding/spec_decode.py) that this step does not compute are dropped: all of an
        unscheduled sequence's, those past a partly scheduled one's chunk."""
        scheduled = {seq.seq_id: seq.kv.num_computed_tokens + n for seq, n in zip(batch.seqs, batch.num_new_tokens)}
        for seq in [*self.running, *self.waiting]:
            m = seq.spec.num_draft_tokens
            if m:
                end = scheduled.get(seq.seq_id, seq.num_tokens - m)
                strip_drafts(seq, max(0, m - (seq.num_tokens - end)), self.kv)

    def _apply_ranking(self) -> None:
        """The policy's order of the waiting queue, and the cached prefixes it will hit kept longest."""
        ranking = self.policy_impl.rank()
        if ranking is not None:
            self.waiting.clear()
            self.waiting.extend(ranking.order)
            self.kv.pool.set_protected(ranking.protected)

    def _schedule(self, batch: SchedulerOutput) -> None:
        """One step: starved sequences (the program policy's bound), then running ones, then admission."""
        self.step_no += 1
        self._apply_ranking()
        preemptions = self.preemptions
        budget = self.max_num_batched_tokens
        budget, blocked = self._schedule_starved(batch, budget)
        budget = self._schedule_running(batch, budget)
        if not (blocked or self.preemptions > preemptions):
            self._admit_waiting(batch, budget)

    def _schedule_starved(self, batch: SchedulerOutput, budget: int) -> tuple[int, bool]:
        """Starved sequences first: they may take any memory but other starved work's, and preempt
        running work not admitted for starving. Returns (budget left, whether the queue is blocked)."""
        def unboosted() -> list[Sequence]:
            return [r for r in self.running if r.seq_id not in self.boosted]

        for seq in [s for s in self.waiting if self.policy_impl.starved(s)]:
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                return budget, True
            if not _scoring(seq):
                self.kv.match_prefix(seq)
            n = min(seq.num_tokens - seq.kv.num_computed_tokens, budget)
            if self._allocate(seq, n, batch.plan, victims=unboosted) is Alloc.ALLOCATED:
                self._admit(seq, n, batch)
                self.boosted.add(seq.seq_id)
                budget -= n
            elif not self.running and not batch.seqs:
                self._fail_unfit(seq)
            else:
                return budget, True
        return budget, False

    def _schedule_running(self, batch: SchedulerOutput, budget: int) -> int:
        """Running sequences (decode, prefill chunks), taking memory from idle and queued ones first, then
        preempting the policy's victim among those not scheduled yet. Returns the budget left."""
        scheduled = {s.seq_id for s in batch.seqs}  # starved ones admitted this step
        queue = [r for r in self.running if r.seq_id not in scheduled]
        for i, seq in enumerate(queue):
            if budget <= 0:
                break
            if seq.sched.status is not SeqStatus.RUNNING:
                continue  # preempted to make room for one before it

            def unscheduled(i: int = i) -> list[Sequence]:
                return [r for r in queue[i:] if r.sched.status is SeqStatus.RUNNING]

            n = min(seq.num_tokens - seq.kv.num_computed_tokens, budget)
            if self._allocate(seq, n, batch.plan, victims=unscheduled) is Alloc.ALLOCATED:
                batch.seqs.append(seq)
                batch.num_new_tokens.append(n)
                budget -= n
        return budget

    def _admit_waiting(self, batch: SchedulerOutput, budget: int) -> None:
        """Admission in the policy's order. A sequence that cannot get memory blocks the queue (fcfs: it
        holds nothing while it waits) or is skipped, keeping the KV it holds (program)."""
        policy = self.policy_impl
        inflight = self._inflight_hashes()
        for seq in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                break
            scoring = _scoring(seq)  # scoring needs the logits of every token, so it cannot skip any
            if inflight and not scoring and self.kv.first_missing_hash(seq) in inflight:
                continue
            if not scoring:
                self.kv.match_prefix(seq)
            n = min(seq.num_tokens - seq.kv.num_computed_tokens, budget)
            alone = not self.running and not batch.seqs
            if not alone and not policy.room_to_enter(seq, n):
                continue
            take_retained = policy.admission_may_take_retained(alone)
            if self._allocate(seq, n, batch.plan, take_retained=take_retained) is Alloc.ALLOCATED:
                self._admit(seq, n, batch)
                budget -= n
                if self.enable_prefix_caching:
                    inflight.update(self.kv.uncomputed_full_hashes(seq))
            elif alone:
                self._fail_unfit(seq)
            elif not policy.skip_unfit:
                self.kv.free(seq)  # its full blocks stay in the prefix cache
                break

    def _account_admission(self, seq: Sequence) -> None:
        run = self._run_id(seq)
        if run is not None:
            self.tracker.run(run).queue_time_s += time.monotonic() - seq.sched.enqueued_at

    def _admit(self, seq: Sequence, n: int, batch: SchedulerOutput) -> None:
        self.waiting.remove(seq)
        seq.sched.status = SeqStatus.RUNNING
        self.running.append(seq)
        batch.seqs.append(seq)
        batch.num_new_tokens.append(n)
        self._account_admission(seq)

    @staticmethod
    def _plan_logit_rows(batch: SchedulerOutput) -> None:
        """Which flat rows need logits: prompt tokens being scored, and the last row of each sequence the
        step completes (it samples, unless its request wants no new tokens)."""
        rows = batch.logit_rows
        flat = 0
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            sample = seq.sample
            req = sample.request
            c0 = seq.kv.num_computed_tokens
            if req is None:  # driven without a request (the block-manager tests): no logits
                flat += n
                continue
            if not req.scheduled:
                req.scheduled = True
                req.num_cached_tokens = c0  # KV found in the prefix cache (or kept by an open sequence)
            if req.prompt_logprobs is not None and sample.index == 0 and not req.forked:
                lo = max(c0, req.prompt_logprob_start - 1)
                hi = min(c0 + n, sample.prompt_len - 1)
                if hi > lo:
                    batch.prompt_logprob_rows.append((seq, len(rows), lo))
                    rows.extend(range(flat + lo - c0, flat + hi - c0))
            if c0 + n == seq.num_tokens and req.params.max_tokens > seq.num_output_tokens:
                m = seq.spec.num_draft_tokens
                if m:
                    batch.spec_rows.append((seq, len(rows), m))
                    rows.extend(range(flat + n - 1 - m, flat + n - 1))
                batch.sample_rows.append((seq, len(rows)))
                rows.append(flat + n - 1)
            flat += n

    def update_from_output(self, batch: SchedulerOutput) -> list[tuple[Sequence, int]]:
        """After the model ran: the scheduled tokens of sequences still running are computed (their newly
        full blocks enter the prefix cache). Returns those (sequence, tokens computed) pairs."""
        done = []
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            if seq.sched.status is not SeqStatus.RUNNING:
                continue  # aborted or closed while the model ran
            recomputed = self.kv.mark_computed(seq, n, unverified=seq.spec.num_draft_tokens)  # drafts: unverified
            run = self._run_id(seq)
            if run is not None:
                rec = self.tracker.run(run)
                rec.service_tokens += n
                rec.prefill_tokens_recomputed += recomputed
            done.append((seq, n))
        return done
