#!/usr/bin/env python
"""The paged decode attention kernel alone (cpu_ops.paged_decode) at a decode step's shapes, as effective GB/s of
keys and values read (per second of wall time, and per second of the process's CPU time: the figure to trust on a
shared machine). Pools are laid out as the engine's ([N, bs, Hkv, D], blocks of a sequence scattered) and one
pool per layer is cycled through, --mbytes of keys and values in all, so a call reads its pool from DRAM as a real
step does (30 layers of 32 x 200 tokens are ~150 MB) instead of from cache.

--against DIR builds a second library from the kernel sources in DIR (a copy of kernels/cpu/ from another commit)
and times the two alternately in this one process (the machine may be shared: rounds interleaved, best of each).

    python bench/decode_attn_micro.py [--dtype bfloat16] [--threads 1,2] [--against /tmp/old_cpu] [--rounds 5]
                                      [--in-order] [--mbytes 160]
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sysinfo import banner  # noqa: E402

from flowrt.engine.cpu import build as cpu_build, ops as cpu_ops  # noqa: E402

SMOLLM = dict(Hkv=3, G=3, D=64)  # SmolLM2-135M: 9 query heads, 3 KV heads, head size 64
SHAPES = ((32, 200), (32, 600), (8, 1000), (1, 2000))  # (sequences, context)


def load_from(src: Path) -> ctypes.CDLL:
    """The running variant's library built from the sources in `src` (cached like the engine's own)."""
    isa = cpu_build.choose()
    old = cpu_build.SOURCE_DIR
    cpu_build.SOURCE_DIR = Path(src)
    try:
        return cpu_build.load(isa)
    finally:
        cpu_build.SOURCE_DIR = old


def pools(B, L, bs, dtype, mbytes, seed=0, scattered=True):
    """One layer's pools per entry, enough layers for `mbytes` of keys and values, each sequence's blocks scattered
    over its pool (else in order, as a fresh engine allocates them); the queries, block tables and lengths the layers
    share."""
    g = torch.Generator().manual_seed(seed)
    Hkv, G, D = SMOLLM["Hkv"], SMOLLM["G"], SMOLLM["D"]
    nblk = (L + bs - 1) // bs
    N = B * nblk + 4
    layer_bytes = 2 * N * bs * Hkv * D * torch.finfo(dtype).bits // 8
    layers = max(1, int(mbytes * 2**20 // layer_bytes))
    kv = [(torch.randn(N, bs, Hkv, D, generator=g).to(dtype), torch.randn(N, bs, Hkv, D, generator=g).to(dtype))
          for _ in range(layers)]
    order = torch.randperm(N, generator=g) if scattered else torch.arange(N)
    tables = order[: B * nblk].view(B, nblk).to(torch.int32).contiguous()
    q = torch.randn(B, Hkv * G, D, generator=g).to(dtype)
    return q, kv, tables, torch.full((B,), L, dtype=torch.int32)


def caller(lib, q, tables, seq_lens, out, scale):
    """f(kc, vc): one paged_decode call of `lib`, straight through ctypes (no wrapper checks)."""
    fn = getattr(lib, "paged_decode_bf16" if q.dtype == torch.bfloat16 else "paged_decode_f32")
    B, H, D = q.shape

    def f(kc, vc):
        bs, Hkv = kc.shape[1], kc.shape[2]
        fn(q.data_ptr(), q.stride(0), kc.data_ptr(), vc.data_ptr(), tables.data_ptr(), tables.stride(0),
           seq_lens.data_ptr(), None, 0, out.data_ptr(), out.stride(0), None, B, H, Hkv, D, bs, scale, 0)
    return f


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--mbytes", type=float, default=160.0, help="keys + values cycled through per shape")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--in-order", action="store_true", help="each sequence's blocks in order (not scattered)")
    ap.add_argument("--against", type=Path, action="append", default=[],
                    help="kernel sources to time alongside (A/B in one process; repeatable)")
    a = ap.parse_args()
    dtype = getattr(torch, a.dtype)
    assert cpu_ops.lib() is not None, cpu_ops._error
    print(banner())
    libs = {"this": cpu_ops.lib()}
    for src in a.against:
        libs[src.name] = load_from(src)
    scale = SMOLLM["D"] ** -0.5
    for nt in (int(t) for t in a.threads.split(",")):
        torch.set_num_threads(nt)
        for lib in libs.values():
            lib.flowrt_set_num_threads(nt)
        for B, L in SHAPES:
            q, kv, tables, seq_lens = pools(B, L, a.block_size, dtype, a.mbytes, scattered=not a.in_order)
            out = torch.empty_like(q)
            fns = {name: caller(lib, q, tables, seq_lens, out, scale) for name, lib in libs.items()}
            results = {}
            for name, f in fns.items():
                f(*kv[0])
                results[name] = out.clone()
            diff = max(((r.float() - results["this"].float()).abs().max().item() for r in results.values()))
            nbytes = 2 * B * L * SMOLLM["Hkv"] * SMOLLM["D"] * q.element_size()
            best = {name: (1e9, 1e9) for name in fns}
            reps = max(1, min(200, int(2e8 // (nbytes * 1))))
            for _ in range(a.rounds):
                for name, f in fns.items():
                    for kc, vc in kv[:2]:
                        f(kc, vc)
                    w0, c0 = time.perf_counter(), time.process_time()
                    for i in range(reps):
                        kc, vc = kv[i % len(kv)]
                        f(kc, vc)
                    w, c = (time.perf_counter() - w0) / reps, (time.process_time() - c0) / reps
                    best[name] = (min(best[name][0], w), min(best[name][1], c))
            line = f"threads {nt}  {B:3d} x {L:5d}  {nbytes / 2**20:6.2f} MiB x {len(kv):3d} layers"
            for name, (w, c) in best.items():
                line += f"  | {name}: {w * 1e3:6.3f} ms wall {c * 1e3:6.3f} cpu ms, {nbytes / w / 1e9:4.1f} GB/s wall {nbytes / c / 1e9:4.1f} cpu"
            if len(results) > 1:
                line += f"  | max|diff| {diff:.3g}"
            print(line, flush=True)


if __name__ == "__main__":
    main()
