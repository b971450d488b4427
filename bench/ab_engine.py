#!/usr/bin/env python
"""Whole-workload A/B of two engine trees on a noisy machine: the working tree (A) against a baseline commit (B,
default 773ad72: the engine before the CPU speed work), same model, same workloads, same process layout.

    python bench/ab_engine.py [--base 773ad72] [--rounds 5] [--dtype float32] [--cases main,fewshot,parallel]
                              [--main-n 8] [--keep-worktree]

Each tree runs in its own long-lived worker process (engine built once, one warm-up per case); the parent then
alternates A, B, A, B ... commanding one case at a time, so both see the same load over time. Reported per case:
wall and process CPU time (getrusage user+sys of the worker over the run: less sensitive to other processes than
wall time, though not to cache and frequency effects), and the median of the per-round ratios B/A (> 1: A faster).

Trees are imported through a shim package per tree (a `flowrt/` whose entries are symlinks into the tree, with
engine/, kernels/ and retrieval/ mapped as pyproject's package-dir maps them) placed first on PYTHONPATH, ahead
of the venv's editable install. The baseline is a `git worktree` under /tmp (removed at the end unless
--keep-worktree). Workloads (reduced so that a round takes ~10-20 s): main = the peers' main workload cut to
--main-n (8) requests; fewshot = 8 x (512 shared + 32 own) tokens, 32 new; parallel = n=8 from one 512-token prompt,
32 new, sampled (seed 0).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MAPPED = {"engine": "engine", "kernels": "kernels", "retrieval": "retrieval"}  # flowrt.<key> -> <tree>/<value>


# ------------------------------------------------------------------------------------------------ worker
def vars_of(p) -> dict:
    keys = ("n", "temperature", "seed", "ignore_eos")
    return {k: getattr(p, k) for k in keys if hasattr(p, k)}


def worker(dtype: str, main_n: int, threads: int) -> None:
    sys.path.insert(0, str(HERE))
    import torch

    from workloads import main_workload, shared_prefix_workloads

    import flowrt.engine as fe
    from flowrt.engine import LLM, SamplingParams

    llm = LLM(None, dtype=dtype, **({"num_threads": threads} if threads else {}))
    par_prompt, fewshot = shared_prefix_workloads()
    reqs = main_workload(n=main_n)
    cases = {
        "main": ([{"prompt_token_ids": r["prompt"]} for r in reqs],
                 [SamplingParams(max_tokens=r["max_new"], temperature=0, ignore_eos=True) for r in reqs]),
        "fewshot": ([{"prompt_token_ids": p} for p in fewshot[:8]],
                    SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)),
        "parallel": ([{"prompt_token_ids": par_prompt[:512]}],
                     SamplingParams(n=8, max_tokens=32, temperature=0.8, seed=0, ignore_eos=True)),
    }
    print(json.dumps({"ready": fe.__file__, "threads": torch.get_num_threads()}), flush=True)
    warmed = set()
    for line in sys.stdin:
        name = line.strip()
        if not name:
            continue
        prompts, params = cases[name]
        if name not in warmed:  # a short warm-up of the case's shapes (first prompts, few tokens)
            llm.reset_prefix_cache()
            warm = params[:2] if isinstance(params, list) else params
            llm.generate(prompts[:2], [SamplingParams(**{**vars_of(p), "max_tokens": 2}) for p in
                                       (warm if isinstance(warm, list) else [warm] * len(prompts[:2]))])
            warmed.add(name)
        llm.reset_prefix_cache()
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        wall = time.perf_counter() - t0
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
        toks = [list(c.token_ids) for o in outs for c in o.outputs]
        print(json.dumps({"case": name, "wall": wall, "cpu": cpu, "tokens": sum(map(len, toks)),
                          "first": toks[0][:8]}), flush=True)


# ------------------------------------------------------------------------------------------------ parent
def make_shim(tree: Path, shim: Path) -> Path:
    """shim/flowrt: symlinks to tree/flowrt/* plus the package-dir mapped subpackages."""
    pkg = shim / "flowrt"
    if shim.exists():
        subprocess.run(["rm", "-rf", str(shim)], check=True)
    pkg.mkdir(parents=True)
    for entry in (tree / "flowrt").iterdir():
        if entry.name != "__pycache__":
            (pkg / entry.name).symlink_to(entry)
    for name, d in MAPPED.items():
        if (tree / d).is_dir() and not (pkg / name).exists():
            (pkg / name).symlink_to(tree / d)
    return shim


class Worker:
    def __init__(self, label: str, shim: Path, args):
        env = {**os.environ, "PYTHONPATH": f"{shim}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        self.label = label
        self.p = subprocess.Popen([sys.executable, __file__, "--worker", "--dtype", args.dtype, "--main-n",
                                   str(args.main_n), "--threads", str(args.threads)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd="/tmp")
        self.info = self._read()

    def _read(self) -> dict:
        while True:
            line = self.p.stdout.readline()
            if not line:
                raise RuntimeError(f"worker {self.label} died (rc {self.p.wait()})")
            if line.startswith("{"):
                return json.loads(line)

    def run(self, case: str) -> dict:
        self.p.stdin.write(case + "\n")
        self.p.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.p.stdin.close()
        self.p.wait(timeout=60)


def summarize(res: dict, cases: list[str]) -> dict:
    print("summary so far (medians over rounds; ratio = B/A, > 1 means A is faster)", flush=True)
    summary = {}
    med = statistics.median
    for c in cases:
        A, B = res[c]["A"], res[c]["B"]
        if not A or len(A) != len(B):
            continue
        s = {"rounds": len(A), "A_wall": med([x["wall"] for x in A]), "B_wall": med([x["wall"] for x in B]),
             "A_cpu": med([x["cpu"] for x in A]), "B_cpu": med([x["cpu"] for x in B]),
             "ratio_wall": med([y["wall"] / x["wall"] for x, y in zip(A, B)]),
             "ratio_cpu": med([y["cpu"] / x["cpu"] for x, y in zip(A, B)]),
             "best_ratio_wall": min(y["wall"] for y in B) / min(x["wall"] for x in A),
             "same_greedy_start": A[0]["first"] == B[0]["first"]}
        summary[c] = s
        print(f"  {c:9s} wall A {s['A_wall']:6.2f}s B {s['B_wall']:6.2f}s ratio {s['ratio_wall']:.2f} "
              f"(best-of {s['best_ratio_wall']:.2f}) | cpu A {s['A_cpu']:6.2f}s B {s['B_cpu']:6.2f}s "
              f"ratio {s['ratio_cpu']:.2f}", flush=True)
    print(json.dumps(summary), flush=True)
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--base", default="773ad72", help="baseline commit (B)")
    ap.add_argument("--tree", default=str(ROOT), help="tree A (default: this working tree)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=0, help="engine num_threads (0: its default)")
    ap.add_argument("--main-n", type=int, default=8)
    ap.add_argument("--cases", default="main,fewshot,parallel")
    ap.add_argument("--worktree", default="/tmp/flowrt-base")
    ap.add_argument("--keep-worktree", action="store_true")
    args = ap.parse_args()
    if args.worker:
        worker(args.dtype, args.main_n, args.threads)
        return
    wt = Path(args.worktree)
    made = False
    if not wt.exists():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(wt), args.base], check=True,
                       capture_output=True)
        made = True
    cases = args.cases.split(",")
    shims = Path("/tmp/flowrt-ab-shims")
    try:
        a = Worker("A", make_shim(Path(args.tree), shims / "A"), args)
        b = Worker("B", make_shim(wt, shims / "B"), args)
        print(f"A = {args.tree} ({a.info['ready']}, {a.info['threads']} threads)\n"
              f"B = {args.base} ({b.info['ready']}, {b.info['threads']} threads); dtype {args.dtype}", flush=True)
        res = {c: {"A": [], "B": []} for c in cases}
        for r in range(args.rounds):
            for c in cases:
                order = (a, b) if r % 2 == 0 else (b, a)  # A,B then B,A: neither always runs second
                for w in order:
                    out = w.run(c)
                    res[c][w.label].append(out)
                ra, rb = res[c]["A"][-1], res[c]["B"][-1]
                print(f"round {r} {c:9s} A {ra['wall']:6.2f}s wall {ra['cpu']:6.2f}s cpu | B {rb['wall']:6.2f}s wall "
                      f"{rb['cpu']:6.2f}s cpu | B/A wall {rb['wall'] / ra['wall']:.2f} cpu {rb['cpu'] / ra['cpu']:.2f}"
                      f"{'' if ra['tokens'] == rb['tokens'] else '  TOKEN COUNT DIFFERS'}", flush=True)
            summarize(res, cases)  # after every round: an interrupted run still reports
        a.close()
        b.close()
    finally:
        subprocess.run(["rm", "-rf", str(shims)])
        if made and not args.keep_worktree:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(wt)])


if __name__ == "__main__":
    main()
