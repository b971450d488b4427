#!/usr/bin/env python
"""Scale-out on Ray (flowrt.replicas): prefix-aware routing vs round robin vs one replica with the same total KV.

Workload: RUNS workflow runs, each = one of 4 distinct system prompts (a few hundred tokens each) + its own
short question, then a greedy generation; the prompt of each run is drawn at random and runs arrive as a
closed loop of CONCURRENCY clients. Each replica's KV pool holds about two of the system prompts plus the
working set, so where a run lands decides whether its prefix is cached.

    python bench/scaleout.py [--runs 160] [--concurrency 8] [--kv-blocks 72] [--max-tokens 16] [--model DIR]

Printed per configuration: prefill tokens computed, cache hit rate (1 - computed / prompt tokens),
runs/s, p50 / p95 run latency, and the routing decisions. Target: prefix-aware computes <= 60% of round
robin's prefill tokens with runs/s >= round robin's.

Multi-node (bench/scaleout_multinode.py; a ray.cluster_utils.Cluster of 3 one-CPU nodes on this machine):

    python bench/scaleout.py --crossover                 # pull N blocks vs prefill them, N = 1..24
    python bench/scaleout.py --multinode [--mn-runs 24] [--checkpoint postgresql://...]

(a) no sharing (round robin), (b) prefix affinity only, (c) affinity + pull on 24 runs sharing one long prefix
with skewed arrivals; then a node killed a third of the way in: runs completed, steps run twice, prefill tokens
recomputed with and without the shared KV store. Targets: (c) <= 1.1x one process's prefill tokens, runs/s no
worse than (b); 0 steps run twice; <= 1 block recomputed per thread with the shared KV store.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

WORDS = ("the little girl saw a big red ball under a tree and she wanted to play with it but her mom said no "
         "so she went home and sat down by the window to watch the birds fly over the green hills far away").split()


def system_prompts(n: int = 4, words: int = 220, seed: int = 7) -> list[str]:
    rng = random.Random(seed)
    return [f"Story {i}. " + " ".join(rng.choice(WORDS) for _ in range(words)) + "." for i in range(n)]


def make_workflow(max_tokens: int):
    import flowrt as fr

    wf = fr.Workflow("scaleout")

    @wf.step
    async def answer(system: str, question: str, llm: fr.Model) -> str:
        t = llm.thread(system) + question
        return await t.gen(max_tokens=max_tokens, temperature=0, ignore_eos=True)

    return wf


async def drive(rt, wf, plan: list[tuple[str, str]], concurrency: int) -> tuple[float, list[float]]:
    queue = list(plan)
    lat: list[float] = []

    async def client() -> None:
        while queue:
            system, question = queue.pop()
            t0 = time.perf_counter()
            r = await rt.run(wf, system=system, question=question)
            if not r.ok:
                raise RuntimeError(str(r.errors))
            lat.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return time.perf_counter() - t0, lat


def measure(rs, routing: str | None, plan, args) -> dict:
    import flowrt as fr
    from flowrt.replicas.client import RouterClient

    if routing is not None:
        rs.router.routing = routing
    rs.reset_caches()
    time.sleep(0.3)  # the replicas' (empty) cache snapshots reach the index before the first run
    rs.refresh()
    before = rs.stats()
    counters0 = dict(rs.router.counters)
    rt = fr.Runtime(RouterClient(rs))
    wall, lat = asyncio.run(drive(rt, make_workflow(args.max_tokens), plan, args.concurrency))
    time.sleep(0.2)
    rs.refresh()
    after = rs.stats()
    d = {k: after.get(k, 0) - before.get(k, 0) for k in ("prefill_tokens_computed", "prefix_cache_hit_tokens",
                                                         "prefix_cache_query_tokens", "prompt_tokens", "evictions",
                                                         "preemptions")}
    lat.sort()
    return {
        "config": routing or "single", "replicas": len(rs.replicas), "runs": len(plan),
        "prefill_tokens_computed": d["prefill_tokens_computed"],
        "prompt_tokens": d["prompt_tokens"],
        "cache_hit_rate": round(1 - d["prefill_tokens_computed"] / max(1, d["prompt_tokens"]), 3),
        "evictions": d["evictions"], "preemptions": d["preemptions"],
        "runs_per_s": round(len(plan) / wall, 2), "p50_s": round(statistics.median(lat), 3),
        "p95_s": round(lat[int(0.95 * (len(lat) - 1))], 3),
        "routed": {k: rs.router.counters[k] - counters0.get(k, 0) for k in rs.router.counters},
        "per_replica_routed": [r["routed"] for r in after["replicas"]],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / "tests" / "models" / "stories260K"))
    ap.add_argument("--runs", type=int, default=160)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--kv-blocks", type=int, default=72, help="KV blocks per replica (the single one gets 2x)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", metavar="FILE")
    ap.add_argument("--multinode", action="store_true", help="3 replicas on 3 Ray nodes: sharing and node loss")
    ap.add_argument("--crossover", action="store_true", help="pull vs prefill, by prefix length (2 nodes)")
    ap.add_argument("--mn-runs", type=int, default=24)
    ap.add_argument("--mn-max-tokens", type=int, default=96)
    ap.add_argument("--mn-part", choices=("all", "sharing", "loss"), default="all")
    ap.add_argument("--checkpoint", default=None, help="--multinode node loss: a PostgreSQL URL (default SQLite)")
    args = ap.parse_args()
    if args.multinode or args.crossover:
        return multinode(args)

    import ray

    from flowrt.replicas.client import ReplicaSet

    t0 = time.perf_counter()
    ray.init(num_cpus=os.cpu_count() or 2, include_dashboard=False, log_to_driver=False)
    print(f"ray.init: {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    systems = system_prompts()
    rng = random.Random(args.seed)
    plan = [(rng.choice(systems), f" Question {i}: what happened next?") for i in range(args.runs)]
    warm = [("Warm up. " + systems[0][:80], f" q{i}") for i in range(4)]
    common = dict(max_model_len=512, dtype="float32", poll_interval=0.05)
    results = []

    t0 = time.perf_counter()
    rs = ReplicaSet(args.model, 2, num_kv_blocks=args.kv_blocks, **common)
    print(f"2 replicas up: {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    tok = rs.tokenizer
    print("system prompt tokens:", [len(tok(s)["input_ids"]) for s in systems], file=sys.stderr)
    measure(rs, "round_robin", warm, args)
    for routing in ("prefix", "round_robin"):
        results.append(measure(rs, routing, plan, args))
        print(json.dumps(results[-1]), flush=True)
    rs.shutdown()

    rs = ReplicaSet(args.model, 1, num_kv_blocks=2 * args.kv_blocks, **common)
    measure(rs, None, warm, args)
    results.append(measure(rs, None, plan, args))
    print(json.dumps(results[-1]), flush=True)
    rs.shutdown()

    pre, rr = results[0], results[1]
    ratio = pre["prefill_tokens_computed"] / max(1, rr["prefill_tokens_computed"])
    print(f"prefix/round_robin prefill tokens: {ratio:.2f} (target <= 0.60); runs/s {pre['runs_per_s']} vs "
          f"{rr['runs_per_s']} (target >=)")
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "prefill_ratio": ratio}, indent=2))
    ray.shutdown()
    return 0


def multinode(args) -> int:
    import ray

    sys.path.insert(0, str(ROOT / "bench"))
    import scaleout_multinode as mn

    c, workers = mn.start_cluster(2 if args.crossover and not args.multinode else 3)
    out: dict = {}
    try:
        if args.crossover:
            out["crossover"] = mn.crossover(args.model)
        if args.multinode and args.mn_part in ("all", "sharing"):
            out["sharing"] = mn.sharing(args.model, args.mn_runs, args.mn_max_tokens, args.seed)
        if args.multinode and args.mn_part in ("all", "loss"):
            out["node_loss"] = [mn.node_loss(args.model, c, workers, args.mn_runs, args.mn_max_tokens, args.seed,
                                             args.checkpoint, kv) for kv in (False, True)]
    finally:
        ray.shutdown()
        c.shutdown()
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
