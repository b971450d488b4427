#!/usr/bin/env python
"""Quantized projections (engine.quant.QuantLinear over GGUF blocks, the CPU kernels of kernels/cpu/quant_*.cpp)
against float32 cpu_ops.PackedLinear (what a float32 step runs), on SmolLM2-135M's and a 1B Llama's projection
shapes, weights cold as in a real step: each path cycles through enough copies of a shape's weight to exceed the
caches. Random blocks (scales replaced by small finite values): speed does not depend on the values. Prints the best
wall time of --reps interleaved rounds per (shape, rows), the ratio to float32, and at one row the weight stream in
GB/s. K-quants need K a multiple of 256 (SmolLM2's 576 is not: n/a there, as llama-quantize falls back too).

    python bench/quant_gemm.py [--types Q8_0,Q4_K,Q6_K,Q4_0,Q4_1] [--rows 1,4,16,64,512] [--threads 0] [--reps 3]
                               [--models smollm2,1b] [--clock wall|cpu] [--dtype float32|bfloat16]

--dtype bfloat16 times what dtype="auto" runs on AVX512-BF16 CPUs (from 10 rows the weights dequantized to bfloat16,
on AMX tiles where the CPU has them), against cpu_ops.PackedLinearBF16 (the "f32" column then holds that baseline).

--clock cpu times the process's CPU time instead of the wall clock: on a shared, busy host (where other processes
take the cores) with --threads 1 it still measures the kernels' own work; wall time is what a quiet machine sees.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sysinfo import banner  # noqa: E402

# (name, N, K) per model
SHAPES = {
    "smollm2": [("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536),
                ("lm_head", 49152, 576)],
    "1b": [("qkv", 3072, 2048), ("o", 2048, 2048), ("gate_up", 16384, 2048), ("down", 2048, 8192)],
}
COLD_BYTES = 96 << 20  # per path and shape: past the L3 of the machines this runs on


def random_blocks(qtype, n: int, k: int, g: torch.Generator) -> torch.Tensor:
    from flowrt.engine.quant import block_shape
    from flowrt.engine.quant.formats import QuantType

    per, nbytes = block_shape(qtype)
    data = torch.randint(0, 256, (n * (k // per), nbytes), dtype=torch.uint8, generator=g)
    fields = {QuantType.Q4_1: [0, 2], QuantType.Q5_1: [0, 2], QuantType.Q4_K: [0, 2], QuantType.Q5_K: [0, 2],
              QuantType.Q2_K: [80, 82], QuantType.Q3_K: [108], QuantType.Q6_K: [208]}.get(qtype, [0])
    for off in fields:
        data[:, off:off + 2] = (torch.rand(data.shape[0], generator=g) * 0.02).half().view(torch.uint8).view(-1, 2)
    return data.reshape(n, -1)


def copies(nbytes: int) -> int:
    return max(1, -(-COLD_BYTES // nbytes))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", default="Q8_0,Q4_K,Q6_K,Q4_0,Q4_1")
    ap.add_argument("--rows", default="1,4,16,64,512")
    ap.add_argument("--models", default="smollm2,1b")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="the activations' dtype (bfloat16: what dtype='auto' runs on AVX512-BF16 CPUs; the baseline "
                         "is then cpu_ops.PackedLinearBF16)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from flowrt.engine.cpu import ops as cpu_ops
    from flowrt.engine.quant import QuantLinear, QuantType, block_shape

    if cpu_ops.lib() is None:
        sys.exit("the CPU kernels are unavailable here")
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    dtype = getattr(torch, args.dtype)
    packed = cpu_ops.PackedLinear if dtype == torch.float32 else cpu_ops.PackedLinearBF16
    print(banner(args.dtype, f"kernels {cpu_ops.isa()}, weights cold (>= {COLD_BYTES >> 20} MiB per path), "
                            f"{args.clock} time, best of {args.reps}"))
    types = [QuantType.parse(t) for t in args.types.split(",")]
    rows = [int(r) for r in args.rows.split(",")]
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for model in args.models.split(","):
            for name, n, k in SHAPES[model]:
                size = n * k * dtype.itemsize
                f32 = [packed.create((torch.randn(n, k) * 0.02).to(dtype)) for _ in range(copies(size))]
                paths = {"f32": (f32, size)}
                for t in types:
                    if k % block_shape(t)[0] == 0:
                        one = random_blocks(t, n, k, g)
                        paths[t.name] = ([QuantLinear(t, one if i == 0 else one.clone(), n, k)
                                          for i in range(copies(one.numel()))], one.numel())
                for m in rows:
                    x = torch.randn(m, k).to(dtype)
                    best = dict.fromkeys(paths, 1e9)
                    calls = {p: max(1, len(ws)) for p, (ws, _) in paths.items()}
                    for _ in range(args.reps):
                        for p, (ws, _) in paths.items():
                            t0 = clock()
                            for w in ws:
                                w(x)
                            best[p] = min(best[p], (clock() - t0) / calls[p])
                    line = f"{model:7s} {name:7s} N={n:5d} K={k:4d} M={m:4d}  f32 {best['f32'] * 1e3:7.3f} ms"
                    for p in paths:
                        if p != "f32":
                            line += f" | {p} {best[p] * 1e3:7.3f} ms {best['f32'] / best[p]:5.2f}x"
                            if m == 1:
                                line += f" {paths[p][1] / best[p] / 1e9:5.1f} GB/s"
                    if m == 1:
                        line += f" | f32 {paths['f32'][1] / best['f32'] / 1e9:5.1f} GB/s"
                    skipped = [t.name for t in types if t.name not in paths]
                    print(line + (f" | n/a: {','.join(skipped)}" if skipped else ""), flush=True)


if __name__ == "__main__":
    main()
