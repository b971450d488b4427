#!/usr/bin/env python
"""This machine's ceilings for SmolLM2-135M, and the share of them a benchmark reaches.

Measures (torch, this process's threads):
  * GEMM GFLOP/s at the model's real shapes, nn.Linear layout (x[M,K] W[N,K]^T), the best of MKL (F.linear),
    oneDNN with prepacked weights and flowrt's own packed kernels where the engine runs them (cpu_ops.PackedLinear,
    float32 with AVX2; cpu_ops.PackedLinearBF16, bfloat16 with AVX512-BF16 and no AMX): qkv 576x960, o 576x576,
    gate_up 576x3072, down 1536x576, lm_head 576x49152; decode rows M = 1, 8, 32, 64 and prefill rows 512, 2048.
    Weights rotate over copies larger than the caches ("cold"), as in a real step that streams ~0.5 GB (fp32) of
    weights; for prefill rows this changes nothing (compute bound).
  * the model ceiling at M rows: one forward's projection FLOPs (30 layers + lm_head, ~0.27 GFLOP per token) over
    the summed time of its GEMMs at M rows: no attention, no norms, no overhead, i.e. the floor of a step;
  * memory bandwidth (GB/s): a large copy (read + write counted) and a large sum (read);
  * the machine's own ceiling per dtype ("machine peak"): large square products (2,048 and 3,072), the best of
    torch's F.linear, prepacked oneDNN (which picks AMX tiles, AVX512-BF16 or AVX2 itself at run time) and flowrt's
    own kernel where the engine runs it. The
    model ceiling is what the model's skinny shapes get out of torch; the machine peak is what the silicon does with
    a compute-bound product (on a Xeon with AMX far above the model shapes' figure). Every share line reports both.
fp32 always; bf16 where the CPU has native bf16 (avx512_bf16 / amx), else one emulated point (--bf16 all forces
the full table: it is very slow there, ~0.3-0.9 GFLOP/s).

    python bench/peak.py [--quick] [--passes 3] [--dtypes float32,bfloat16] [--bf16 auto|all|none] [--json]

--passes N (default 3; 1 with --quick): the table measured N times in turn, each point keeping its best, since one
pass on a drifting VM can land in a slow phase (a ceiling is the best the machine does).

Results are cached (bench/workloads.cache_dir()/peak-*.json, keyed by CPU, cores and torch) for the other
benchmarks, which print each workload's figure as a share of its ceiling through share() / share_line():
    floor time = prompt tokens x 0.27 GFLOP / prefill ceiling + generated tokens x 0.27 GFLOP / decode ceiling
    share      = floor time / measured wall time   (= FLOPs / time / ceiling, with each part at its own ceiling)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sysinfo import banner, cpu_info, cpu_supports_bf16  # noqa: E402
from workloads import GEMM_SHAPES, SMOLLM2_135M, cache_dir, linear_flops_per_token  # noqa: E402

DECODE_ROWS = (1, 8, 32, 64)
PREFILL_ROWS = (512, 2048)
LAYER_SHAPES = ("qkv", "o", "gate_up", "down")


CLOCK = {"clock": time.perf_counter}  # --threads 1: the thread's CPU time (other processes on a shared host do not count)


def _time(fn, min_time: float, min_reps: int = 3, max_reps: int = 1000) -> float:
    fn()  # warm-up
    clock = CLOCK["clock"]
    times, t_start = [], time.perf_counter()
    while len(times) < min_reps or (time.perf_counter() - t_start < min_time and len(times) < max_reps):
        t0 = clock()
        fn()
        times.append(clock() - t0)
        if time.perf_counter() - t_start > 10 * max(min_time, 0.1) and len(times) >= 1:
            break  # a very slow point (emulated bf16): one or two reps are enough
    return statistics.median(times)


def gemm_gflops(shape: str, rows: int, dtype: torch.dtype, min_time: float, cold_bytes: float = 256e6) -> float:
    K, N = GEMM_SHAPES[shape]
    esz = torch.finfo(dtype).bits // 8
    copies = 1 if rows >= 256 else max(2, int(cold_bytes // (K * N * esz)))
    ws = [torch.randn(N, K, dtype=dtype) for _ in range(copies)]
    x = torch.randn(rows, K, dtype=dtype)

    def one_pass():
        for w in ws:
            F.linear(x, w)

    t = _time(one_pass, min_time) / copies
    try:  # oneDNN with the weights prepacked once (what flowrt's engine runs for steps of up to 512 rows)
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, min(rows, 64)) for w in ws]

        def packed_pass():
            for w in packed:
                torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")

        t = min(t, _time(packed_pass, min_time) / copies)
    except (AttributeError, RuntimeError):
        pass
    own = _own_kernels(ws, dtype)
    if own:

        def own_pass():
            for p in own:
                p(x)

        t = min(t, _time(own_pass, min_time) / copies)
    return 2.0 * rows * K * N / t / 1e9


def _own_kernels(ws: list[torch.Tensor], dtype: torch.dtype) -> list | None:
    """flowrt's own packed projection kernels for these weights, where the engine runs them at every row count
    (float32 with AVX2 + FMA; bfloat16 with AVX512-BF16 and no AMX), else None."""
    try:
        from flowrt.engine.cpu import build as cpu_build, ops as cpu_ops
    except ImportError:
        return None
    if dtype == torch.float32:
        make = cpu_ops.PackedLinear.create
    elif dtype == torch.bfloat16 and "amx_bf16" not in cpu_build.cpu_flags():
        make = cpu_ops.PackedLinearBF16.create
    else:
        return None
    own = [make(w) for w in ws]
    return own if all(p is not None for p in own) else None


def machine_peak(dtype: torch.dtype, min_time: float, sizes=(2048, 3072)) -> float:
    """GFLOP/s of the best large square product (compute bound: the machine's ceiling for this dtype)."""
    best = 0.0
    for n in sizes:
        a, w = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        t = _time(lambda: F.linear(a, w), min_time)
        try:
            wp = torch.ops.mkldnn._reorder_linear_weight(w, n)
            t = min(t, _time(lambda: torch.ops.mkldnn._linear_pointwise(a, wp, None, "none", [], ""), min_time))
        except (AttributeError, RuntimeError):
            pass
        own = _own_kernels([w], dtype)
        if own:
            t = min(t, _time(lambda: own[0](a), min_time))
        best = max(best, 2.0 * n**3 / t / 1e9)
    return best


def bandwidth(min_time: float, nbytes: float = 1e9) -> dict:
    src = torch.randn(int(nbytes // 4))
    dst = torch.empty_like(src)
    dst.copy_(src)
    n = src.numel() * 4
    t_copy = _time(lambda: dst.copy_(src), min_time)
    t_sum = _time(lambda: src.sum(), min_time)
    return {"copy_GBps_rw": 2 * n / t_copy / 1e9, "sum_GBps_read": n / t_sum / 1e9}


def model_ceiling(gemm: dict, rows: int, shape=SMOLLM2_135M) -> float:
    """GFLOP/s of one forward's projections at `rows` rows: total FLOPs / summed GEMM times."""
    L = shape["layers"]
    t = 0.0
    for s in (*LAYER_SHAPES, "lm_head"):
        K, N = GEMM_SHAPES[s]
        t += (L if s != "lm_head" else 1) * 2.0 * rows * K * N / (gemm[s][str(rows)] * 1e9)
    return rows * linear_flops_per_token(shape) / t / 1e9


def measure(dtypes=("float32",), quick=False, bf16_mode="auto", log=print, passes: int = 1) -> dict:
    """The ceilings; with passes > 1 the whole GEMM table is measured that many times, one pass after another, and
    each point keeps its best: on a VM whose speed drifts by minutes (up to 2x on the project's 2-core machines),
    one pass can land in a slow phase and understate the ceiling, which then overstates every share."""
    min_time = 0.15 if quick else 0.6
    res = {"system": {**cpu_info(), "torch": torch.__version__, "threads": torch.get_num_threads()},
           "quick": quick, "passes": passes, "gemm": {}, "model_ceiling_gflops": {}, "machine_peak_gflops": {},
           "bandwidth": {}}
    with torch.inference_mode():
        for name in dtypes:
            dtype = getattr(torch, name)
            rows_list = list(DECODE_ROWS) + list(PREFILL_ROWS)
            if quick:
                rows_list = [1, 32, 512]
            emulated = dtype == torch.bfloat16 and not cpu_supports_bf16()
            if emulated and bf16_mode != "all":
                # no native bf16: one point shows the order of magnitude; the table would take an hour
                g = gemm_gflops("o", 8, dtype, 0.05)
                res["gemm"][name] = {"o": {"8": g}}
                res.setdefault("notes", []).append(f"{name} is emulated on this CPU: o 576x576 at 8 rows {g:.2f} "
                                                   "GFLOP/s; no model ceiling measured (--bf16 all forces it)")
                log(f"{name}: emulated on this CPU (no avx512_bf16/amx): o at 8 rows {g:.2f} GFLOP/s")
                continue
            table = {s: {} for s in (*LAYER_SHAPES, "lm_head")}
            for p in range(passes):
                if passes > 1:
                    log(f"{name}: pass {p + 1} of {passes}")
                for s in table:
                    for m in rows_list:
                        table[s][str(m)] = max(table[s].get(str(m), 0.0), gemm_gflops(s, m, dtype, min_time))
            for s in table:
                K, N = GEMM_SHAPES[s]
                log(f"{name:9s} {s:8s} {K:5d}x{N:<6d} " + "  ".join(
                    f"M={m}: {table[s][str(m)]:6.1f}" for m in rows_list) + "  GFLOP/s")
            res["gemm"][name] = table
            res["model_ceiling_gflops"][name] = {str(m): model_ceiling(table, m) for m in rows_list}
            log(f"{name:9s} model ceiling (projections only, 0.27 GFLOP/token): " + "  ".join(
                f"M={m}: {res['model_ceiling_gflops'][name][str(m)]:6.1f}" for m in rows_list) + "  GFLOP/s")
            peak = max(machine_peak(dtype, min_time, (2048,) if quick else (2048, 3072)) for _ in range(passes))
            res["machine_peak_gflops"][name] = peak
            amx = "with AMX" if any(f.startswith("amx") for f in cpu_info()["flags"]) else "no AMX"
            log(f"{name:9s} machine peak (square products, {amx}): {peak:6.1f} GFLOP/s; the model's shapes reach "
                + "  ".join(f"M={m}: {100 * res['model_ceiling_gflops'][name][str(m)] / peak:3.0f}%"
                            for m in rows_list) + " of it")
        res["bandwidth"] = bandwidth(min_time, 2.5e8 if quick else 1e9)
        log(f"memory bandwidth: copy {res['bandwidth']['copy_GBps_rw']:.1f} GB/s (read+write), "
            f"sum {res['bandwidth']['sum_GBps_read']:.1f} GB/s (read)")
    return res


# ---------------------------------------------------------------------------------------------- for other benchmarks
def _cache_file() -> Path:
    i = cpu_info()
    # v4: with the machine peak; v3: the GEMM figures are the best of MKL, prepacked oneDNN and flowrt's own packed
    # kernel (v2: the first two, v1: MKL only)
    key = f"v5|{i['cpu']}|{','.join(i['flags'])}|{i['cores']}|{torch.__version__}|{torch.get_num_threads()}"
    return cache_dir() / f"peak-{hashlib.sha1(key.encode()).hexdigest()[:12]}.json"


def ceilings(dtype: str = "float32", measure_if_missing: bool = True) -> dict | None:
    """This machine's ceilings for `dtype` (cached; a quick measurement of ~10 s when missing)."""
    f = _cache_file()
    res = json.loads(f.read_text()) if f.is_file() else {}
    if dtype not in res.get("model_ceiling_gflops", {}) and measure_if_missing:
        if dtype == "bfloat16" and not cpu_supports_bf16():
            return None
        new = measure((dtype,), quick=True, log=lambda *_: None)
        for k in ("gemm", "model_ceiling_gflops", "machine_peak_gflops"):
            res.setdefault(k, {}).update(new[k])
        res.setdefault("bandwidth", new["bandwidth"])
        res.setdefault("system", new["system"])
        f.write_text(json.dumps(res))
    return {"model_ceiling_gflops": res.get("model_ceiling_gflops", {}).get(dtype),
            "machine_peak_gflops": res.get("machine_peak_gflops", {}).get(dtype),
            "bandwidth": res.get("bandwidth")} if res.get("model_ceiling_gflops", {}).get(dtype) else None


def _nearest(table: dict, rows: int) -> tuple[int, float]:
    import math

    m = min((int(k) for k in table), key=lambda k: abs(math.log(k) - math.log(max(rows, 1))))
    return m, table[str(m)]


def share(prompt_tokens: int, gen_tokens: int, seconds: float, dtype: str = "float32", decode_rows: int = 32,
          prefill_rows: int = 2048) -> dict | None:
    """The workload's projection FLOPs / time, and its share of this machine's ceiling: prompt tokens at the
    prefill ceiling, generated tokens at the decode ceiling for `decode_rows` sequences per step."""
    c = ceilings(dtype)
    if not c:
        return None
    f = linear_flops_per_token()
    mp, cp = _nearest(c["model_ceiling_gflops"], prefill_rows)
    md, cd = _nearest(c["model_ceiling_gflops"], decode_rows)
    floor = prompt_tokens * f / (cp * 1e9) + gen_tokens * f / (cd * 1e9)
    gflops = (prompt_tokens + gen_tokens) * f / seconds / 1e9
    peak = c.get("machine_peak_gflops")
    return {"gflops": gflops, "floor_s": floor, "share": floor / seconds,
            "machine_peak_gflops": peak, "machine_share": gflops / peak if peak else None,
            "prefill_ceiling_gflops": cp, "prefill_rows": mp, "decode_ceiling_gflops": cd, "decode_rows": md}


def share_line(label: str, prompt_tokens: int, gen_tokens: int, seconds: float, dtype: str = "float32",
               decode_rows: int = 32) -> str:
    try:
        s = share(prompt_tokens, gen_tokens, seconds, dtype, decode_rows)
    except Exception as exc:  # a figure, never a failure of the benchmark
        return f"{label}: no ceiling ({exc})"
    if s is None:
        return f"{label}: no {dtype} ceiling on this CPU (bench/peak.py)"
    return (f"{label}: {s['gflops']:.1f} GFLOP/s = {100 * s['share']:.0f}% of the {dtype} ceiling "
            f"(floor {s['floor_s']:.2f} s: prefill at {s['prefill_ceiling_gflops']:.0f} GFLOP/s "
            f"[{s['prefill_rows']} rows], decode at {s['decode_ceiling_gflops']:.0f} GFLOP/s [{s['decode_rows']} rows])"
            + (f"; {100 * s['machine_share']:.0f}% of the machine's {dtype} peak ({s['machine_peak_gflops']:.0f} GFLOP/s)"
               if s.get("machine_share") else "")
            + ("  [over 100%: the cached ceiling was measured on a busier machine; rerun bench/peak.py]"
               if s["share"] > 1.0 else ""))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer rows, shorter timing (fp32 only)")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--bf16", default="auto", choices=["auto", "all", "none"])
    ap.add_argument("--threads", type=int, default=None,
                    help="compute threads; 1 times by the thread's CPU time (robust on a shared machine)")
    ap.add_argument("--passes", type=int, default=None,
                    help="measure the GEMM table this many times and keep each point's best (default 3, --quick 1)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.threads == 1:
        CLOCK["clock"] = time.thread_time
    dtypes = [d for d in args.dtypes.split(",") if d and not (d == "bfloat16" and args.bf16 == "none")]
    if args.quick:
        dtypes = [d for d in dtypes if d != "bfloat16"] or dtypes
    print(banner(None, "ceilings for SmolLM2-135M shapes"), flush=True)
    passes = args.passes if args.passes is not None else (1 if args.quick else 3)
    if passes < 1:
        ap.error("--passes must be at least 1")
    res = measure(dtypes, quick=args.quick, bf16_mode=args.bf16, passes=passes)
    f = _cache_file()
    old = json.loads(f.read_text()) if f.is_file() else {}
    if not args.quick or not old:  # a full run replaces a quick one; a quick one never replaces a full one
        for k in ("gemm", "model_ceiling_gflops", "machine_peak_gflops"):
            old.setdefault(k, {}).update(res[k])
        old.update(system=res["system"], bandwidth=res["bandwidth"], quick=args.quick)
        f.write_text(json.dumps(old))
    for name, t in res["model_ceiling_gflops"].items():
        m32 = t.get("32")
        if m32:
            print(f"{name}: decode at 32 sequences per step bounded near {m32 * 1e9 / linear_flops_per_token():.0f} "
                  f"tok/s by the projections alone")
    print(f"cached in {f}")
    if args.json:
        print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
