"""The multi-node part of bench/scaleout.py (``--multinode``, ``--crossover``): 3 replicas on 3 Ray nodes of a
``ray.cluster_utils.Cluster`` (one raylet per node on this machine, 1 CPU each, a head without CPUs).

* ``--crossover``: time to pull N blocks from another replica (Ray object store) against computing their tokens
  (prefill), N = 1..24: where pulling starts to win (the defaults of flowrt.replicas.pull.PullCost).
* ``--multinode``: RUNS runs sharing one long prefix (plus their own question) with skewed arrivals (a burst,
  then a trickle): prefill tokens computed and runs/s for (a) no sharing between replicas (round robin),
  (b) prefix affinity only, (c) affinity + pull, against one in-process engine's prefill tokens; then a node
  killed mid-way with checkpoints: runs completed, finished steps run twice, prefill tokens recomputed with and
  without the shared KV store (--checkpoint-kv).
"""

from __future__ import annotations

import asyncio
import collections
import os
import random
import signal
import statistics
import tempfile
import time
import uuid
from typing import Any

WORDS = ("the little girl saw a big red ball under a tree and she wanted to play with it but her mom said no "
         "so she went home and sat down by the window to watch the birds fly over the green hills far away").split()
FINISHED: collections.Counter = collections.Counter()
STARTED: collections.Counter = collections.Counter()   # (question, step) -> times the step started
KILL: dict[str, Any] = {"armed": None, "countdown": 0}   # node_loss: the n-th answer step kills its replica's node


def long_prefix(words: int = 170, seed: int = 3) -> str:
    """~335 tokens of stories260K (it holds 512 positions: room for the question and 72 generated tokens)."""
    rng = random.Random(seed)
    return "Story. " + " ".join(rng.choice(WORDS) for _ in range(words)) + "."


def start_cluster(nodes: int = 3):
    import ray
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "include_dashboard": False,
        "_system_config": {"health_check_period_ms": 500, "health_check_failure_threshold": 4}})
    workers = [c.add_node(num_cpus=1) for _ in range(nodes)]
    ray.init(address=c.address, log_to_driver=False, configure_logging=False)
    c.wait_for_nodes()
    return c, workers


def kill_node(c, node, pids: list[int]) -> None:
    for info in node.all_processes.get("raylet", []):
        pids = pids + [info.process.pid]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    c.remove_node(node, False)


# ---------------------------------------------------------------------------------------------- crossover
def crossover(model: str) -> list[dict[str, Any]]:
    from flowrt.engine import SamplingParams
    from flowrt.replicas.client import ReplicaSet
    import ray

    rs = ReplicaSet(model, 2, max_model_len=512, dtype="float32", poll_interval=0.05)
    a, b = rs.replicas
    bs = rs.block_size
    rows = []
    rng = random.Random(0)
    for n in (1, 2, 4, 8, 16, 24):
        pulls, prefills = [], []
        for _ in range(5):
            ids = [rng.randrange(3, 500) for _ in range(n * bs)]
            req = {"kind": "generate", "prompt": {"prompt_token_ids": ids + [7]}, "params": SamplingParams(max_tokens=1),
                   "rid": uuid.uuid4().hex, "program": None}
            ref, _ = rs.submit(a, "call", req)   # a computes them (and holds them)
            ray.get(ref)
            ray.get(b.actor.reset_cache.remote())
            t0 = time.perf_counter()
            rs.queue_op(b, b.epoch, ("pull", None, a.actor, ids, 0.0))
            ray.get(rs.submit(b, "call", None)[0])
            pulls.append(time.perf_counter() - t0)
            ray.get(b.actor.reset_cache.remote())
            t0 = time.perf_counter()
            ray.get(rs.submit(b, "call", dict(req, rid=uuid.uuid4().hex))[0])   # b computes them
            prefills.append(time.perf_counter() - t0)
        rows.append({"blocks": n, "tokens": n * bs, "pull_ms": round(1e3 * statistics.median(pulls), 2),
                     "prefill_ms": round(1e3 * statistics.median(prefills), 2),
                     "block_bytes": a.block_bytes})
        print(rows[-1], flush=True)
    rs.shutdown()
    return rows


