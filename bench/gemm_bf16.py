#!/usr/bin/env python
"""bfloat16 projections at decode row counts: oneDNN with prepacked weights (what the engine ran) against flowrt's
AVX512-BF16 kernel (cpu_ops.PackedLinearBF16), per SmolLM2-135M shape and row count, in-process A/B.

Each shape has --copies distinct weights (30: one per layer, as a step touches them) cycled through, so the weights
stream from memory as in a real step (the LM head, 56 MB, is cold by itself). The two paths alternate call by call
for --reps rounds and each keeps its best round. --clock thread: the main thread's CPU time with one thread (time
others' processes take on a shared host does not count); wall: wall time (for --threads 2, where the CPU time of
one thread would miss its partner's work).

    python bench/gemm_bf16.py [--rows 1,2,4,8,16,32,64] [--threads 2] [--clock wall|thread] [--reps 7]

--generate MODEL_DIR: end to end instead: two bf16 engines on the model, one with the kernel (as the engine packs it)
and one without (oneDNN for every projection), alternating greedy generate calls of --batches x --tokens tokens.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sysinfo import banner  # noqa: E402

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,4,8,16,32,64")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--clock", choices=("wall", "thread"), default="wall")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--copies", type=int, default=30)
    ap.add_argument("--generate", metavar="MODEL_DIR")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from flowrt.engine.cpu import ops as cpu_ops

    if cpu_ops.PackedLinearBF16.create(torch.zeros(32, 2, dtype=torch.bfloat16)) is None:
        sys.exit(f"no AVX512-BF16 kernel here (loaded variant: {cpu_ops.isa()})")
    clock = time.perf_counter if args.clock == "wall" else time.thread_time
    if args.generate:
        return generate(args, clock)
    print(banner("bfloat16", f"oneDNN prepacked vs flowrt gemm_bf16, cold weights, clock {args.clock}"))
    torch.manual_seed(0)
    rows = [int(r) for r in args.rows.split(",")]
    for name in args.shapes.split(","):
        N, K = SHAPES[name]
        copies = 1 if name == "lm_head" else args.copies
        ws = [(torch.randn(N, K) * 0.02).bfloat16() for _ in range(copies)]
        onednn = [torch.ops.mkldnn._reorder_linear_weight(w, 32) for w in ws]
        own = [cpu_ops.PackedLinearBF16.create(w) for w in ws]
        del ws
        for m in rows:
            x = torch.randn(m, K).bfloat16()
            paths = {
                "onednn": lambda: [torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "") for p in onednn],
                "flowrt": lambda: [p(x) for p in own],
            }
            best = dict.fromkeys(paths, 1e9)
            with torch.inference_mode():
                for f in paths.values():
                    f()
                for _ in range(args.reps):
                    for k, f in paths.items():
                        t = clock()
                        f()
                        best[k] = min(best[k], (clock() - t) / copies)
            flops = 2 * m * N * K
            print(f"{name:8s} M={m:3d}  " + "  ".join(f"{k} {v * 1e6:8.1f} us ({flops / v / 1e9:6.1f} GFLOP/s)"
                                                     for k, v in best.items())
                  + f"  flowrt/onednn speedup {best['onednn'] / best['flowrt']:.2f}x", flush=True)


def generate(args, clock) -> None:
    from flowrt.engine import LLM, SamplingParams
    from flowrt.engine.cpu import ops as cpu_ops

    print(banner("bfloat16", f"generate with the gemm_bf16 kernel vs oneDNN only, clock {args.clock}"))
    engines = {"flowrt": LLM(args.generate, dtype="bfloat16")}
    create = cpu_ops.PackedLinearBF16.create
    cpu_ops.PackedLinearBF16.create = classmethod(lambda cls, *a, **k: None)
    try:
        engines["onednn"] = LLM(args.generate, dtype="bfloat16")
    finally:
        cpu_ops.PackedLinearBF16.create = create
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    for batch in (int(b) for b in args.batches.split(",")):
        reqs = [{"prompt_token_ids": [1, 500 + i, 42, 7]} for i in range(batch)]
        best = dict.fromkeys(engines, 1e9)
        for _ in range(args.reps):
            for k, llm in engines.items():
                t = clock()
                llm.generate(reqs, params)
                best[k] = min(best[k], clock() - t)
        print(f"batch {batch:3d} x {args.tokens} tokens  " + "  ".join(f"{k} {v * 1e3:8.1f} ms" for k, v in
                                                                    best.items())
              + f"  flowrt/onednn speedup {best['onednn'] / best['flowrt']:.2f}x", flush=True)


if __name__ == "__main__":
    main()
