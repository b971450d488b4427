"""Which sequences sample in a step, and from which logit rows: a request with n > 1 forks its other samples
here, once its prompt is computed (each child samples from the parent's row and shares its KV)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..decoding import structured_output
from ..request.sequence import SeqStatus, Sequence

if TYPE_CHECKING:
    from ..kv.cache_manager import KVCacheManager
    from .output_processor import OutputProcessor
    from .scheduler import Scheduler, SchedulerOutput

__all__ = ["sampling_rows"]


def sampling_rows(so: SchedulerOutput, kv: KVCacheManager, outputs: OutputProcessor,
                  scheduler: Scheduler) -> tuple[list[Sequence], list[int]]:
    """The sequences that sample this step and their logit rows; n > 1 forks its samples here, once
    the prompt is computed (each child samples from the parent's row)."""
    live, rows = [], []
    for seq, r in so.sample_rows:
        if seq.sched.status is not SeqStatus.RUNNING:
            continue
        req = seq.sample.request
        assert req is not None  # a running sequence samples for a request
        if req.params.n > 1 and not req.forked:
            req.forked = True
            for i in range(1, req.params.n):
                child = Sequence(list(seq.token_ids))
                kv.fork(seq, child)
                outputs.attach(req, child, i)
                structured_output.fork(seq, child)  # each sample continues the grammar from the shared state
                scheduler.add_running(child, after=req.seqs[-1])
                req.seqs.append(child)
                live.append(child)
                rows.append(r)
        live.append(seq)
        rows.append(r)
    return live, rows
