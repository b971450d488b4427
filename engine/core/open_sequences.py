"""Open sequences: token sequences whose KV outlives one request (what EngineSequence handles wrap).

Contract: every operation runs under the engine's lock; a sequence is only ever used with the engine that
opened it (`check_owned`); fork/append/close of a generating sequence raise RuntimeError; a closed
sequence's blocks go back to the pool (its full blocks stay in the prefix cache). `close_later` may be
called from any thread at any time (finalizers); such closes are applied by `drain` before the next step.
"""

from __future__ import annotations

import collections

from .input_processor import InputProcessor
from ..kv.cache_manager import KVCacheManager
from .output_processor import OutputProcessor
from .sampling_params import SamplingParams
from .scheduler import Scheduler
from ..request.sequence import Sequence, SeqStatus


class OpenSequences:
    def __init__(self, lock, kv: KVCacheManager, scheduler: Scheduler, inputs: InputProcessor,
                 outputs: OutputProcessor):
        self.lock = lock
        self.kv = kv
        self.scheduler = scheduler
        self.inputs = inputs
        self.outputs = outputs
        self.seqs: dict[int, Sequence] = {}
        self._pending_closes: collections.deque[Sequence] = collections.deque()

    def __len__(self) -> int:
        return len(self.seqs)

    def check_owned(self, seq: Sequence, prefix: str = "") -> None:
        if self.seqs.get(seq.seq_id) is not seq:
            raise ValueError(f"{prefix}the sequence was opened on another engine "
                             "(sequences cannot move between engines)")

    def check_can_generate(self, seq: Sequence, params: SamplingParams) -> None:
        """Every check for a request that generates onto seq (raises ValueError / RuntimeError)."""
        if seq.sched.status is SeqStatus.CLOSED:
            raise ValueError("the sequence is closed")
        self.check_owned(seq)
        req = seq.sample.request
        if req is not None and not req.finished:
            raise RuntimeError("the sequence is already generating (one request at a time)")
        if params.n != 1:
            raise ValueError("n must be 1 when generating onto a sequence (fork it for several samples)")
        self.inputs.check_tokens(seq.token_ids, "sequence")
        self.inputs.check_request(seq.num_tokens, params, "sequence")

    def open(self, token_ids) -> Sequence:
        ids = self.inputs.token_ids(token_ids, "sequence")
        if ids:
            self.inputs.check_tokens(ids, "sequence")
        seq = Sequence(ids, persistent=True)
        with self.lock:
            self.seqs[seq.seq_id] = seq
        return seq

    def _check_idle(self, seq: Sequence, op: str) -> None:
        if seq.sched.status is SeqStatus.CLOSED:
            raise RuntimeError(f"cannot {op} a closed sequence")
        if seq.sched.status in (SeqStatus.WAITING, SeqStatus.RUNNING):
            raise RuntimeError(f"cannot {op} a sequence while it is generating")
        self.check_owned(seq, f"cannot {op} it: ")

    def append(self, seq: Sequence, token_ids) -> None:
        ids = self.inputs.token_ids(token_ids, "appended tokens")
        with self.lock:
            self._check_idle(seq, "append to")
            limit = self.inputs.max_model_len
            if seq.num_tokens + len(ids) > limit:
                raise ValueError(f"sequence would have {seq.num_tokens + len(ids)} tokens, "
                                 f"more than max_model_len={limit}")
            seq.extend(ids)

    def fork(self, seq: Sequence, n: int = 1) -> list[Sequence]:
        if n < 1:
            raise ValueError(f"fork needs n >= 1, got {n}")
        with self.lock:
            self._check_idle(seq, "fork")
            children = []
            for _ in range(n):
                child = Sequence(list(seq.token_ids), persistent=True)
                self.kv.fork(seq, child)
                # same run, step and thread state (a hint; set_program changes it)
                self.scheduler.set_program(child, seq.sched.program)
                self.seqs[child.seq_id] = child
                self.scheduler.park(child)
                children.append(child)
            return children

    def close_later(self, seq: Sequence) -> None:
        self._pending_closes.append(seq)

    def drain(self) -> None:
        while self._pending_closes:
            self.close(self._pending_closes.popleft())

    def close(self, seq: Sequence) -> None:
        with self.lock:
            if seq.sched.status is SeqStatus.CLOSED or self.seqs.get(seq.seq_id) is not seq:
                return
            self.outputs.detach(seq)
            self.scheduler.close(seq)
            self.seqs.pop(seq.seq_id, None)
