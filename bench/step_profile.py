#!/usr/bin/env python
"""Where one engine step's time goes, for a decode-heavy and a prefill-heavy batch.

Phases of LLMEngine.step (wall ms per step): schedule, prepare (inputs + attention metadata), forward (the model
and the logits), sample, process outputs (bookkeeping around sampling), other (the rest of step: locking, request
bookkeeping). The forward is then split by op kind with torch.profiler (self CPU time per op): matmul, attention,
norm, rotary, elementwise, other; ops run inside the model's norm / rotary functions and the attention backend's
forward count as that kind whatever aten op they are.

Batches:
  * decode: --decode-seqs (32) sequences with a --decode-context (300) token prompt each, stepped until every
    prompt is computed, then --steps decode steps timed (each sequence adds one token per step);
  * prefill: --prefill-seqs (4) fresh prompts of --prefill-len (512) tokens scheduled in one step (the chunked
    prefill budget must hold them: max_num_batched_tokens = seqs x len), --steps such steps.

    python bench/step_profile.py [--dtype auto] [--threads N] [--model PATH] [--steps 10] [--quick] [--json]

Coupling to the engine's internals is kept in ONE adapter (EngineAdapter below): it finds the engine under
LLM (.engine / .llm_engine), requests go in through engine.add_request and steps through engine.step, and phases
are timed by wrapping methods found by name (scheduler.schedule, runner.prepare, runner.execute, the engine's
_process / process_outputs, its module's sample). A name that is missing is reported as "not found" and its
time falls into "other": the script still runs while the engine is refactored.
"""

from __future__ import annotations

import argparse
import collections
import json
import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sysinfo import banner  # noqa: E402
from workloads import linear_flops_per_token  # noqa: E402

PHASES = ("schedule", "prepare", "forward", "sample", "process outputs")
KINDS = ("matmul", "attention", "norm", "rotary", "elementwise", "other")


