#!/usr/bin/env python
"""One engine step, A/B: the fused CPU kernels (flowrt.engine.cpu.ops) on vs off, on the very same step inputs,
interleaved and repeated (robust on a shared, noisy machine), with a per-category breakdown from torch.profiler.
Steps: decode of 32 sequences at ~150 and ~400 context, and a 2,048-token prefill step (8 x 256).

    python bench/step_ab.py [--dtype float32] [--threads 1] [--reps 5]
With --threads 1 the times are the thread's CPU time (other processes on the machine do not count)."""
import argparse
import collections
import sys
import time

sys.path.insert(0, __import__("os").path.dirname(__file__))
from common import main_workload  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--dtype", default="float32")
ap.add_argument("--threads", type=int, default=0)
ap.add_argument("--reps", type=int, default=5)
ap.add_argument("--gemm", action="store_true", help="A/B the float32 oneDNN-packed projections instead")
ap.add_argument("--decode-batches", default="32")
a = ap.parse_args()

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from flowrt.engine import LLM, SamplingParams  # noqa: E402
from flowrt.engine.cpu import ops as cpu_ops  # noqa: E402

if a.threads:
    torch.set_num_threads(a.threads)
clock = time.thread_time if a.threads == 1 else time.perf_counter
llm = LLM(None, dtype=a.dtype, num_threads=a.threads or None)
eng = llm.engine
runner = eng.runner
captured = []
orig_prepare = runner.prepare


def capture(batch, rows):
    inp = orig_prepare(batch, rows)
    captured.append(inp)
    return inp


runner.prepare = capture
reqs = main_workload()


def step_inputs(prompts, max_tokens, kind):
    for p in prompts:
        eng.add_request(p, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    while eng.has_unfinished():
        captured.clear()
        eng.step()
        inp = captured[-1]
        T, B = inp.input_ids.shape[0], len(inp.meta.query_lens_list)
        if kind == "decode" and T == B == len(prompts):
            return inp
        if kind == "prefill" and T >= 1000:
            return inp
    raise RuntimeError("no such step")


def finish():
    while eng.has_unfinished():
        eng.step()


CATS = {"aten::mm": "gemm", "aten::addmm": "gemm", "aten::_scaled_dot_product_flash_attention_for_cpu": "sdpa",
        "aten::index_select": "gather", "aten::index_copy_": "kv-write"}


def breakdown(inp):
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        runner.execute(inp)
    tot = collections.Counter()
    for ev in prof.key_averages():
        tot[CATS.get(ev.key, "other ops")] += ev.self_cpu_time_total / 1e3
    return tot


steps = {}
for nb in [int(x) for x in a.decode_batches.split(",")]:
    steps[f"decode{nb} ctx~150"] = step_inputs([(r["prompt"] * 3)[:150] for r in reqs[:nb]], 8, "decode")
    finish()
    llm.reset_prefix_cache()
steps["decode32 ctx~400"] = step_inputs([(r["prompt"] * 4)[:400] for r in reqs], 8, "decode")
finish()
llm.reset_prefix_cache()
steps["prefill ~2k tokens"] = step_inputs([(r["prompt"] * 3)[:256] for r in reqs[:8]], 1, "prefill")
finish()
runner.prepare = orig_prepare
if a.gemm:
    import torch.nn.functional as F

    model = runner.model
    packed = [dict(layer.mm) for layer in model.layers], dict(model.mm)
    plain = [{"qkv": (lambda x, ly=layer: F.linear(x, ly.qkv, ly.qkv_bias)), "o": (lambda x, ly=layer: F.linear(x, ly.o)),
              "gate_up": (lambda x, ly=layer: F.linear(x, ly.gate_up)),
              "down": (lambda x, ly=layer: F.linear(x, ly.down))}
             for layer in model.layers], {"lm_head": lambda x: F.linear(x, model.lm_head)}

    def use(on):
        for layer, mm in zip(model.layers, (packed if on else plain)[0]):
            layer.mm = mm
        model.mm = (packed if on else plain)[1]

    cpu_ops.set_enabled = use  # the A/B below toggles the GEMM path
for name, inp in steps.items():
    best = {"torch": 1e9, "cpu_ops": 1e9}
    for _ in range(a.reps):
        for mode in best:
            cpu_ops.set_enabled(mode == "cpu_ops")
            runner.execute(inp)
            t = clock()
            runner.execute(inp)
            best[mode] = min(best[mode], clock() - t)
    cpu_ops.set_enabled(True)
    print(f"{name:18s} step: off/torch {best['torch'] * 1e3:7.1f} ms   cpu_ops {best['cpu_ops'] * 1e3:7.1f} ms   "
          f"speed-up {best['torch'] / best['cpu_ops']:.2f}x", flush=True)
    for mode in best:
        cpu_ops.set_enabled(mode == "cpu_ops")
        bd = breakdown(inp)
        print(f"    {mode:8s} profile (ms): " + "  ".join(f"{k} {v:.1f}" for k, v in sorted(bd.items())), flush=True)
    cpu_ops.set_enabled(True)
