"""The scheduler's one allocation helper: what it frees, in which order, and how it says it ended."""

from __future__ import annotations

from flowrt.engine.kv.block_pool import BlockPool
from flowrt.engine.kv.cache_manager import KVCacheManager, SlotPlan
from flowrt.engine.core.scheduler import Alloc, Scheduler
from flowrt.engine.request.sequence import Sequence, SeqStatus


def _run(sched: Scheduler, seq: Sequence) -> None:
    """Admits seq and computes its tokens (no model: the block-manager tests' way)."""
    sched.add(seq)
    batch = sched.schedule()
    assert batch.seqs == [seq]
    sched.kv.mark_computed(seq, batch.num_new_tokens[0])


def test_allocate_frees_idle_kv_then_preempts_and_names_the_outcome():
    kv = KVCacheManager(BlockPool(3, enable_prefix_caching=False), 4)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64, enable_prefix_caching=False)
    idle = Sequence([1, 2, 3, 4], persistent=True)
    _run(sched, idle)
    sched.finish(idle)  # parked with its one block
    a = Sequence(list(range(8)))
    _run(sched, a)  # two blocks: the pool is full
    assert kv.pool.num_free == 0

    a.append(9)  # needs a third block: the idle sequence's KV goes, nothing is preempted
    assert sched._allocate(a, 1, SlotPlan(), victims=lambda: [a]) is Alloc.ALLOCATED
    assert idle.kv.block_table == [] and sched.preemptions == 0
    kv.mark_computed(a, 1)

    b = Sequence([5, 6, 7])
    assert sched._allocate(b, 3, SlotPlan()) is Alloc.NO_ROOM  # no idle KV, nothing queued, no victims
    assert b.kv.block_table == []

    a.extend([1, 2, 3, 4])  # a fourth block: a itself is the only victim
    assert sched._allocate(a, 4, SlotPlan(), victims=lambda: [a]) is Alloc.PREEMPTED
    assert a.sched.status is SeqStatus.WAITING and a.kv.block_table == [] and sched.preemptions == 1
    assert sched._allocate(b, 3, SlotPlan()) is Alloc.ALLOCATED and len(b.kv.block_table) == 1
