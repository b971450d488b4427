#!/usr/bin/env python
"""Engine start-up in a fresh process, phase by phase: imports (torch included), construction (config, tokenizer,
weights, packing, KV cache) and the first generated token of a 200-token prompt. Each run is a new interpreter
(nothing cached in memory but the OS page cache); the table shows every run and the median.

    python bench/startup.py [--model DIR|FILE] [--runs 3] [--dtype auto]

bench/throughput.py's "start s" column is construction + first token inside its worker, where torch is already
imported; this script also counts the imports, as a user's `flowrt run` does.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sysinfo import banner  # noqa: E402

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
from flowrt.engine import LLM, SamplingParams
t1 = time.perf_counter()
llm = LLM(sys.argv[1] or None, dtype=sys.argv[2])
t2 = time.perf_counter()
llm.generate([{"prompt_token_ids": list(range(100, 300))}], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
t3 = time.perf_counter()
print(json.dumps({"import": t1 - t0, "construct": t2 - t1, "first_token": t3 - t2, "total": t3 - t0,
                  "transformers_imported": "transformers" in sys.modules}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="", help="model path (default: the engine's default model)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    print(banner(args.dtype, f"model {args.model or 'default'}"))
    runs = []
    for _ in range(args.runs):
        out = subprocess.run([sys.executable, "-c", CHILD, args.model, args.dtype], capture_output=True, text=True,
                             check=True)
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    keys = ("import", "construct", "first_token", "total")
    print(f"{'run':>6} " + " ".join(f"{k:>12s}" for k in keys) + "  transformers imported")
    for i, r in enumerate(runs):
        print(f"{i + 1:>6} " + " ".join(f"{r[k]:12.2f}" for k in keys) + f"  {r['transformers_imported']}")
    print(f"{'median':>6} " + " ".join(f"{statistics.median(r[k] for r in runs):12.2f}" for k in keys))
    print(json.dumps({"runs": runs}))


if __name__ == "__main__":
    main()
