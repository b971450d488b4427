#!/usr/bin/env python
"""Where a step's time goes (flowrt, CPU): wall time of prepare / model forward / logits / rest of step over
the main workload, grouped by step kind, plus a torch.profiler op table for one decode-32 step and one
prefill-heavy step.   python bench/step_breakdown.py [--dtype float32] [--ops] [--n 32]"""

from __future__ import annotations

import argparse
import collections
import sys
import time

sys.path.insert(0, __import__("os").path.dirname(__file__))
from common import main_workload  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--ops", action="store_true")
    ap.add_argument("--n", type=int, default=32)
    a = ap.parse_args()
    import torch

    from flowrt.engine import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(None, dtype=a.dtype)
    eng = llm.engine if hasattr(llm, "engine") else llm.llm_engine
    runner = eng.runner
    reqs = main_workload(n=a.n)
    prompts = [{"prompt_token_ids": r["prompt"]} for r in reqs]
    params = [SamplingParams(max_tokens=r["max_new"], temperature=0, ignore_eos=True) for r in reqs]
    llm.generate(prompts[:1], [SamplingParams(max_tokens=1, temperature=0)])
    print(f"startup to first token {time.perf_counter() - t0:.2f}s")
    llm.generate(prompts[:4], params[:4])
    acc = collections.defaultdict(lambda: collections.defaultdict(float))
    cur = {}
    orig_prep, orig_exec, orig_fwd, orig_logits = runner.prepare, runner.execute, runner.model.forward, runner.model.logits

    def prep(batch, rows):
        t = time.perf_counter()
        r = orig_prep(batch, rows)
        q = r.input_ids.shape[0]
        nb = len(batch.seqs)
        cur["kind"] = "decode" if q == nb else ("prefill" if q > 4 * nb else "mixed")
        cur["prep"] = time.perf_counter() - t
        return r

    def fwd(*args, **kw):
        t = time.perf_counter()
        r = orig_fwd(*args, **kw)
        cur["fwd"] = time.perf_counter() - t
        return r

    def lg(h):
        t = time.perf_counter()
        r = orig_logits(h)
        cur["logits"] = time.perf_counter() - t
        return r

    runner.prepare, runner.model.forward, runner.model.logits = prep, fwd, lg
    orig_step = eng.step

    def step():
        t = time.perf_counter()
        r = orig_step()
        tot = time.perf_counter() - t
        d = acc[cur.get("kind", "?")]
        d["n"] += 1
        d["total"] += tot
        for k in ("prep", "fwd", "logits"):
            d[k] += cur.get(k, 0.0)
        d["rest"] += tot - sum(cur.get(k, 0.0) for k in ("prep", "fwd", "logits"))
        cur.clear()
        return r

    eng.step = step
    llm.reset_prefix_cache()
    t = time.perf_counter()
    llm.generate(prompts, params)
    wall = time.perf_counter() - t
    print(f"main workload n={a.n}: {wall:.2f}s")
    for kind, d in acc.items():
        n = d["n"]
        print(f"  {kind:8s} steps {int(n):4d} total {d['total']:.2f}s  per step {1e3 * d['total'] / n:.1f} ms: "
              + "  ".join(f"{k} {1e3 * d[k] / n:.1f}" for k in ("prep", "fwd", "logits", "rest")))
    if a.ops:
        from torch.profiler import ProfilerActivity, profile

        eng.step = orig_step
        runner.prepare, runner.model.forward, runner.model.logits = orig_prep, orig_fwd, orig_logits
        llm.reset_prefix_cache()
        from flowrt.engine import SamplingParams as SP
        ids = [(r["prompt"] * 2)[:150] for r in reqs[:32]]
        for p in ids:
            eng.add_request(p, SP(max_tokens=20, temperature=0, ignore_eos=True))
        for _ in range(6):
            eng.step()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                eng.step()
        print("=== decode 32 x ~150 ctx, 3 steps")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
        while eng.has_unfinished():
            eng.step()
        for p in ids[:6]:
            eng.add_request([x + 1 for x in p] * 2, SP(max_tokens=1, temperature=0, ignore_eos=True))
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            eng.step()
        print("=== prefill step (6 x 300 tokens)")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()