# ---------------------------------------------------------------------------------------------- the adapter
class EngineAdapter:
    """Everything this script knows about the engine's insides."""

    CANDIDATES = {  # phase -> dotted attribute paths on the engine; every one found is timed (exclusive time)
        "schedule": ("scheduler.schedule",),
        "prepare": ("runner.prepare", "model_runner.prepare"),
        "forward": ("runner.execute", "model_runner.execute", "runner.execute_model"),
        "process outputs": ("scheduler.update_from_output", "outputs.process", "output_processor.process",
                            "_process", "process_outputs", "_process_outputs"),
    }

    def __init__(self, llm):
        self.llm = llm
        self.engine = next(e for e in (getattr(llm, "engine", None), getattr(llm, "llm_engine", None), llm)
                           if e is not None and hasattr(e, "step"))
        self.acc = collections.defaultdict(float)
        self.stack: list[list] = []  # [phase, time spent in nested timed calls]
        self.found, self.missing = {}, []
        self._undo = []
        self.marking = False

    # -- requests and steps
    def add(self, token_ids, params):
        e = self.engine
        try:
            return e.add_request({"prompt_token_ids": list(token_ids)}, params)
        except TypeError:
            return e.add_request(list(token_ids), params)

    def step(self):
        return self.engine.step()

    def busy(self) -> bool:
        e = self.engine
        for name in ("has_unfinished", "has_unfinished_requests"):
            if hasattr(e, name):
                return bool(getattr(e, name)())
        return bool(self.llm.stats().get("num_running", 0) or self.llm.stats().get("num_waiting", 0))

    def stats(self) -> dict:
        try:
            return self.llm.stats()
        except Exception:
            return {}

    # -- timing by name
    def _resolve(self, path):
        obj = self.engine
        *head, last = path.split(".")
        for h in head:
            obj = getattr(obj, h, None)
            if obj is None:
                return None, None
        return (obj, last) if callable(getattr(obj, last, None)) else (None, None)

    def _wrap(self, owner, name, phase, marker=None):
        orig = getattr(owner, name)
        adapter = self

        def timed(*a, **kw):
            """Exclusive time: what nested timed calls took goes to their own phase."""
            frame = [phase, 0.0]
            adapter.stack.append(frame)
            t = time.perf_counter()
            try:
                if marker and adapter.marking:
                    with torch.profiler.record_function(marker):
                        return orig(*a, **kw)
                return orig(*a, **kw)
            finally:
                dt = time.perf_counter() - t
                adapter.stack.pop()
                adapter.acc[phase] += dt - frame[1]
                if adapter.stack:
                    adapter.stack[-1][1] += dt

        had_own = name in getattr(owner, "__dict__", {})
        setattr(owner, name, timed)
        self._undo.append((owner, name, orig, had_own))

    def install(self):
        for phase, paths in self.CANDIDATES.items():
            for p in paths:
                owner, name = self._resolve(p)
                if owner is not None:
                    self._wrap(owner, name, phase, marker="step::forward" if phase == "forward" else None)
                    self.found[phase] = f"{self.found[phase]}, {p}" if phase in self.found else p
            if phase not in self.found:
                self.missing.append(phase)
        mod = sys.modules.get(type(self.engine).__module__)
        if mod is not None and callable(getattr(mod, "sample", None)):
            self._wrap(mod, "sample", "sample")
            self.found["sample"] = f"{mod.__name__}.sample"
        else:
            self.missing.append("sample")
        self._wrap(self.engine, "step", "step")
        # markers for the op-kind split: the model module's norm / rotary functions, the attention backend
        runner = next((getattr(self.engine, n) for n in ("runner", "model_runner") if hasattr(self.engine, n)), None)
        model = getattr(runner, "model", None)
        mmod = sys.modules.get(type(model).__module__) if model is not None else None
        if mmod is not None:
            for fname in dir(mmod):
                fn = getattr(mmod, fname)
                if not callable(fn) or isinstance(fn, type) or getattr(fn, "__module__", None) != mmod.__name__:
                    continue
                low = fname.lower()
                kind = "norm" if "norm" in low else "rotary" if ("rotary" in low or "rotate" in low or
                                                                   low.startswith("apply_rope")) else None
                if kind:
                    self._marker(mmod, fname, f"kind::{kind}")
        packed = getattr(sys.modules.get("flowrt.engine.cpu.ops"), "PackedLinear", None)
        if packed is not None:  # flowrt's own projection kernel: a ctypes call, no aten op names it
            self._marker(packed, "__call__", "kind::matmul")
        backend = getattr(runner, "backend", None) or getattr(runner, "attn_backend", None)
        if backend is not None and callable(getattr(backend, "forward", None)):
            self._marker(backend, "forward", "kind::attention")
        return self

    def _marker(self, owner, name, label):
        orig = getattr(owner, name)
        adapter = self

        def marked(*a, **kw):
            if not adapter.marking:
                return orig(*a, **kw)
            with torch.profiler.record_function(label):
                return orig(*a, **kw)

        had_own = name in getattr(owner, "__dict__", {})
        setattr(owner, name, marked)
        self._undo.append((owner, name, orig, had_own))

    def uninstall(self):
        for owner, name, orig, had_own in reversed(self._undo):
            if had_own or isinstance(owner, type(sys)):
                setattr(owner, name, orig)
            else:
                delattr(owner, name)
        self._undo.clear()

    def reset(self):
        self.acc.clear()
        self.stack.clear()


# ---------------------------------------------------------------------------------------------- op kinds
FLOWRT_KERNELS = {"gemm": "matmul", "gemm_bf16": "matmul", "paged_decode": "attention", "paged_flash": "attention", "kv_write": "attention",
                  "add_rmsnorm": "norm", "rope": "rotary", "rope_kv_write": "rotary", "silu_mul": "elementwise"}  # cpu_ops' flowrt::<kernel>


