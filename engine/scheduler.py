"""Iteration-level scheduler (continuous batching with chunked prefill).

There is no prefill/decode distinction: each sequence has tokens and a count of tokens whose KV is
computed; a step gives every running sequence up to what it lacks (1 for a decode) and then admits
waiting sequences, all under a token budget. A sequence samples in a step when the step completes it.
When blocks run out, idle open sequences give up their KV first; then the most recently admitted
running sequence is preempted (its blocks freed; it is recomputed later, mostly from the prefix cache).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

from .kv_cache_manager import KVCacheManager, SlotPlan
from .sequence import Sequence, SeqStatus


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

    @property
    def block_copies(self) -> list[tuple[int, int]]:
        return self.plan.copies


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_prefix_caching: bool = True):
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
        seq.status = SeqStatus.WAITING
        (self.waiting.appendleft if front else self.waiting.append)(seq)

    def add_running(self, seq: Sequence, after: Sequence) -> None:
        """A fork that continues right away (parallel sampling): runs next to its parent."""
        seq.status = SeqStatus.RUNNING
        self.running.insert(self.running.index(after) + 1, seq)

    def remove(self, seq: Sequence) -> None:
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        self.idle.pop(seq.seq_id, None)

    def park(self, seq: Sequence) -> None:
        """An open sequence between requests: keeps its blocks until memory is needed."""
        seq.status = SeqStatus.IDLE
        if seq.block_table:
            self.idle[seq.seq_id] = seq
            self.idle.move_to_end(seq.seq_id)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence) -> None:
        """A sample is done: it leaves the batch; an open sequence keeps its KV, others release it."""
        self.remove(seq)
        if seq.persistent:
            self.park(seq)
        else:
            self.kv.free(seq)
            seq.status = SeqStatus.FINISHED

    def take_unfit(self) -> list[Sequence]:
        """Sequences taken out of the queue because they cannot fit in the whole pool (to be failed)."""
        unfit, self._unfit = self._unfit, []
        return unfit

    # ---- memory pressure -----------------------------------------------------------------------------
    def _release_idle(self) -> bool:
        while self.idle:
            _, seq = self.idle.popitem(last=False)
            if seq.block_table:
                self.kv.free(seq)
                return True
        return False

    def _release_waiting(self, keep: Sequence) -> bool:
        for seq in reversed(self.waiting):
            if seq is not keep and seq.block_table:
                self.kv.free(seq)
                return True
        return False

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.free(seq)
        self.preemptions += 1
        self.add(seq, front=True)

    # ---- the step ----------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        batch = SchedulerOutput()
        self._schedule(batch)
        self._plan_logit_rows(batch)
        return batch

    def _schedule(self, batch: SchedulerOutput) -> None:
        budget = self.max_num_batched_tokens
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.kv.allocate_slots(seq, n, batch.plan):
                if self._release_idle() or self._release_waiting(keep=seq):
                    continue
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                batch.seqs.append(seq)
                batch.num_new_tokens.append(n)
                budget -= n
                i += 1
        if preempted:
            return
        # Blocks that running sequences are about to compute: a waiting sequence whose next uncached block
        # is among them waits a step and then finds it in the prefix cache instead of computing it again.
        inflight: set[bytes] = set()
        if self.enable_prefix_caching:
            for seq in self.running:
                inflight.update(self.kv.uncomputed_full_hashes(seq))
        for seq in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                break
            scoring = seq.request is not None and seq.request.prompt_logprobs is not None
            if inflight and not scoring and self.kv.first_missing_hash(seq) in inflight:
                continue
            if not scoring:  # scoring needs the logits of every token, so it cannot skip any
                self.kv.match_prefix(seq)
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.kv.allocate_slots(seq, n, batch.plan):
                if not (self._release_idle() or self._release_waiting(keep=seq)):
                    break
            else:
                self.waiting.remove(seq)
                seq.status = SeqStatus.RUNNING
                self.running.append(seq)
                batch.seqs.append(seq)
                batch.num_new_tokens.append(n)
                budget -= n
                if self.enable_prefix_caching:
                    inflight.update(self.kv.uncomputed_full_hashes(seq))
                continue
            self.kv.free(seq)  # hold nothing while waiting; its full blocks stay in the prefix cache
            if not self.running and not batch.seqs:
                # Nothing else holds memory, so it can never fit: hand it back to fail its request.
                self.waiting.remove(seq)
                seq.status = SeqStatus.FINISHED
                self._unfit.append(seq)
                continue
            break

    @staticmethod
    def _plan_logit_rows(batch: SchedulerOutput) -> None:
        """Which flat rows need logits: prompt tokens being scored, and the last row of each sequence the
        step completes (it samples, unless its request wants no new tokens)."""
        rows = batch.logit_rows
        flat = 0
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            req = seq.request
            c0 = seq.num_computed_tokens
            if req is None:  # driven without a request (the block-manager tests): no logits
                flat += n
                continue
            if not req.scheduled:
                req.scheduled = True
                req.num_cached_tokens = c0  # KV found in the prefix cache (or kept by an open sequence)
            if req.prompt_logprobs is not None and seq.sample_index == 0 and not req.forked:
                lo = max(c0, req.prompt_logprob_start - 1)
                hi = min(c0 + n, seq.prompt_len - 1)
                if hi > lo:
                    batch.prompt_logprob_rows.append((seq, len(rows), lo))
                    rows.extend(range(flat + lo - c0, flat + hi - c0))
            if c0 + n == seq.num_tokens and req.params.max_tokens > seq.num_output_tokens:
                batch.sample_rows.append((seq, len(rows)))
                rows.append(flat + n - 1)
            flat += n

    def update_from_output(self, batch: SchedulerOutput) -> list[tuple[Sequence, int]]:
        """After the model ran: the scheduled tokens of sequences still running are computed (their newly
        full blocks enter the prefix cache). Returns those (sequence, tokens computed) pairs."""
        done = []
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            if seq.status is not SeqStatus.RUNNING:
                continue  # aborted or closed while the model ran
            seq.num_computed_tokens += n
            self.kv.register_full_blocks(seq)
            done.append((seq, n))
        return done
