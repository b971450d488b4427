#!/usr/bin/env python
"""One-shot GPU check of flowrt.kernels: correctness on realistic shapes, speed next to torch SDPA, then
the kernel test-suite run natively.

    python bench/gpu_check.py                 # everything, bf16, about 3-4 minutes on an H100/H200
    python bench/gpu_check.py --dtype fp16 --skip-pytest --budget 120

Shapes are Llama-3-8B's attention (32 query heads, 8 KV heads, head_dim 128), KV block size 16, KV in
randomly permuted blocks of a larger pool. For every case the kernel's output is checked against the
plain-torch reference (on a few sequences where the reference would be too big) and against
``torch.nn.functional.scaled_dot_product_attention`` run on the same K/V laid out contiguously, which
is also the speed baseline:

- batch-1 decode at 4k and 32k context (Llama-3-8B and SmolLM2 head shapes): bandwidth of eager calls and of
  CUDA-graph replays (GPU time alone, as the engine's decode graphs run it), each vs SDPA timed the same way;
- decode: achieved bandwidth = bytes of K and V the step must read / kernel time (GB/s);
- prefill: TFLOP/s = 4 * head_dim * num_heads * (sum over queries of visible keys) / time.

Errors are max |out - expected| / (1 + |expected|), checked against 2e-2 (bf16) or 3e-3 (fp16).
Every case is independent: an exception is printed and the next case runs. A time budget (--budget,
default 140 s for the benchmark part) skips the remaining cases rather than overrun; the pytest run
gets its own timeout. Exits 2 without a CUDA device, 1 if any check failed, else 0.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import math
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

SMOKE = "--smoke" in sys.argv  # tiny shapes on CPU through Triton's interpreter: checks this script itself
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"
else:
    os.environ.pop("TRITON_INTERPRET", None)  # compile natively; the interpreter is for CPU-only machines
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
H, HKV, D, BS = 32, 8, 128, 16
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
TOL = {torch.bfloat16: 2e-2, torch.float16: 3e-3}

DECODE_CASES = [  # (batch, context)
    (1, 128), (1, 4096), (1, 32768), (8, 8192), (16, 32768), (32, 4096), (64, 2048),
    (128, 1024), (256, 128), (256, 2048), (256, 4096),
]
PREFILL_CASES = [  # (batch, new tokens per sequence, cached prefix per sequence)
    (1, 512, 0), (1, 4096, 0), (1, 16384, 0), (4, 2048, 0), (1, 2048, 30720),
    (16, 256, 1792), (8, 1024, 3072), (64, 128, 128),
]

if SMOKE:
    H, HKV, D, BS = 4, 2, 64, 16
    DECODE_CASES = [(1, 40), (3, 700)]
    PREFILL_CASES = [(1, 70, 0), (2, 20, 45)]

DEV = torch.device("cpu" if SMOKE else "cuda")
FAILURES: list[str] = []


def load_kernels():
    try:
        return importlib.import_module("flowrt.kernels")
    except ImportError:
        # flowrt not installed: load kernels/ straight from the checkout
        spec = importlib.util.spec_from_file_location(
            "flowrt_kernels", REPO / "kernels" / "__init__.py", submodule_search_locations=[str(REPO / "kernels")]
        )
        mod = importlib.util.module_from_spec(spec)
        sys.modules["flowrt_kernels"] = mod
        spec.loader.exec_module(mod)
        return mod


def bench_ms(fn) -> float:
    if SMOKE:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    from triton.testing import do_bench

    return do_bench(fn, warmup=10, rep=40, return_mode="median")


def empty_cache():
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def num_sms() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count if DEV.type == "cuda" else 1


def err(a, b) -> float:
    """max |a - b| / (1 + |b|): the abs+rel criterion of the tests with atol = rtol = TOL[dtype]."""
    a, b = a.float(), b.float()
    return ((a - b).abs() / (1 + b.abs())).max().item()


def verdict(name: str, e: float, tol: float) -> str:
    if not math.isfinite(e) or e > tol:
        FAILURES.append(f"{name}: max err {e:.3g} > {tol:g}")
        return "FAIL"
    return "ok"


def paged_batch(lens, dtype, dev, gen):
    """K/V pools holding sequences of the given lengths in randomly permuted blocks, plus the contiguous
    copies [B, HKV, max_len, D] (zero-padded) that SDPA gets."""
    nblk = [-(-n // BS) for n in lens]
    need = sum(nblk)
    num_blocks = need + need // 2 + 16
    k_cache = torch.randn((num_blocks, BS, HKV, D), dtype=dtype, device=dev, generator=gen)
    v_cache = torch.randn((num_blocks, BS, HKV, D), dtype=dtype, device=dev, generator=gen)
    perm = torch.randperm(num_blocks, device=dev, generator=gen)[:need].to(torch.int32)
    width = max(nblk)
    bt = torch.zeros((len(lens), width), dtype=torch.int32, device=dev)
    i = 0
    for b, n in enumerate(nblk):
        bt[b, :n] = perm[i : i + n]
        i += n
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=dev)
    return k_cache, v_cache, bt, seq_lens


def contiguous_kv(cache, bt, length):
    """[B, HKV, length, D] for sequences that all have `length` tokens."""
    nblk = -(-length // BS)
    x = cache[bt[:, :nblk].long()]  # [B, nblk, BS, HKV, D]
    return x.reshape(bt.shape[0], nblk * BS, HKV, D)[:, :length].transpose(1, 2).contiguous()


def sdpa_fn(q, k, v, **kw):
    """SDPA with GQA; falls back to expanding K/V when this torch has no enable_gqa."""
    import torch.nn.functional as F

    try:
        F.scaled_dot_product_attention(q[:1], k[:1], v[:1], enable_gqa=True, **kw)
        return (lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kw)), "gqa"
    except Exception:  # noqa: BLE001
        rep = q.shape[1] // k.shape[1]
        ke, ve = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        return (lambda: F.scaled_dot_product_attention(q, ke, ve, **kw)), "expanded"


def baseline(make, compare):
    """Time torch SDPA and compare its output with ours; never fatal. -> (ms, max err, note)."""
    try:
        fn, how = make()
        e = compare(fn())
        ms = bench_ms(fn)
        return ms, e, "" if how == "gqa" else " (sdpa on expanded K/V)"
    except Exception as exc:  # noqa: BLE001
        return float("nan"), float("nan"), f" (sdpa failed: {type(exc).__name__}: {str(exc)[:120]})"


def finite_max(*errs) -> float:
    """The worst error among the checks that ran (NaN means the check did not run); inf if none ran."""
    ran = [e for e in errs if e == e]
    return max(ran) if ran else float("inf")


def out_of_time(t0, budget, what) -> bool:
    if time.time() - t0 > budget:
        print(f"  {what}: skipped (time budget of {budget:.0f}s spent)")
        return True
    return False


# ------------------------------------------------------------------------------------------------ decode
def run_decode(K, dtype, t0, budget):
    print(f"\n== paged decode: H={H} Hkv={HKV} D={D} block={BS} {dtype} ==")
    print(f"{'batch':>5} {'ctx':>6} {'split':>5} {'us':>8} {'GB/s':>7} {'us(1sp)':>8} {'sdpa us':>8} {'sdpa GB/s':>9}"
          f" {'err/ref':>8} {'err/sdpa':>8}  check")
    dev = DEV
    esize = torch.finfo(dtype).bits // 8
    for bsz, ctx in DECODE_CASES:
        if out_of_time(t0, budget, f"decode {bsz}x{ctx}"):
            return
        try:
            gen = torch.Generator(device=dev).manual_seed(bsz * 7 + ctx)
            k_cache, v_cache, bt, seq_lens = paged_batch([ctx] * bsz, dtype, dev, gen)
            q = torch.randn((bsz, H, D), dtype=dtype, device=dev, generator=gen)
            scale = D**-0.5
            splits = K.choose_num_splits(bsz, HKV, ctx, num_sms())

            def run():
                return K.paged_decode_attention(q, k_cache, v_cache, bt, seq_lens, scale, max_seq_len=ctx)

            out = run()
            nref = min(bsz, 4)
            ref = K.paged_decode_attention_ref(q[:nref], k_cache, v_cache, bt[:nref], seq_lens[:nref], scale)
            e_ref = err(out[:nref], ref)
            ms = bench_ms(run)
            ms1 = bench_ms(lambda: K.paged_decode_attention(q, k_cache, v_cache, bt, seq_lens, scale, num_splits=1)) \
                if splits > 1 else ms
            kc, vc = contiguous_kv(k_cache, bt, ctx), contiguous_kv(v_cache, bt, ctx)
            del k_cache, v_cache
            ms_sd, e_sdpa, note = baseline(lambda: sdpa_fn(q[:, :, None], kc, vc, scale=scale),  # noqa: F821 - closure var, del'd only after last call
                                           lambda r: err(out, r[:, :, 0]))
            ok = verdict(f"decode {bsz}x{ctx}", finite_max(e_ref, e_sdpa), TOL[dtype])
            nbytes = 2 * bsz * ctx * HKV * D * esize
            print(f"{bsz:>5} {ctx:>6} {splits:>5} {ms * 1e3:>8.1f} {nbytes / ms / 1e6:>7.0f} {ms1 * 1e3:>8.1f}"
                  f" {ms_sd * 1e3:>8.1f} {nbytes / ms_sd / 1e6:>9.0f} {e_ref:>8.1e} {e_sdpa:>8.1e}  {ok}{note}",
                  flush=True)
            del kc, vc, q, out, ref
        except Exception as exc:  # noqa: BLE001
            FAILURES.append(f"decode {bsz}x{ctx}: {type(exc).__name__}")
            print(f"{bsz:>5} {ctx:>6}  ERROR {type(exc).__name__}: {str(exc)[:300]}")
            traceback.print_exc(limit=3)
        empty_cache()

    # a ragged batch: mixed lengths, ending mid-block and on block boundaries, auto split-K
    try:
        gen = torch.Generator(device=dev).manual_seed(1)
        lens = [1, 15, 16, 17, 100, 300] if SMOKE else [1, 15, 16, 17, 4096, 31999, 32768, 777]
        k_cache, v_cache, bt, seq_lens = paged_batch(lens, dtype, dev, gen)
        q = torch.randn((len(lens), H, D), dtype=dtype, device=dev, generator=gen)
        out = K.paged_decode_attention(q, k_cache, v_cache, bt, seq_lens, D**-0.5)
        ref = K.paged_decode_attention_ref(q, k_cache, v_cache, bt, seq_lens, D**-0.5)
        e = err(out, ref)
        print(f"ragged decode batch {lens}: err/ref {e:.1e}  {verdict('ragged decode', e, TOL[dtype])}")
    except Exception as exc:  # noqa: BLE001
        FAILURES.append(f"ragged decode: {type(exc).__name__}")
        print(f"ragged decode: ERROR {type(exc).__name__}: {str(exc)[:300]}")
    empty_cache()


# ------------------------------------------------------------------------------------------------ batch-1 decode
B1_SHAPES = [(32, 8, 128), (9, 3, 64)]  # (heads, KV heads, head_dim): Llama-3-8B, SmolLM2-135M
B1_CONTEXTS = [4096, 32768]
if SMOKE:
    B1_SHAPES, B1_CONTEXTS = [(4, 2, 64)], [300]


def bench_graph_ms(fn) -> float:
    """Median ms of fn replayed from a CUDA graph: GPU time without Python launch overhead (how the engine's
    decode graphs run it). Falls back to plain timing in the smoke test."""
    if SMOKE:
        return bench_ms(fn)
    from triton.testing import do_bench_cudagraph

    return do_bench_cudagraph(fn, rep=40, return_mode="median")


def run_batch1(K, dtype, t0, budget):
    """Batch-1 decode attention at long context vs SDPA (the split-K heuristic's case; target >= 70% of SDPA)."""
    print(f"\n== batch-1 decode attention vs SDPA, {num_sms()} SMs, {dtype}: eager calls and CUDA-graph replays ==")
    print(f"{'H/Hkv/D':>9} {'ctx':>6} {'split':>5} {'GB/s':>7} {'graph GB/s':>10} {'sdpa GB/s':>9} {'sdpa graph':>10}"
          f" {'ratio':>6} {'graph ratio':>11}  check")
    dev = DEV
    esize = torch.finfo(dtype).bits // 8
    for h, hkv, d in B1_SHAPES:
        for ctx in B1_CONTEXTS:
            if out_of_time(t0, budget, f"batch-1 decode {h}/{hkv}/{d} x {ctx}"):
                return
            try:
                gen = torch.Generator(device=dev).manual_seed(ctx + h)
                nblk = -(-ctx // BS)
                k_cache = torch.randn((nblk + 8, BS, hkv, d), dtype=dtype, device=dev, generator=gen)
                v_cache = torch.randn((nblk + 8, BS, hkv, d), dtype=dtype, device=dev, generator=gen)
                bt = (torch.randperm(nblk + 8, device=dev, generator=gen)[:nblk].to(torch.int32))[None]
                seq_lens = torch.tensor([ctx], dtype=torch.int32, device=dev)
                q = torch.randn((1, h, d), dtype=dtype, device=dev, generator=gen)
                scale = d**-0.5
                splits = K.choose_num_splits(1, hkv, ctx, num_sms())
                out = torch.empty_like(q)

                def ours():
                    return K.paged_decode_attention(q, k_cache, v_cache, bt, seq_lens, scale, out=out, max_seq_len=ctx)

                ours()
                e_ref = err(out, K.paged_decode_attention_ref(q, k_cache, v_cache, bt, seq_lens, scale))
                kc = k_cache[bt[0].long()].reshape(1, nblk * BS, hkv, d)[:, :ctx].transpose(1, 2).contiguous()
                vc = v_cache[bt[0].long()].reshape(1, nblk * BS, hkv, d)[:, :ctx].transpose(1, 2).contiguous()
                sd, _ = sdpa_fn(q[:, :, None], kc, vc, scale=scale)
                nbytes = 2 * ctx * hkv * d * esize
                gbs = [nbytes / bench(fn) / 1e6 for fn in (ours, sd) for bench in (bench_ms, bench_graph_ms)]
                ratio, gratio = gbs[0] / gbs[2], gbs[1] / gbs[3]
                ok = verdict(f"batch-1 decode {h}/{hkv}/{d}x{ctx}", e_ref, TOL[dtype])
                target = "" if SMOKE else (" (>= 70% of SDPA in graphs: " + ("met)" if gratio >= 0.7 else "NOT MET)"))
                print(f"{f'{h}/{hkv}/{d}':>9} {ctx:>6} {splits:>5} {gbs[0]:>7.0f} {gbs[1]:>10.0f} {gbs[2]:>9.0f}"
                      f" {gbs[3]:>10.0f} {ratio:>6.2f} {gratio:>11.2f}  {ok}{target}", flush=True)
            except Exception as exc:  # noqa: BLE001
                FAILURES.append(f"batch-1 decode {h}/{hkv}/{d}x{ctx}: {type(exc).__name__}")
                print(f"{h}/{hkv}/{d} {ctx}: ERROR {type(exc).__name__}: {str(exc)[:300]}")
                traceback.print_exc(limit=3)
            empty_cache()


# ------------------------------------------------------------------------------------------------ prefill
def run_prefill(K, dtype, t0, budget):
    print(f"\n== paged prefill (causal over cached prefix + new tokens): H={H} Hkv={HKV} D={D} block={BS} {dtype} ==")
    print(f"{'batch':>5} {'q_len':>6} {'prefix':>6} {'ms':>8} {'TFLOP/s':>8} {'sdpa ms':>8} {'sdpa TF/s':>9}"
          f" {'err/ref':>8} {'err/sdpa':>8}  check")
    dev = DEV
    for bsz, qlen, prefix in PREFILL_CASES:
        if out_of_time(t0, budget, f"prefill {bsz}x{qlen}+{prefix}"):
            return
        try:
            ctx = prefix + qlen
            gen = torch.Generator(device=dev).manual_seed(bsz * 13 + qlen + prefix)
            k_cache, v_cache, bt, seq_lens = paged_batch([ctx] * bsz, dtype, dev, gen)
            q = torch.randn((bsz * qlen, H, D), dtype=dtype, device=dev, generator=gen)
            qsl = torch.arange(0, bsz + 1, dtype=torch.int32, device=dev) * qlen
            scale = D**-0.5
            run = lambda: K.paged_prefill_attention(q, k_cache, v_cache, bt, qsl, seq_lens, scale, qlen)  # noqa: E731
            out = run()
            # the fp32 reference materialises [H, q_len, ctx] scores per sequence: keep it small
            nref = min(bsz, 2) if H * qlen * ctx <= 2**31 else 0
            e_ref = float("nan")
            if nref:
                ref = K.paged_prefill_attention_ref(q[: nref * qlen], k_cache, v_cache, bt[:nref], qsl[: nref + 1],
                                                    seq_lens[:nref], scale, qlen)
                e_ref = err(out[: nref * qlen], ref)
                del ref
            ms = bench_ms(run)
            kc, vc = contiguous_kv(k_cache, bt, ctx), contiguous_kv(v_cache, bt, ctx)
            del k_cache, v_cache
            qc = q.view(bsz, qlen, H, D).transpose(1, 2).contiguous()

            def make():
                if prefix == 0:
                    return sdpa_fn(qc, kc, vc, scale=scale, is_causal=True)  # noqa: F821 - closure var, del'd only after last call
                from torch.nn.attention.bias import causal_lower_right

                return sdpa_fn(qc, kc, vc, scale=scale, attn_mask=causal_lower_right(qlen, ctx))  # noqa: F821 - closure var, del'd only after last call

            ms_sd, e_sdpa, note = baseline(make, lambda r: err(out.view(bsz, qlen, H, D), r.transpose(1, 2)))
            ok = verdict(f"prefill {bsz}x{qlen}+{prefix}", finite_max(e_ref, e_sdpa), TOL[dtype])
            visible = bsz * (qlen * prefix + qlen * (qlen + 1) / 2)
            flops = 4 * D * H * visible
            print(f"{bsz:>5} {qlen:>6} {prefix:>6} {ms:>8.3f} {flops / ms / 1e9:>8.1f} {ms_sd:>8.3f}"
                  f" {flops / ms_sd / 1e9:>9.1f} {e_ref:>8.1e} {e_sdpa:>8.1e}  {ok}{note}", flush=True)
            del kc, vc, q, qc, out
        except Exception as exc:  # noqa: BLE001
            FAILURES.append(f"prefill {bsz}x{qlen}+{prefix}: {type(exc).__name__}")
            print(f"{bsz:>5} {qlen:>6} {prefix:>6}  ERROR {type(exc).__name__}: {str(exc)[:300]}")
            traceback.print_exc(limit=3)
        empty_cache()

    # a mixed continuous-batching step: 64 decode rows + 2 prefill chunks, in one prefill launch
    try:
        gen = torch.Generator(device=dev).manual_seed(2)
        seqs = [(1, 30 + 37 * i) for i in range(4)] + [(24, 24), (9, 77)] if SMOKE else \
            [(1, 2048 + 37 * i) for i in range(64)] + [(1024, 1024), (512, 8192 + 5)]
        k_cache, v_cache, bt, seq_lens = paged_batch([c for _, c in seqs], dtype, dev, gen)
        qlens = torch.tensor([ql for ql, _ in seqs])
        qsl = torch.zeros(len(seqs) + 1, dtype=torch.int32)
        qsl[1:] = qlens.cumsum(0)
        qsl = qsl.to(dev)
        q = torch.randn((int(qlens.sum()), H, D), dtype=dtype, device=dev, generator=gen)
        args = (q, k_cache, v_cache, bt, qsl, seq_lens, D**-0.5, max(ql for ql, _ in seqs))
        out = K.paged_prefill_attention(*args)
        ref = K.paged_prefill_attention_ref(*args)
        e = err(out, ref)
        ms = bench_ms(lambda: K.paged_prefill_attention(*args))
        ndec = sum(1 for ql, _ in seqs if ql == 1)
        chunks = [ql for ql, _ in seqs if ql > 1]
        print(f"mixed step ({ndec} decode rows + prefill chunks {chunks}), one launch: {ms:.3f} ms, err/ref {e:.1e}  "
              f"{verdict('mixed prefill', e, TOL[dtype])}")
    except Exception as exc:  # noqa: BLE001
        FAILURES.append(f"mixed prefill: {type(exc).__name__}")
        print(f"mixed prefill step: ERROR {type(exc).__name__}: {str(exc)[:300]}")
    empty_cache()


# ------------------------------------------------------------------------------------------------ cache ops
def run_cache_ops(K, dtype, t0, budget):
    print(f"\n== KV write and block copies ({dtype}) ==")
    dev = DEV
    esize = torch.finfo(dtype).bits // 8
    if out_of_time(t0, budget, "cache ops"):
        return
    try:
        gen = torch.Generator(device=dev).manual_seed(3)
        num_blocks, t = (50, 40) if SMOKE else (20000, 8192)
        kc = torch.zeros((num_blocks, BS, HKV, D), dtype=dtype, device=dev)
        vc = torch.zeros_like(kc)
        key = torch.randn((t, HKV, D), dtype=dtype, device=dev, generator=gen)
        val = torch.randn((t, HKV, D), dtype=dtype, device=dev, generator=gen)
        slots = torch.randperm(num_blocks * BS, device=dev, generator=gen)[:t]
        slots[::97] = -1
        K.write_kv(key, val, kc, vc, slots)
        kc2, vc2 = torch.zeros_like(kc), torch.zeros_like(vc)
        K.write_kv_ref(key, val, kc2, vc2, slots)
        ok = torch.equal(kc, kc2) and torch.equal(vc, vc2)
        if not ok:
            FAILURES.append("write_kv mismatch")
        ms = bench_ms(lambda: K.write_kv(key, val, kc, vc, slots))  # noqa: F821 - closure var, del'd only after last call
        nbytes = 2 * 2 * t * HKV * D * esize
        print(f"write_kv  T={t}: {ms * 1e3:.1f} us, {nbytes / ms / 1e6:.0f} GB/s (read+write)  "
              f"{'ok' if ok else 'FAIL'}")
        del kc, vc, kc2, vc2
        empty_cache()

        layers, nb, pairs = (2, 64, 8) if SMOKE else (32, 2048, 256)
        kv = torch.randn((layers, 2, nb, BS, HKV, D), dtype=dtype, device=dev, generator=gen)
        perm = torch.randperm(nb, device=dev, generator=gen)
        src, dst = perm[:pairs], perm[pairs : 2 * pairs]
        K.copy_blocks_stacked(kv, src, dst)
        ok1 = torch.equal(kv[:, :, dst], kv[:, :, src])
        src2, dst2 = perm[2 * pairs : 3 * pairs], perm[3 * pairs : 4 * pairs]
        K.copy_blocks([kv[i, 0] for i in range(layers)], [kv[i, 1] for i in range(layers)], src2, dst2)
        ok2 = torch.equal(kv[:, :, dst2], kv[:, :, src2])
        for name, good in (("copy_blocks_stacked", ok1), ("copy_blocks", ok2)):
            if not good:
                FAILURES.append(f"{name} mismatch")
        nbytes = 2 * layers * 2 * pairs * BS * HKV * D * esize
        ms1 = bench_ms(lambda: K.copy_blocks_stacked(kv, src, dst))  # noqa: F821 - closure var, del'd only after last call
        ms2 = bench_ms(lambda: K.copy_blocks([kv[i, 0] for i in range(layers)], [kv[i, 1] for i in range(layers)],  # noqa: F821 - closure var, del'd only after last call
                                             src2, dst2))
        print(f"copy_blocks_stacked {layers} layers x {pairs} pairs: {ms1 * 1e3:.1f} us, {nbytes / ms1 / 1e6:.0f} GB/s"
              f"  {'ok' if ok1 else 'FAIL'}")
        print(f"copy_blocks (lists) {layers} layers x {pairs} pairs: {ms2 * 1e3:.1f} us, {nbytes / ms2 / 1e6:.0f} GB/s"
              f"  {'ok' if ok2 else 'FAIL'}")
        del kv
    except Exception as exc:  # noqa: BLE001
        FAILURES.append(f"cache ops: {type(exc).__name__}")
        print(f"cache ops: ERROR {type(exc).__name__}: {str(exc)[:300]}")
        traceback.print_exc(limit=3)
    empty_cache()


# ------------------------------------------------------------------------------------------------ pytest
def run_pytest(timeout):
    print(f"\n== pytest tests/kernels/test_kernels.py natively (timeout {timeout:.0f}s) ==", flush=True)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/kernels/test_kernels.py"]
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        FAILURES.append("pytest timed out")
        tail = (exc.stdout or b"")
        tail = tail.decode(errors="replace") if isinstance(tail, bytes) else tail
        print(tail[-2000:])
        print(f"pytest: TIMED OUT after {timeout:.0f}s")
        return
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    failed = [ln for ln in lines if ln.startswith(("FAILED", "ERROR"))]
    for ln in failed[:30]:
        print(ln[:300])
    print(lines[-1] if lines else "(no output)")
    if proc.returncode != 0:
        FAILURES.append(f"pytest exit {proc.returncode}")
        print("\n".join(ln[:300] for ln in lines[-40:]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="GPU correctness + speed check of flowrt.kernels")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--budget", type=float, default=140.0, help="seconds for the benchmark part (default 140)")
    ap.add_argument("--pytest-timeout", type=float, default=130.0)
    ap.add_argument("--skip-pytest", action="store_true")
    ap.add_argument("--only", choices=["batch1", "decode", "prefill", "cache"], action="append")
    ap.add_argument("--smoke", action="store_true", help="run this script on CPU with tiny shapes (self-test)")
    args = ap.parse_args(argv)

    if not torch.cuda.is_available() and not SMOKE:
        print(f"gpu_check: no CUDA device available (torch {torch.__version__}, built with CUDA "
              f"{torch.version.cuda}); this script needs an NVIDIA GPU and a CUDA build of torch. "
              "On a CPU-only machine run: TRITON_INTERPRET=1 pytest tests/kernels/test_kernels.py")
        return 2
    t_start = time.time()
    K = load_kernels()
    import triton

    if SMOKE:
        where = "SMOKE TEST on CPU through Triton's interpreter (tiny shapes; timings meaningless)"
    else:
        props = torch.cuda.get_device_properties(0)
        where = f"{props.name}, {props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB"
    print(f"gpu_check: {where}; torch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton.__version__}; "
          f"kernels from {Path(K.__file__).parent}")
    if not K.HAS_TRITON:
        print(f"gpu_check: triton is not importable: {K.TRITON_IMPORT_ERROR}")
        return 2
    dtype = DTYPES[args.dtype]
    torch.backends.cuda.matmul.allow_tf32 = False
    only = set(args.only or ["batch1", "decode", "prefill", "cache"])
    t0 = time.time()
    for name, fn in (("batch1", run_batch1), ("decode", run_decode), ("prefill", run_prefill),
                     ("cache", run_cache_ops)):
        if name not in only:
            continue
        try:
            fn(K, dtype, t0, args.budget)
        except Exception as exc:  # noqa: BLE001 - never lose the rest of the run
            FAILURES.append(f"{name}: {type(exc).__name__}")
            print(f"{name}: ERROR {type(exc).__name__}: {exc}")
            traceback.print_exc()
    print(f"\n(benchmark part: {time.time() - t0:.0f}s)")
    if not args.skip_pytest and not SMOKE:
        # keep the whole run under 5 minutes
        run_pytest(max(60.0, min(args.pytest_timeout, 290.0 - (time.time() - t_start))))
    print(f"\ngpu_check finished in {time.time() - t_start:.0f}s: "
          + ("all checks passed" if not FAILURES else f"{len(FAILURES)} problem(s): " + "; ".join(FAILURES[:20])))
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