def op_kind(name: str) -> str:
    n = name.lower()
    if n.startswith("flowrt::"):
        return FLOWRT_KERNELS.get(n[8:], "other")
    if any(k in n for k in ("linear", "matmul", "::mm", "addmm", "bmm", "gemm", "mkldnn")):
        return "matmul"
    if any(k in n for k in ("scaled_dot_product", "attention", "flash", "softmax", "sdpa")):
        return "attention"
    if "norm" in n or "rsqrt" in n:
        return "norm"
    if n.startswith("aten::"):
        return "elementwise"
    return "other"


def forward_split(prof) -> tuple[dict, float]:
    """Self CPU time (s) per kind of every op inside step::forward, from a torch.profiler run."""
    out = collections.defaultdict(float)
    total = 0.0
    for ev in prof.events():
        if ev.name.startswith(("kind::", "step::")):
            kind_from_self = ev.name[6:] if ev.name.startswith("kind::") else None
        else:
            kind_from_self = None
        marker, inside, p = kind_from_self, ev.name == "step::forward", ev.cpu_parent
        while p is not None:
            if p.name == "step::forward":
                inside = True
            elif marker is None and p.name.startswith("kind::"):
                marker = p.name[6:]
            p = p.cpu_parent
        if not inside or ev.name == "step::forward":
            if ev.name == "step::forward":
                out["other"] += ev.self_cpu_time_total / 1e6  # the forward's own python time
                total += ev.self_cpu_time_total / 1e6
            continue
        kind = marker or op_kind(ev.name)
        out[kind] += ev.self_cpu_time_total / 1e6
        total += ev.self_cpu_time_total / 1e6
    return dict(out), total


# ---------------------------------------------------------------------------------------------- batches
def random_ids(n, L, seed, vocab=49152):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (L,), generator=g).tolist() for _ in range(n)]


def run_decode(ad: EngineAdapter, SP, args, profile: bool):
    """Fills the decode batch, then returns (phase seconds per step, forward split or None, tokens per step)."""
    steps = args.steps
    extra = 3 + steps * (2 if profile else 1) + 2
    for ids in random_ids(args.decode_seqs, args.decode_context, seed=7):
        ad.add(ids, SP(max_tokens=extra + 2 * steps, temperature=0, ignore_eos=True))
    last = None
    for _ in range(10_000):  # prefill until every prompt is computed (prefill counter stops growing)
        ad.step()
        now = ad.stats().get("prefill_tokens_computed")
        if now is not None and now == last:
            break
        last = now
    for _ in range(2):
        ad.step()  # warm-up decode steps
    ad.reset()
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    for _ in range(steps):
        ad.step()
    phases = {k: v / steps for k, v in ad.acc.items()}
    phases.update(kernel_costs(r0, steps))
    split = None
    if profile:
        split = profile_steps(ad, steps)
    while ad.busy():
        ad.step()
    return phases, split, args.decode_seqs