# ---------------------------------------------------------------------------------------------- workload
def make_workflow(max_tokens: int):
    import flowrt as fr

    wf = fr.Workflow("scaleout_mn")

    @wf.step
    async def context(system: str, question: str, llm: fr.Model) -> fr.Thread:
        STARTED[(question, "context")] += 1
        t = llm.thread(system) + question
        await t.gen(max_tokens=24, temperature=0, ignore_eos=True)   # this run's own blocks
        FINISHED[(question, "context")] += 1
        return t

    @wf.step
    async def answer(context: fr.Thread, question: str, llm: fr.Model) -> str:
        task = asyncio.ensure_future(context.gen(max_tokens=max_tokens, temperature=0, ignore_eos=True))
        KILL["countdown"] -= 1
        kill = KILL["armed"] if KILL["countdown"] == 0 else None
        if kill is not None:   # the node of the replica this generation runs on dies while it runs
            await asyncio.sleep(0.02)
            await kill(llm.engine.replica)
        out = await task
        FINISHED[(question, "answer")] += 1
        return out

    return wf


def arrivals(n: int, seed: int) -> list[float]:
    """Skewed: half the runs in a burst at t=0, the rest as a trickle (exponential gaps, mean 60 ms)."""
    rng = random.Random(seed)
    t, out = 0.0, [0.0] * (n // 2)
    for _ in range(n - n // 2):
        t += rng.expovariate(1 / 0.06)
        out.append(t)
    return out


def summary(r: Any) -> dict[str, Any]:
    """What a measurement keeps of a run: not its result, whose threads would hold their KV blocks in the
    replicas' caches past ``reset_caches``."""
    if not getattr(r, "ok", False):
        return {"ok": False, "error": repr(getattr(r, "errors", r))[:300]}
    return {"ok": True, "takeovers": r.stats.get("takeovers", 0), "kv_blocks_loaded": r.stats.get("kv_blocks_loaded", 0),
            "tokens_computed": r.stats.get("takeover_tokens_computed", 0)}   # by its takeover attempts alone


def reset(rs) -> None:
    """Every replica's prefix cache empty (the runs' threads closed first) and the index with it."""
    import gc

    gc.collect()
    time.sleep(0.3)   # the poller sends the closes
    rs.reset_caches()
    time.sleep(0.3)


async def drive(rt, wf, system: str, n: int, seed: int, on_half=None) -> tuple[float, list[dict[str, Any]]]:
    times = arrivals(n, seed)
    t0 = time.perf_counter()
    done = 0

    async def one(i: int, at: float):
        nonlocal done
        await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
        question = f" Question {i}: what happened next?"
        r = await rt.run(wf, system=system, question=question)
        done += 1
        if on_half is not None and done == n // 3:
            await on_half()
        return {**summary(r), "question": question}

    results = await asyncio.gather(*(one(i, at) for i, at in enumerate(times)), return_exceptions=True)
    return time.perf_counter() - t0, [x if isinstance(x, dict) else summary(x) for x in results]


def totals(rs) -> dict[str, int]:
    rs.refresh()
    keys = ("prefill_tokens_computed", "prompt_tokens", "kv_blocks_pulled", "kv_pull_failures")
    return {k: sum(int(h.stats.get(k, 0)) for h in rs.replicas) for k in keys}


def single_process(model: str, wf, system: str, n: int, seed: int) -> int:
    import flowrt as fr

    rt = fr.Runtime(model, max_model_len=512, dtype="float32")
    _, results = asyncio.run(drive(rt, wf, system, n, seed))
    assert all(r["ok"] for r in results), results
    computed = rt.stats()["prefill_tokens_computed"]
    rt.close()
    return computed


def sharing(model: str, runs: int, max_tokens: int, seed: int) -> list[dict[str, Any]]:
    import flowrt as fr

    wf, system = make_workflow(max_tokens), long_prefix()
    single = single_process(model, wf, system, runs, seed)
    print({"config": "single process", "prefill_tokens_computed": single}, flush=True)
    rt = fr.Runtime(model, replicas=3, max_model_len=512, dtype="float32",
                    replica_options={"poll_interval": 0.05, "load_abs": 2, "load_rel": 1.5})
    asyncio.run(rt.model())
    rs = rt.llm.engine.replica_set
    rows = []
    asyncio.run(drive(rt, wf, "Warm up. " + system[:60], 3, seed))   # every replica has run once
    for name, routing, pull in (("a_no_sharing", "round_robin", False), ("b_affinity", "prefix", False),
                                ("c_affinity_pull", "prefix", True)):
        rs.router.routing, rs.router.pull.enabled = routing, pull
        reset(rs)
        before, counters = totals(rs), dict(rs.router.counters)
        wall, results = asyncio.run(drive(rt, wf, system, runs, seed))
        time.sleep(0.3)
        after = totals(rs)
        assert all(r["ok"] for r in results), results
        d = {k: after[k] - before[k] for k in after}
        rows.append({"config": name, "prefill_tokens_computed": d["prefill_tokens_computed"],
                     "vs_single": round(d["prefill_tokens_computed"] / single, 2),
                     "kv_blocks_pulled": d["kv_blocks_pulled"], "kv_pull_failures": d["kv_pull_failures"],
                     "runs_per_s": round(runs / wall, 2),
                     "routed": {k: rs.router.counters[k] - counters.get(k, 0) for k in rs.router.counters}})
        print(rows[-1], flush=True)
    rt.close()
    return rows


def node_loss(model: str, c, workers: list, runs: int, max_tokens: int, seed: int, checkpoint: str | None,
              kv: bool) -> dict[str, Any]:
    """Runs with checkpoints; a node killed once a third of them finished. Prefill tokens recomputed: what the
    taken-over runs' takeover attempts computed (``takeover_tokens_computed``; the run's ``run_tokens_computed``
    also counts its first attempt's calls): every token of their prompts had been computed once already, on
    the dead replica. Per thread: of the runs whose thread was in their checkpoint (the node died in their
    answer step), which the shared KV store restores; a run the node took down in its context step (the step
    that starts its thread, so its checkpoint holds none) computes that step's own blocks again, as a fresh
    run would: ``recomputed_per_thread_all`` counts those too."""
    import flowrt as fr

    wf, system = make_workflow(max_tokens), long_prefix()
    tmp = tempfile.mkdtemp(prefix="flowrt-scaleout-")
    spec = checkpoint or os.path.join(tmp, "runs.db")
    rt = fr.Runtime(model, replicas=3, max_model_len=512, dtype="float32", checkpoint=spec,
                    checkpoint_kv=os.path.join(tmp, "kv") if kv else False,
                    replica_options={"poll_interval": 0.05, "load_abs": 2, "load_rel": 1.5, "max_restarts": 4})
    asyncio.run(rt.model())
    rs = rt.llm.engine.replica_set
    asyncio.run(drive(rt, wf, "Warm up. " + system[:60], 3, seed))
    reset(rs)
    FINISHED.clear()
    STARTED.clear()
    killed: list = []

    async def kill(victim):
        node = next(w for w in workers if w.node_id == victim.node_id)
        killed.append((victim, node))
        await asyncio.to_thread(kill_node, c, node, [victim.pid])


    KILL["armed"], KILL["countdown"] = kill, runs // 3
    wall, results = asyncio.run(drive(rt, wf, system, runs, seed))
    KILL["armed"] = None
    ok = [r for r in results if r["ok"]]
    taken = [r for r in ok if r["takeovers"]]
    victim, node = killed[0]
    workers.remove(node)
    recomputed = sum(r["tokens_computed"] for r in taken)
    restored = [r for r in taken if STARTED[(r["question"], "context")] == 1]   # died in the answer step
    row = {"config": f"node killed, checkpoint={'postgres' if checkpoint else 'sqlite'}, shared KV store={kv}",
           "runs_completed": len(ok), "runs": runs, "taken_over": len(taken),
           "taken_over_in_context_step": len(taken) - len(restored),
           "steps_run_twice": sum(1 for n in FINISHED.values() if n > 1),
           "prefill_tokens_recomputed": recomputed,
           "recomputed_per_thread": round(sum(r["tokens_computed"] for r in restored) / max(1, len(restored)), 1),
           "recomputed_per_thread_all": round(recomputed / max(1, len(taken)), 1),   # one thread per run
           "block_size": rs.block_size,
           "kv_blocks_loaded": sum(r["kv_blocks_loaded"] for r in taken),
           "runs_per_s": round(runs / wall, 2)}
    print(row, flush=True)
    rt.close()
    workers.append(c.add_node(num_cpus=1))   # the next measurement has 3 nodes again
    c.wait_for_nodes()
    return row
