"""Compile every flowrt kernel ahead of time for an NVIDIA GPU, without needing one.

    python -m flowrt.kernels.compile_check [--arch 90] [--arch 80]

The interpreter (which the CPU tests use) accepts programs the GPU compiler rejects (tl.dot shapes,
mixed types, shared memory over the limit); this catches those on a machine with no GPU. It needs
triton's NVIDIA backend (bundled with the usual Linux wheels) and must run without TRITON_INTERPRET=1
(triton.language is built for the interpreter otherwise); the tests run it in a subprocess.
Prints one line per kernel configuration and exits non-zero on the first failure.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

# shared memory per block on the architectures we target (opt-in maximum)
SMEM_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}

_TY = {torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.float32: "*fp32", torch.int32: "*i32",
       torch.int64: "*i64"}


def _compile(kernel, ptrs, consts, arch, num_warps=4, num_stages=2):
    import triton
    from triton.backends.compiler import GPUTarget

    from .paged_args import PagedStrides

    fn = kernel.jit()
    sig = {}
    for name in fn.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        elif name in ptrs:
            sig[name] = _TY[ptrs[name]]
        elif name == "strides":  # the paged attention kernels' PagedStrides: a tuple of ints
            sig[name] = PagedStrides(*["i32"] * len(PagedStrides._fields))
        else:
            sig[name] = "fp32" if name.startswith("scale") else "i32"
    src = triton.compiler.ASTSource(fn, sig, consts)
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                              options=dict(num_warps=num_warps, num_stages=num_stages))
    shared = compiled.metadata.shared
    limit = SMEM_LIMIT.get(arch, 99 * 1024)
    if shared > limit:
        raise RuntimeError(f"{fn.__name__}: {shared} bytes of shared memory > {limit} on sm_{arch}")
    return shared


def configurations():
    """(name, kernel, pointer dtypes, constexprs, num_warps) for the configurations the wrappers launch."""
    import triton.language as tl

    from . import cache_ops, decode_attention, prefill_attention
    from ._dispatch import dot_precision, next_pow2

    i32, i64, f32 = torch.int32, torch.int64, torch.float32
    out = []
    for dt in (torch.float16, torch.bfloat16, torch.float32):
        for d, group in ((128, 4), (80, 3), (64, 8), (96, 1)):
            cfg = dict(DOT_PREC=dot_precision(dt), UPCAST=False, HEAD_DIM=d, BLOCK_D=next_pow2(d), PAGE=16)
            out.append((f"decode {dt} d={d} g={group}", decode_attention._DECODE,
                        dict(q_ptr=dt, k_ptr=dt, v_ptr=dt, bt_ptr=i32, seq_lens_ptr=i32, out_ptr=dt,
                             part_o_ptr=f32, part_lse_ptr=f32),
                        dict(cfg, GROUP=group, BLOCK_G=max(16, next_pow2(group)),
                             BLOCK_N=decode_attention.DECODE_BLOCK_N, IS_SPLIT=True), 4))
            for max_q in (512, 1):
                bg, bq, bm, bn, nw = prefill_attention._tile_config(group, max_q, d, dt)
                out.append((f"prefill {dt} d={d} g={group} max_q={max_q}", prefill_attention._PREFILL,
                            dict(q_ptr=dt, k_ptr=dt, v_ptr=dt, bt_ptr=i32, qsl_ptr=i32, seq_lens_ptr=i32, out_ptr=dt),
                            dict(cfg, GROUP=group, BLOCK_G=bg, BLOCK_Q=bq, BLOCK_M=bm, BLOCK_N=bn), nw))
            if dt == torch.float32:
                break  # fp32 is slow to compile; one head dim is enough
        out.append((f"reduce {dt}", decode_attention._REDUCE, dict(part_o_ptr=f32, part_lse_ptr=f32, out_ptr=dt),
                    dict(BLOCK_S=32, HEAD_DIM=96, BLOCK_D=128), 4))
        out.append((f"write_kv {dt}", cache_ops._WRITE_KV,
                    dict(key_ptr=dt, value_ptr=dt, k_cache_ptr=dt, v_cache_ptr=dt, slot_ptr=i64),
                    dict(NUM_KV_HEADS=8, HEAD_DIM=128, BLOCK_H=8, BLOCK_D=128, PAGE=16), 4))
        for table in (True, False):
            out.append((f"copy_blocks {dt} table={table}", cache_ops._COPY_BLOCKS,
                        dict(base_ptr=dt, ptr_table=i64, src_ptr=i64, dst_ptr=i64),
                        dict(USE_PTR_TABLE=table, DTYPE=getattr(tl, str(dt).split(".")[1]), CHUNK=4096), 4))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, action="append", help="compute capability x10 (default: 90)")
    ap.add_argument("--quick", action="store_true", help="skip fp32 and the less common head dims")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("compile_check: unset TRITON_INTERPRET (triton.language is built for the interpreter)", file=sys.stderr)
        return 2
    from ._dispatch import HAS_TRITON, TRITON_IMPORT_ERROR

    if not HAS_TRITON:
        print(f"compile_check: triton is not importable: {TRITON_IMPORT_ERROR}", file=sys.stderr)
        return 2
    for arch in args.arch or [90]:
        for name, kernel, ptrs, consts, nw in configurations():
            if args.quick and ("float32" in name or " d=64" in name or " d=96" in name):
                continue
            t0 = time.time()
            try:
                shared = _compile(kernel, ptrs, consts, arch, num_warps=nw)
            except Exception as exc:  # noqa: BLE001 - report which configuration failed
                print(f"sm_{arch} {name}: FAILED {type(exc).__name__}: {exc}")
                return 1
            print(f"sm_{arch} {name}: ok, {shared} B shared, {time.time() - t0:.1f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
