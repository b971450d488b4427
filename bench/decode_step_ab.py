#!/usr/bin/env python
"""A decode step of the engine (--seqs sequences at --context tokens, bf16 by default) with this checkout's kernel
library against ones built from other kernel sources (--against DIR, repeatable: copies of kernels/cpu/ from other
commits, whose exported functions must take the same arguments as this checkout's),
swapped in the same process step by step: both libraries run the very same steps on the same machine load, so the
difference is the kernels' (the machine may be shared). Reports ms per step (wall) and the process's CPU time per
step, best and median over --rounds alternations; with --threads 1 the CPU time is the step's own work, whatever
else runs on the machine.

--attention-only: the step's attention calls alone instead (its paged_decode calls captured from one step run layer
by layer, then replayed with each library: the engine's real pools, block tables and query rows).

    python bench/decode_step_ab.py --against /tmp/old_cpu [--context 200] [--seqs 32] [--rounds 8] [--threads 1]
                                   [--attention-only]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_attn_micro import caller, load_from  # noqa: E402
from step_profile import random_ids  # noqa: E402
from sysinfo import banner  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--against", type=Path, action="append", required=True, help="repeatable")
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--seqs", type=int, default=32)
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3, help="steps per library per round")
    ap.add_argument("--threads", type=int, default=None, help="compute threads (1: CPU time is the step's own)")
    ap.add_argument("--attention-only", action="store_true", help="replay one step's paged_decode calls only")
    a = ap.parse_args()
    from flowrt.engine import LLM, SamplingParams
    from flowrt.engine.cpu import ops as cpu_ops

    llm = LLM(a.model, dtype=a.dtype, num_threads=a.threads)
    engine = next(e for e in (getattr(llm, "engine", None), getattr(llm, "llm_engine", None), llm)
                  if e is not None and hasattr(e, "step"))
    print(banner(), f"| dtype {a.dtype} | {a.seqs} sequences x ~{a.context} tokens")
    libs = {"this": cpu_ops.lib(), **{f"against{i or ''}": load_from(d) for i, d in enumerate(a.against)}}
    n = torch.get_num_threads()
    for lib in libs.values():
        lib.flowrt_set_num_threads(n)
    total = 4 + 2 * a.rounds * (a.steps + 1) + 4
    for ids in random_ids(a.seqs, a.context, seed=7):
        engine.add_request({"prompt_token_ids": ids}, SamplingParams(max_tokens=total, temperature=0, ignore_eos=True))
    last = None
    while True:  # prefill until every prompt is computed (the prefill counter stops growing)
        engine.step()
        now = llm.stats().get("prefill_tokens_computed")
        if now == last:
            break
        last = now
    if a.attention_only:
        return replay_attention(engine, libs, a.rounds)
    times = {k: [] for k in libs}
    for _ in range(a.rounds):
        for name, lib in libs.items():
            cpu_ops._lib = lib
            engine.step()  # (a warm-up step per switch)
            w0, c0 = time.perf_counter(), time.process_time()
            for _ in range(a.steps):
                engine.step()
            times[name].append(((time.perf_counter() - w0) / a.steps, (time.process_time() - c0) / a.steps))
    cpu_ops._lib = libs["this"]
    for name, ts in times.items():
        w, c = [t[0] for t in ts], [t[1] for t in ts]
        print(f"{name:8s} wall ms/step best {min(w) * 1e3:6.1f} median {statistics.median(w) * 1e3:6.1f} | "
              f"cpu ms/step best {min(c) * 1e3:6.1f} median {statistics.median(c) * 1e3:6.1f}")


def replay_attention(engine, libs, rounds):
    """One step run layer by layer (the one-call decode step switched off for it), its paged_decode calls captured,
    then replayed through each library in turn (best and median CPU and wall ms for the step's calls)."""
    from flowrt.engine.cpu import ops as cpu_ops
    from flowrt.engine.model.models import llama

    calls = []
    orig_decode, orig_table = cpu_ops.paged_decode, llama.LlamaModel._layer_table
    cpu_ops.paged_decode = lambda q, kc, vc, tables, lens, out, scale, **kw: (
        calls.append((q.contiguous(), kc, vc, tables.clone(), lens.clone(), scale, kw)),
        orig_decode(q, kc, vc, tables, lens, out, scale, **kw))
    llama.LlamaModel._layer_table = lambda self, *args: None
    try:
        engine.step()
    finally:
        cpu_ops.paged_decode, llama.LlamaModel._layer_table = orig_decode, orig_table
    if not calls or any(c[6] for c in calls):
        raise SystemExit(f"expected plain paged_decode calls, got {len(calls)} ({[c[6] for c in calls][:2]})")
    fns = {name: [caller(lib, q, tables, lens, torch.empty_like(q), scale) for q, _, _, tables, lens, scale, _ in calls]
           for name, lib in libs.items()}
    times = {k: [] for k in libs}
    for _ in range(rounds):
        for name, fs in fns.items():
            w0, c0 = time.perf_counter(), time.process_time()
            for f, c in zip(fs, calls):
                f(c[1], c[2])
            times[name].append((time.perf_counter() - w0, time.process_time() - c0))
    print(f"{len(calls)} paged_decode calls of one step (block table {tuple(calls[0][3].shape)})")
    for name, ts in times.items():
        w, c = [t[0] for t in ts], [t[1] for t in ts]
        print(f"{name:8s} attention wall ms/step best {min(w) * 1e3:6.2f} median {statistics.median(w) * 1e3:6.2f} | "
              f"cpu best {min(c) * 1e3:6.2f} median {statistics.median(c) * 1e3:6.2f}")


if __name__ == "__main__":
    main()
