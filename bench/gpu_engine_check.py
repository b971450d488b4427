#!/usr/bin/env python
"""On a CUDA machine: the engine end to end on the GPU with the triton backend, with and without CUDA graphs.

1. parity: greedy tokens on stories260K with attention_backend="triton" (decode graphs on) equal the torch
   backend (also on the GPU), with a prefix-cache hit and a copy-on-write fork in the run.
2. graphs: greedy tokens with decode graphs == without (stories260K, float32 and bfloat16), plus capture time.
3. step: decode step time at batch 64 of a random-weight SmolLM2-135M-shaped Llama (vocab cut to stories260K's
   tokenizer, bf16): engine.step() and the runner alone, graphs vs eager; and how many greedy tokens agree.
4. workload: the main workload shape (32 requests, prompts 32-256, 16-128 new tokens) on that model, triton with
   graphs, triton eager, torch.

Each section is independent (an exception is printed, the next one runs) and a time budget (--budget) skips
what would overrun. Exits 2 without CUDA (unless --smoke: section 2 on CPU, graphs emulated, kernels interpreted).

    python bench/gpu_engine_check.py [--budget 200] [--only step --only graphs]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"
else:
    os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STORIES = os.path.join(ROOT, "tests", "models", "stories260K")
DEV = "cpu" if SMOKE else "cuda"
SECTIONS = ("graphs", "step", "workload", "parity")  # the order they run in: the new checks first


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def set_graphs(eng, on: bool) -> bool:
    """Switches the engine's decode graphs (EngineArgs.enforce_eager, applied after construction)."""
    from flowrt.engine.model.cuda_graphs import GraphConfig

    return eng.runner.configure_graphs(GraphConfig(enabled=on, emulate=SMOKE))


def run(eng, target, params):
    req = eng.add_request(target, params)
    while not req.finished:
        eng.step()
    return eng.make_output(req)


def generate(eng, prompts, params):
    reqs = [eng.add_request({"prompt_token_ids": p}, sp) for p, sp in zip(prompts, params)]
    while not all(r.finished for r in reqs):
        eng.step()
    return [eng.make_output(r).outputs[0].token_ids for r in reqs]


def smollm2_shaped_dir() -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    d = tempfile.mkdtemp()
    cfg = LlamaConfig(vocab_size=512, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                      tie_word_embeddings=True, rope_theta=100000.0)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(d)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(os.path.join(STORIES, f), d)
    return d


# ------------------------------------------------------------------------------------------------ sections
def parity() -> None:
    from flowrt.engine import LLMEngine, SamplingParams

    res = {}
    for backend in ("triton", "torch"):
        eng = LLMEngine(model=STORIES, dtype="float32", attention_backend=backend, device=DEV)
        g = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        prefix = eng.tokenize("Once upon a time there was a little dog named Max who liked to run in the park")
        outs = [run(eng, {"prompt_token_ids": prefix + [300 + i]}, g).outputs[0].token_ids for i in range(3)]
        seq = eng.open(prefix)
        outs.append(run(eng, seq, g).outputs[0].token_ids)
        for c in eng.fork(seq, 2):
            outs.append(run(eng, c, g).outputs[0].token_ids)
        graphs = eng.runner.graphs
        res[backend] = (outs, eng.stats(), graphs.stats if graphs is not None else None)
    same = res["triton"][0] == res["torch"][0]
    s = res["triton"][1]
    print(f"engine parity triton (graphs {res['triton'][2]}) vs torch on {DEV}: {'OK' if same else 'MISMATCH'} "
          f"(prefix hits {s['prefix_cache_hit_tokens']} tokens, cow copies {s['cow_copies']})", flush=True)


