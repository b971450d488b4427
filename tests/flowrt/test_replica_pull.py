"""KV between replicas without Ray: the router's pull plan (cost estimate, fingerprints), the replica's export and
import refusing another model's blocks, and what counts as a run lost to a replica's death (takeover)."""

from __future__ import annotations

import asyncio
import time

import pytest

from flowrt.replicas.index import PrefixIndex
from flowrt.replicas.pull import PullCost
from flowrt.replicas.router import ReplicaHandle, Router
from flowrt.replicas.takeover import lost_to_replica
from flowrt.runner.executor import RunResult, StepError

BS = 16


def router(fingerprints=("fp", "fp"), pull: PullCost | None = None) -> tuple[Router, list[ReplicaHandle]]:
    hs = [ReplicaHandle(i, None, healthy=True, epoch="e", fingerprint=fp, block_bytes=40960)
          for i, fp in enumerate(fingerprints)]
    return Router(hs, PrefixIndex(BS), load_abs=2, load_rel=1.5, pull=pull), hs


def test_busy_holder_plans_a_pull():
    r, (a, b) = router()
    prompt = list(range(20 * BS + 5))
    first, plan = r.place(prompt)
    assert plan is None and first is a                # cold: nothing to pull
    a.in_flight = 10                                  # the holder is busy: the load fallback
    second, plan = r.place(prompt)
    assert second is b and plan is not None and plan.source == a.index and plan.blocks == 20
    assert r.counters["pulls_planned"] == 1


@pytest.mark.parametrize("fps, cost", [(("fp", "other"), None),           # other weights/dtype: never
                                       (("fp", "fp"), PullCost(enabled=False)),
                                       (("fp", "fp"), PullCost(prefill_tokens_per_s=1e9))])   # prefill cheaper
def test_no_pull(fps, cost):
    r, (a, b) = router(fps, cost)
    prompt = list(range(20 * BS))
    r.place(prompt)
    a.in_flight = 10
    second, plan = r.place(prompt)
    assert second is b and plan is None


def test_cost_crossover():
    c = PullCost()   # the defaults, measured: pulling wins from 2 blocks of stories260K (20 KiB each)
    assert not c.worth_it(1, BS, 20480)      # 1.8 ms of prefill < 2 ms round trip + 0.5 ms copy
    assert c.worth_it(2, BS, 20480)
    assert not c.worth_it(24, BS, 20480 * 8)  # 8x the bytes per block: the copy costs more than the prefill


def _result(*messages: str) -> RunResult:
    errors = {f"s{i}": StepError(f"s{i}", m) for i, m in enumerate(messages)}
    errors["after"] = StepError("after", "skipped: depends on failed step 's0'", kind="skipped")
    return RunResult("wf", {}, errors, {})


def test_lost_to_replica():
    assert lost_to_replica(_result("ReplicaDiedError: replica 0 (node n, pid 1) died"))
    assert lost_to_replica(_result("ExceptionGroup: 4 of 4 awaitables failed: ReplicaDiedError: replica 0 ..."))
    assert not lost_to_replica(_result("ReplicaDiedError: replica 0 died", "ValueError: bad input"))
    assert lost_to_replica(_result("NoReplicaError: no healthy engine replica (...)"))   # waits for one
    assert not lost_to_replica(RunResult("wf", {}, {}, {}))


@pytest.mark.slow   # two engines: ~7 s on the busy 2-core machine
def test_replica_export_import_check_fingerprints(stories_path):
    from flowrt.engine import SamplingParams
    from flowrt.replicas.actor import ReplicaServer

    src = ReplicaServer(0, stories_path, {"dtype": "float32", "num_kv_blocks": 64})
    dst = ReplicaServer(1, stories_path, {"dtype": "float32", "num_kv_blocks": 64})
    try:
        ids = list(range(1, 3 * 16 + 4))
        asyncio.run(src.engine.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1)))
        assert asyncio.run(src.export_kv(ids, [], "another model")) == []
        blocks = asyncio.run(src.export_kv(ids, [], src.fingerprint))
        assert len(blocks) == 3 and all(d for _, d in blocks)
        assert dst.import_kv(blocks, "another model") == 0
        assert dst.import_kv(blocks, dst.fingerprint) == 3
        assert asyncio.run(src.export_kv(ids, [blocks[0][0]], src.fingerprint))[0] == (blocks[0][0], None)   # it has it
        t0 = time.monotonic()   # blocks it does not have: it waits for them as long as asked, no longer
        assert len(asyncio.run(src.export_kv(ids + list(range(100, 120)), [], src.fingerprint, wait_s=0.2))) == 3
        assert 0.2 <= time.monotonic() - t0 < 5
    finally:
        src.shutdown()
        dst.shutdown()


@pytest.mark.slow   # one engine
def test_rejoin_ends_the_epoch_the_client_gave_up_on(stories_path):
    """A client that marked a replica dead (it did not answer in time) dropped what it had queued for it; taking
    it back, it must not find that epoch's sequences as they were: ``rejoin`` of that epoch closes them and starts
    a new one, whose batches count from 0; a call of the old epoch fails, one waiting for its turn at once."""
    from flowrt.replicas.actor import ReplicaServer, StaleEpochError

    rep = ReplicaServer(0, stories_path, {"dtype": "float32", "num_kv_blocks": 64})

    async def go():
        old = rep.epoch
        await rep.call(old, 0, [("open", "s1", list(range(1, 40)), None)], None)
        waiting = asyncio.ensure_future(rep.call(old, 5, [("open", "s2", [1, 2, 3], None)], None))
        await asyncio.sleep(0)   # it waits for batches 1..4
        assert (await rep.rejoin("a restarted incarnation's"))["epoch"] == old   # not this one: kept
        assert await rep.seq_tokens("s1") is not None
        new = (await rep.rejoin(old))["epoch"]
        assert new != old and await rep.seq_tokens("s1") is None   # closed
        with pytest.raises(StaleEpochError):
            await waiting
        with pytest.raises(StaleEpochError):
            await rep.call(old, 1, [("open", "s3", [1, 2], None)], None)
        await rep.call(new, 0, [("open", "s4", [1, 2], None)], None)   # the new epoch's first batch
        assert await rep.seq_tokens("s4") == [1, 2]
        assert await rep.seq_tokens("s2") is None and await rep.seq_tokens("s3") is None

    try:
        asyncio.run(go())
    finally:
        rep.shutdown()