def run_prefill(ad: EngineAdapter, SP, args, profile: bool):
    seed = 100

    def one_step():
        nonlocal seed
        seed += 1
        for ids in random_ids(args.prefill_seqs, args.prefill_len, seed):
            ad.add(ids, SP(max_tokens=1, temperature=0, ignore_eos=True))
        ad.step()

    def drain():
        while ad.busy():
            ad.step()

    one_step(), drain()  # warm-up
    acc = collections.defaultdict(float)
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    for _ in range(args.steps):
        ad.reset()
        one_step()
        for k, v in ad.acc.items():
            acc[k] += v
        drain()
    phases = {k: v / args.steps for k, v in acc.items()}
    phases.update(kernel_costs(r0, args.steps))
    split = None
    if profile:
        from torch.profiler import ProfilerActivity, profile as tprofile

        ad.marking = True
        with tprofile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(max(1, args.steps // 2)):
                one_step()
                drain()
        ad.marking = False
        s, total = forward_split(prof)
        split = {k: v / max(1, args.steps // 2) for k, v in s.items()}
    return phases, split, args.prefill_seqs * args.prefill_len


def kernel_costs(r0, steps: int) -> dict:
    """Minor page faults and kernel (system) seconds per step since the rusage snapshot r0: memory that a step
    faults in afresh instead of reusing shows up here (engine/cpu/memory.py)."""
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    return {"_minflt": (r1.ru_minflt - r0.ru_minflt) / steps, "_sys": (r1.ru_stime - r0.ru_stime) / steps}


def profile_steps(ad, steps):
    from torch.profiler import ProfilerActivity, profile as tprofile

    n = max(1, steps // 2)
    ad.marking = True
    with tprofile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(n):
            ad.step()
    ad.marking = False
    s, _ = forward_split(prof)
    return {k: v / n for k, v in s.items()}


def report(name, phases, split, tokens, dtype):
    faults, sys_s = phases.pop("_minflt", None), phases.pop("_sys", None)
    rows = {p: phases.get(p, 0.0) for p in PHASES}
    rows["other"] = phases.get("step", 0.0)  # step's own time outside every timed phase
    step = sum(rows.values())
    gf = tokens * linear_flops_per_token() / max(rows["forward"], 1e-9) / 1e9
    print(f"\n{name}: {step * 1e3:.1f} ms per step, {tokens} tokens per step, {tokens / step:.0f} tok/s; "
          f"forward at {gf:.1f} GFLOP/s ({dtype})")
    for k, v in rows.items():
        print(f"  {k:16s} {v * 1e3:9.2f} ms  {100 * v / step:5.1f}%")
    if faults is not None:
        print(f"  minor page faults {faults:.0f} per step, kernel time {sys_s * 1e3:.1f} ms per step")
    if split:
        tot = sum(split.values()) or 1.0
        print(f"  forward by op kind (torch.profiler, self CPU time; {tot * 1e3:.1f} ms per step under the profiler):")
        for k in KINDS:
            if split.get(k):
                print(f"    {k:14s} {split[k] * 1e3:9.2f} ms  {100 * split[k] / tot:5.1f}%")
    return {"ms_per_step": step * 1e3, "tokens_per_step": tokens, "phases_ms": {k: v * 1e3 for k, v in rows.items()},
            "minor_faults_per_step": faults, "kernel_ms_per_step": None if sys_s is None else sys_s * 1e3,
            "forward_split_ms": {k: v * 1e3 for k, v in (split or {}).items()}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model path (default: the engine's default model)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=None, help="compute threads (default: the engine's)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--decode-seqs", type=int, default=32)
    ap.add_argument("--decode-context", type=int, default=300)
    ap.add_argument("--prefill-seqs", type=int, default=4)
    ap.add_argument("--prefill-len", type=int, default=512)
    ap.add_argument("--no-profile", action="store_true", help="phases only, no torch.profiler split")
    ap.add_argument("--quick", action="store_true", help="3 steps each (checks that it works)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.steps = 3
    from flowrt.engine import LLM, SamplingParams

    budget = max(2048, args.prefill_seqs * args.prefill_len)
    llm = LLM(args.model, dtype=args.dtype, max_num_batched_tokens=budget, num_threads=args.threads)
    eng_dtype = str(getattr(getattr(llm, "engine", llm), "dtype", args.dtype)).removeprefix("torch.")
    print(banner(eng_dtype, f"model {args.model or 'default'}"), flush=True)
    ad = EngineAdapter(llm).install()
    print(f"timed by name: {ad.found}" + (f"; not found (counted in other): {ad.missing}" if ad.missing else ""))
    out = {"dtype": eng_dtype, "found": ad.found, "missing": ad.missing}
    try:
        ph, sp, tok = run_decode(ad, SamplingParams, args, not args.no_profile)
        out["decode"] = report(f"decode: {args.decode_seqs} sequences, context ~{args.decode_context}", ph, sp, tok,
                               eng_dtype)
        ph, sp, tok = run_prefill(ad, SamplingParams, args, not args.no_profile)
        out["prefill"] = report(f"prefill: {args.prefill_seqs} x {args.prefill_len} new tokens", ph, sp, tok,
                                eng_dtype)
    finally:
        ad.uninstall()
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
