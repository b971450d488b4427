#!/usr/bin/env python
"""Structured outputs (SamplingParams.structured_outputs): what a JSON-schema constraint costs.

    python bench/structured.py [--model PATH] [--dtype auto|float32|bfloat16] [--max-tokens 64] [--repeats 2] [--quick]

Reports, on the default model unless --model:
- decode throughput (generated tokens / wall second) with a JSON-schema constraint vs unconstrained, at batch 1
  and batch 32. Both run exactly max_tokens per request (the constrained schema is an array of at least 1000
  strings, so it never completes; unconstrained ignores EOS), so the two do the same number of steps;
- mask time per constrained token (p50/p99 of the per-step batched fill divided by its rows; plus the whole
  masking share of wall time);
- compile time p50/p99 over the test schemas (tests/structured_schemas.py), uncached;
- forced-token share on a realistic schema (a small record) at batch 32.
Targets: constrained throughput >= 90% of unconstrained at batch 32; compile p99 < 50 ms.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

from sysinfo import print_banner, resolve_dtype  # noqa: E402

LONG = {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1000}
RECORD = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 16}, "age": {"type": "integer", "minimum": 0,
                                                                               "maximum": 120},
                         "city": {"enum": ["Paris", "Berlin", "Tokyo", "Lima"]},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3}}}
PROMPT = "Describe a person as a JSON object with a name, an age, a city and a few tags:\n"


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def run(llm, batch, params, repeats):
    best = None
    for _ in range(repeats):
        t = time.perf_counter()
        outs = llm.generate([PROMPT] * batch, params)
        dt = time.perf_counter() - t
        toks = sum(len(o.outputs[0].token_ids) for o in outs)
        if best is None or toks / dt > best[0]:
            best = (toks / dt, toks, dt)
    return best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="max_tokens 24, one repeat")
    a = ap.parse_args()
    if a.quick:
        a.max_tokens, a.repeats = 24, 1
    from flowrt.engine import LLM, SamplingParams, StructuredOutputsParams
    from structured_schemas import SCHEMAS

    dtype = resolve_dtype(a.dtype)
    print_banner(dtype)
    llm = LLM(model=a.model, dtype=dtype)
    mgr = llm.engine.structured
    t = time.perf_counter()
    _ = mgr.ll_tokenizer
    print(f"llguidance tokenizer built in {1e3 * (time.perf_counter() - t):.0f} ms (once per engine)")

    comp = []
    for s in SCHEMAS:
        t = time.perf_counter()
        mgr.compile(StructuredOutputsParams(json=s), use_cache=False)
        comp.append(time.perf_counter() - t)
    print(f"compile over {len(SCHEMAS)} schemas (uncached): p50 {1e3 * pct(comp, .5):.1f} ms, "
          f"p99 {1e3 * pct(comp, .99):.1f} ms, max {1e3 * max(comp):.1f} ms  (target p99 < 50 ms)")

    llm.generate(PROMPT, SamplingParams(max_tokens=4))  # warm-up
    for batch in (1, 32):
        plain = SamplingParams(max_tokens=a.max_tokens, temperature=1.0, seed=0, ignore_eos=True)
        cons = SamplingParams(max_tokens=a.max_tokens, temperature=1.0, seed=0,
                              structured_outputs=StructuredOutputsParams(json=LONG))
        u = run(llm, batch, plain, a.repeats)
        mgr.mask_log.clear()
        m0 = mgr.mask_seconds
        c = run(llm, batch, cons, a.repeats)
        per_tok = [dt / rows for dt, rows in mgr.mask_log]
        share = (mgr.mask_seconds - m0) / (c[2] * a.repeats)
        print(f"batch {batch:2d}: unconstrained {u[0]:7.1f} tok/s, constrained {c[0]:7.1f} tok/s "
              f"({100 * c[0] / u[0]:.0f}%); mask fill per token p50 {1e6 * pct(per_tok, .5):.0f} us, "
              f"p99 {1e6 * pct(per_tok, .99):.0f} us; masking {100 * share:.1f}% of wall")

    f0, g0 = llm.stats()["forced_tokens"], llm.stats()["generated_tokens"]
    rec = SamplingParams(max_tokens=96, temperature=0.7, seed=1, structured_outputs=StructuredOutputsParams(json=RECORD))
    t = time.perf_counter()
    outs = llm.generate([PROMPT] * 32, rec)
    dt = time.perf_counter() - t
    f, g = llm.stats()["forced_tokens"] - f0, llm.stats()["generated_tokens"] - g0
    done = sum(o.outputs[0].finish_reason == "stop" for o in outs)
    print(f"record schema, batch 32: {g} tokens in {dt:.1f} s ({g / dt:.1f} tok/s), forced {f} "
          f"({100 * f / max(g, 1):.0f}%), {done}/32 complete; e.g. {outs[0].outputs[0].text!r}")


if __name__ == "__main__":
    main()
