#!/usr/bin/env python
"""All of a step's projections as the engine runs them, weights streaming from memory: the 30 layers' distinct
qkv / o / gate_up / down weights of SmolLM2-135M plus the LM head at M rows, plain MKL (F.linear), oneDNN with
prepacked weights and flowrt's own packed kernel (cpu_ops.PackedLinear, float32 with AVX2: what the engine runs),
interleaved, best of --reps. This chose LlamaModel.pack_cpu_weights' paths: warm single-shape benchmarks
(bench/gemm_paths.py) hide the memory side.

    python bench/gemm_cold.py [--rows 16,32,64,128,512,2048] [--threads 0] [--reps 5]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sysinfo import banner  # noqa: E402

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (N, K): qkv, o, gate_up, down
LAYERS, VOCAB, HIDDEN = 30, 49152, 576


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="16,32,64,128,512,2048")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(banner("float32", "projections of all 30 layers + LM head, cold weights"))
    torch.manual_seed(0)
    plain = [[torch.randn(n, k) * 0.02 for n, k in SHAPES] for _ in range(LAYERS)] + [[torch.randn(VOCAB, HIDDEN)]]
    packed = [[torch.ops.mkldnn._reorder_linear_weight(w, 32) for w in ws] for ws in plain]
    from flowrt.engine.cpu import ops as cpu_ops

    own = [[cpu_ops.PackedLinear.create(w) for w in ws] for ws in plain]
    if any(p is None for ps in own for p in ps):
        own = None  # no compiler or no AVX2 + FMA: the engine uses oneDNN / MKL there
    for m in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(m, k) for k in (576, 1536)}

        def run_plain():
            for ws in plain:
                for w in ws:
                    F.linear(xs[w.shape[1]], w)

        def run_packed():
            for ps, ws in zip(packed, plain):
                for p, w in zip(ps, ws):
                    torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "")

        def run_own():
            for ps, ws in zip(own, plain):
                for p, w in zip(ps, ws):
                    p(xs[w.shape[1]])

        flops = 2 * m * (LAYERS * sum(n * k for n, k in SHAPES) + VOCAB * HIDDEN)
        paths = [("mkl", run_plain), ("onednn-packed", run_packed)] + ([("flowrt-packed", run_own)] if own else [])
        best = {name: 1e9 for name, _ in paths}
        with torch.inference_mode():
            for _ in range(args.reps):
                for name, f in paths:
                    t = time.perf_counter()
                    f()
                    best[name] = min(best[name], time.perf_counter() - t)
        print(f"M={m:5d}  " + "  ".join(f"{k} {v * 1e3:8.1f} ms ({flops / v / 1e9:5.1f} GFLOP/s)"
                                        for k, v in best.items())
              + "".join(f"  {k}/mkl {best['mkl'] / best[k]:.2f}x" for k in best if k != "mkl"))


if __name__ == "__main__":
    main()
