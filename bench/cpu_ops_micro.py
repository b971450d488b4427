#!/usr/bin/env python
"""Per-op: flowrt.engine.cpu.ops kernels vs the plain-torch code they replace, side by side, interleaved,
best of --reps (noisy machines). SmolLM2-135M shapes, float32.   python bench/cpu_ops_micro.py"""
import argparse
import time

import torch

from flowrt.engine.cpu import ops as cpu_ops
from flowrt.engine.model.attention import AttentionMetadata, TorchAttentionBackend
from flowrt.engine.model.models.llama import rms_norm, rotate_half

ap = argparse.ArgumentParser()
ap.add_argument("--reps", type=int, default=7)
ap.add_argument("--threads", type=int, default=0)
a = ap.parse_args()
if a.threads:
    torch.set_num_threads(a.threads)
assert cpu_ops.lib() is not None, cpu_ops._error
clock = time.thread_time if a.threads == 1 else time.perf_counter


def bench(fns, iters=20):
    best = {k: 1e9 for k in fns}
    for _ in range(a.reps):
        for k, f in fns.items():
            f()
            t = clock()
            for _ in range(iters):
                f()
            best[k] = min(best[k], (clock() - t) / iters)
    return best


def show(name, best):
    base = best["torch"]
    print(f"{name:34s} " + "  ".join(f"{k} {v * 1e3:7.3f} ms" for k, v in best.items())
          + f"   speed-up {base / best['cpu_ops']:.2f}x", flush=True)


def make_meta(B, ctx, bs=16, N=None):
    nblk = (ctx + bs - 1) // bs
    N = N or B * nblk + 8
    perm = torch.randperm(N)[: B * nblk].view(B, nblk).int()
    qsl = torch.arange(B + 1, dtype=torch.int32)
    lens = [ctx - (i * 7) % 40 for i in range(B)]
    slots = torch.tensor([int(perm[b, (L - 1) // bs]) * bs + (L - 1) % bs for b, L in enumerate(lens)])
    return AttentionMetadata(slots, qsl, torch.tensor(lens, dtype=torch.int32), perm, [1] * B, lens, 1, max(lens), bs), N


with torch.inference_mode():
    H, Hkv, D, E, FF = 9, 3, 64, 576, 1536
    for B, ctx in [(32, 150), (32, 400), (8, 1100)]:
        meta, N = make_meta(B, ctx)
        kc, vc = torch.randn(N, 16, Hkv, D), torch.randn(N, 16, Hkv, D)
        q, k, v = torch.randn(B, H, D), torch.randn(B, Hkv, D), torch.randn(B, Hkv, D)
        be = TorchAttentionBackend()
        cpu_ops.set_enabled(False)
        m1 = AttentionMetadata(**{f: getattr(meta, f) for f in meta.__dataclass_fields__ if f != "prepared"})
        be.prepare(m1)
        cpu_ops.set_enabled(True)
        m2 = AttentionMetadata(**{f: getattr(meta, f) for f in meta.__dataclass_fields__ if f != "prepared"})
        be.prepare(m2)
        cpu_ops.set_enabled(False)
        ref = be.forward(q, k, v, kc, vc, m1, 0.125)
        cpu_ops.set_enabled(True)
        got = be.forward(q, k, v, kc, vc, m2, 0.125)
        torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)

        def t_att():
            cpu_ops.set_enabled(False)
            r = be.forward(q, k, v, kc, vc, m1, 0.125)
            cpu_ops.set_enabled(True)
            return r

        show(f"decode attn B={B} ctx~{ctx} (1 layer)", bench({"torch": t_att,
                                                         "cpu_ops": lambda: be.forward(q, k, v, kc, vc, m2, 0.125)}))
    for T in (32, 2048):
        h, d, w = torch.randn(T, E), torch.randn(T, E), torch.randn(E)

        def t_norm():
            hh = h + d
            return rms_norm(hh, w, 1e-5)

        def c_norm():
            hh = h.clone()
            return cpu_ops.add_rmsnorm(hh, d, w, 1e-5)

        torch.testing.assert_close(c_norm(), t_norm(), atol=1e-5, rtol=1e-5)
        show(f"add+rmsnorm T={T}", bench({"torch": t_norm, "cpu_ops": c_norm}))
        qkv = torch.randn(T, (H + 2 * Hkv) * D)
        cos, sin = torch.randn(4096, D), torch.randn(4096, D)
        pos = torch.randint(0, 4096, (T,))

        def t_rope():
            qk = qkv[:, : (H + Hkv) * D].view(T, H + Hkv, D)
            c, s = cos[pos].unsqueeze(1), sin[pos].unsqueeze(1)
            return qk * c + rotate_half(qk) * s

        def c_rope():
            x = qkv.clone()
            cpu_ops.rope_(x, H + Hkv, D, cos, sin, pos)
            return x

        torch.testing.assert_close(c_rope()[:, : (H + Hkv) * D].view(T, H + Hkv, D), t_rope())
        show(f"rotary T={T}", bench({"torch": t_rope, "cpu_ops": c_rope}))
