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
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    plan: SlotPlan = field(default_factory=SlotPlan)

    def __len__(self) -> int:
        return len(self.seqs)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.idle: OrderedDict[int, Sequence] = OrderedDict()  # open sequences holding blocks, LRU first
        self.preemptions = 0
        self.unfit: list[Sequence] = []  # sequences that cannot fit in the pool even alone

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
    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
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
            return batch
        # Blocks that running sequences are about to compute: a waiting sequence whose next uncached block
        # is among them waits a step and then finds it in the prefix cache instead of computing it again.
        inflight: set[bytes] = set()
        if self.kv.pool.enable_prefix_caching:
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
                if self.kv.pool.enable_prefix_caching:
                    inflight.update(self.kv.uncomputed_full_hashes(seq))
                continue
            self.kv.free(seq)  # hold nothing while waiting; its full blocks stay in the prefix cache
            if not self.running and not batch.seqs:
                # Nothing else holds memory, so it can never fit: hand it back to fail its request.
                self.waiting.remove(seq)
                seq.status = SeqStatus.FINISHED
                self.unfit.append(seq)
                continue
            break
        return batch
