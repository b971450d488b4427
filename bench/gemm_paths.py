#!/usr/bin/env python
"""fp32/bf16 linear at the model's real shapes: MKL (F.linear) vs MKL-packed vs oneDNN-packed, side by side,
interleaved and repeated (noisy machines).   python bench/gemm_paths.py [--dtype float32] [--reps 5]"""
import argparse
import time

import torch
import torch.nn.functional as F

ap = argparse.ArgumentParser()
ap.add_argument("--dtype", default="float32")
ap.add_argument("--reps", type=int, default=5)
ap.add_argument("--ms", default="1,8,32,64,256,1024,2048")
ap.add_argument("--threads", type=int, default=0)
a = ap.parse_args()
dt = getattr(torch, a.dtype)
if a.threads:
    torch.set_num_threads(a.threads)
clock = time.thread_time if a.threads == 1 else time.perf_counter
shapes = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}
torch.manual_seed(0)


def paths(w, M):
    out = {"F.linear": lambda x: F.linear(x, w)}
    try:
        wm = torch.ops.mkl._mkl_reorder_linear_weight(w, M)
        out["mkl_packed"] = lambda x: torch.ops.mkl._mkl_linear(x, wm, w, None, M)
    except Exception as e:  # noqa
        pass
    try:
        wd = torch.ops.mkldnn._reorder_linear_weight(w, M)
        out["onednn_packed"] = lambda x: torch.ops.mkldnn._linear_pointwise(x, wd, None, "none", [], "")
        if M != 32:  # the engine packs once with batch hint 32 for every row count: what that costs elsewhere
            w32 = torch.ops.mkldnn._reorder_linear_weight(w, 32)
            out["onednn_packed@32"] = lambda x: torch.ops.mkldnn._linear_pointwise(x, w32, None, "none", [], "")
    except Exception as e:  # noqa
        print("onednn", e)
    return out


with torch.inference_mode():
    for M in [int(m) for m in a.ms.split(",")]:
        for name, (N, K) in shapes.items():
            if name == "lm_head" and M > 64:
                continue
            w = torch.randn(N, K, dtype=dt) * 0.05
            x = torch.randn(M, K, dtype=dt)
            ps = paths(w, M)
            ref = ps["F.linear"](x)
            for k, f in ps.items():
                assert torch.allclose(f(x).float(), ref.float(), atol=2e-2 if dt == torch.bfloat16 else 1e-3,
                                      rtol=2e-2 if dt == torch.bfloat16 else 1e-3), k
            iters = max(3, int(2e8 / (2 * M * N * K)))
            best = {k: 1e9 for k in ps}
            for _ in range(a.reps):
                for k, f in ps.items():
                    f(x)
                    t = clock()
                    for _ in range(iters):
                        f(x)
                    best[k] = min(best[k], (clock() - t) / iters)
            fl = 2 * M * N * K
            print(f"M={M:5d} {name:8s} " + "  ".join(f"{k} {fl / v / 1e9:6.1f} GF/s" for k, v in best.items()), flush=True)
