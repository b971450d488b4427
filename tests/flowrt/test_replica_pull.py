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