def graphs_parity() -> None:
    from flowrt.engine import LLMEngine, SamplingParams

    prompts = [[1, *range(300 + 7 * i, 310 + 9 * i)] for i in range(5)]
    n_tok = 6 if SMOKE else 40
    for dtype in ("float32",) if SMOKE else ("float32", "bfloat16"):
        eng = LLMEngine(model=STORIES, dtype=dtype, attention_backend="triton", device=DEV)
        params = [SamplingParams(max_tokens=n_tok - i * (n_tok // 6), temperature=0.0, ignore_eos=True) for i in range(5)]
        out = {}
        for on in (True, False):
            assert set_graphs(eng, on) == on, "decode graphs could not be switched on"
            eng.reset_prefix_cache()
            t = time.perf_counter()
            out[on] = generate(eng, prompts, params)
            sync()
            dt = time.perf_counter() - t
            st = eng.runner.graphs.stats if on else {}
            print(f"  stories260K {dtype} graphs={'on ' if on else 'off'}: {dt:.2f} s "
                  + (f"({st['replays']} replays, {st['captures']} captures in {st['capture_seconds'] * 1e3:.0f} ms, "
                     f"{st['padded_rows']} padded rows)" if on else ""), flush=True)
        same = out[True] == out[False]
        print(f"greedy tokens with graphs == without ({dtype}, batch 5 -> 1): {'OK' if same else 'MISMATCH'}")


def step_time() -> None:
    """Batch 64 decode steps (all sequences past their prompt) on the SmolLM2-shaped model, graphs vs eager."""
    from flowrt.engine import LLMEngine, SamplingParams

    eng = LLMEngine(model=smollm2_shaped_dir(), dtype="bfloat16", attention_backend="triton", device=DEV,
                    max_num_seqs=64)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 512, (64 + i,), generator=g).tolist() for i in range(64)]
    t = time.perf_counter()
    cap = eng.runner.graphs.capture([b for b in eng.runner.graphs.buckets if b <= 64])
    print(f"captured decode graphs for batch 1..64 in {cap:.2f} s (first capture includes Triton compiles; "
          f"wall {time.perf_counter() - t:.2f} s)", flush=True)
    results = {}
    for on in (True, False):
        set_graphs(eng, on)
        eng.reset_prefix_cache()
        params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
        reqs = [eng.add_request({"prompt_token_ids": p}, params) for p in prompts]
        while any(len(r.seqs[0].token_ids) == len(r.prompt_token_ids) for r in reqs):
            eng.step()  # prefill (chunked) until every sequence has sampled its first token
        for _ in range(10):
            eng.step()  # warm-up (and lazy captures when on)
        runner = eng.runner
        times, prep, execs = [], [], []
        orig_prepare, orig_execute = runner.prepare, runner.execute

        def timed_prepare(*a, **k):
            t0 = time.perf_counter()
            r = orig_prepare(*a, **k)
            prep.append(time.perf_counter() - t0)
            return r

        def timed_execute(inp):
            t0 = time.perf_counter()
            r = orig_execute(inp)
            execs.append(time.perf_counter() - t0)
            return r

        runner.prepare, runner.execute = timed_prepare, timed_execute
        try:
            for _ in range(100):
                sync()
                t0 = time.perf_counter()
                eng.step()
                times.append(time.perf_counter() - t0)
        finally:
            runner.prepare, runner.execute = orig_prepare, orig_execute
        for r in reqs:
            eng.abort(r.request_id)
        while eng.has_unfinished():
            eng.step()
        ms = statistics.median(times) * 1e3
        results[on] = ms
        print(f"decode step, batch 64, SmolLM2-shaped bf16, graphs={'on ' if on else 'off'}: engine.step "
              f"{ms:.2f} ms (p90 {sorted(times)[89] * 1e3:.2f}), of which prepare {statistics.median(prep) * 1e3:.2f}"
              f" ms + execute {statistics.median(execs) * 1e3:.2f} ms -> {64 / ms * 1e3:.0f} tok/s", flush=True)
    print(f"decode step speed-up from graphs: {results[False] / results[True]:.2f}x "
          f"(target: graphs < 2 ms: {'OK' if results[True] < 2.0 else 'NOT MET'})")
    # greedy agreement on this random-weight model (near-tied logits: bf16 differences may flip a few)
    toks = {}
    for on in (True, False):
        set_graphs(eng, on)
        eng.reset_prefix_cache()
        toks[on] = generate(eng, prompts[:16], [SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)] * 16)
    agree = sum(a == b for x, y in zip(toks[True], toks[False]) for a, b in zip(x, y))
    print(f"SmolLM2-shaped greedy tokens graphs vs eager: {agree}/{16 * 32} agree, "
          f"{sum(x == y for x, y in zip(toks[True], toks[False]))}/16 sequences identical")


def workload() -> None:
    from common import main_workload
    from flowrt.engine import LLM, SamplingParams

    d = smollm2_shaped_dir()
    reqs = main_workload(vocab=512)
    gen = sum(r["max_new"] for r in reqs)
    prompts = [{"prompt_token_ids": r["prompt"]} for r in reqs]
    for label, backend, graphs in (("triton+graphs", "triton", True), ("triton eager", "triton", False),
                                   ("torch", "torch", False)):
        t0 = time.perf_counter()
        llm = LLM(d, dtype="bfloat16", attention_backend=backend, device=DEV)
        set_graphs(llm.engine, graphs)
        params = [SamplingParams(max_tokens=r["max_new"], temperature=0, ignore_eos=True) for r in reqs]
        llm.generate(prompts, params)  # warm-up: compiles, and captures the buckets this workload uses
        start = time.perf_counter() - t0
        times = []
        for _ in range(3):
            llm.reset_prefix_cache()
            sync()
            t = time.perf_counter()
            llm.generate(prompts, params)
            sync()
            times.append(time.perf_counter() - t)
        w = statistics.median(times)
        print(f"main workload on GPU, {label:13s}: {w:.2f} s, {gen / w:.0f} generated tok/s "
              f"(start+warm-up {start:.1f} s, {llm.stats()['steps']} steps total)", flush=True)
        del llm
        torch.cuda.empty_cache()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="The engine on a CUDA GPU: parity, CUDA graphs, step time, workload")
    ap.add_argument("--budget", type=float, default=200.0, help="seconds; later sections are skipped past it")
    ap.add_argument("--only", choices=SECTIONS, action="append", help="run only these sections (repeatable)")
    ap.add_argument("--smoke", action="store_true", help="CPU self-test: the graphs section, emulated, tiny")
    args = ap.parse_args(argv)
    if SMOKE:
        only = ["graphs"]
    elif not torch.cuda.is_available():
        print("gpu_engine_check: no CUDA device: nothing to check (try --smoke on a CPU)")
        return 2
    else:
        only = args.only or list(SECTIONS)
    fns = {"parity": parity, "graphs": graphs_parity, "step": step_time, "workload": workload}
    t0 = time.time()
    failed = []
    for name in SECTIONS:
        if name not in only:
            continue
        if time.time() - t0 > args.budget:
            print(f"{name}: skipped (time budget of {args.budget:.0f}s spent)")
            continue
        print(f"\n== {name} ==", flush=True)
        try:
            fns[name]()
        except Exception:  # noqa: BLE001 - never lose the other sections
            failed.append(name)
            traceback.print_exc()
        print(f"({name}: {time.time() - t0:.0f}s elapsed)", flush=True)
    print(f"\ngpu_engine_check finished in {time.time() - t0:.0f}s" + (f"; failed: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
