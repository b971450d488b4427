#!/usr/bin/env python
"""Cold resume with and without KV checkpoints (--checkpoint-kv): a run with several threads of 1-2k tokens
pauses on an interrupt (blocks written beside the database); then, each in a fresh process, a resume with
the blocks loaded into the prefix cache and a resume without them, alternating, --rounds times, each from a
copy of the paused database. Reported per resume: prefill tokens computed and the resume's wall time (the
engine is started before the clock starts), and the greedy outputs must agree.

--case threads (default): the threads come from an earlier step (held by its result) and the step that
interrupts uses them after. --case interrupt (issue 34): one step opens the threads, generates, waits in
``fr.interrupt`` (only its frame holds them) and generates again with the answer, the human-in-the-loop shape.

The run is paused twice, each in a fresh process and its own block directory: with the blocks written on the
event loop (``queue_bytes=0``: as before the writer thread) and by the writer thread (the default; its blocks
are the ones resumed). For each: the run's ``kv_save_blocked_s`` (time its saves kept the event loop: copying
blocks out of the engine, waiting for room in the queue, the last blocks' writes) and the longest the event
loop was late for a 5 ms timer while the run paused.

    python bench/kv_resume.py [--model PATH] [--dtype auto] [--threads 4] [--rounds 3] [--case interrupt]

Target (issue 24): at most one partial block per thread computed, at least 3x faster than without.
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sysinfo import banner  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

WORKFLOW = '''
import flowrt as fr

wf = fr.Workflow("long_threads")
TOPICS = ["rivers", "mountains", "cities", "forests", "oceans", "deserts", "islands", "valleys"]


def prompt(i: int, words: int) -> str:
    topic = TOPICS[i % len(TOPICS)]
    return " ".join(f"Note {k} about {topic}: the {topic} of region {k * 7 % 97} are described in chapter {k}."
                    for k in range(words // 14))


@wf.step
async def read(threads: int, words: int, llm: fr.Model) -> list:
    ts = [llm.thread(prompt(i, words + 150 * i)) for i in range(threads)]
    for t in ts:
        await t.gen(max_tokens=8, temperature=0)
    return ts


@wf.step
async def answer(read: list) -> list:
    await fr.interrupt("continue?")
    out = []
    for t in read:
        t += " In short,"
        out.append(await t.gen(max_tokens=16, temperature=0))
    return out


ask = fr.Workflow("ask_long")


@ask.step
async def ask_step(threads: int, words: int, llm: fr.Model) -> list:
    ts = [llm.thread(prompt(i, words + 150 * i)) for i in range(threads)]
    for t in ts:
        await t.gen(max_tokens=8, temperature=0)
    reply = await fr.interrupt("continue?")
    out = []
    for t in ts:
        t += " " + reply + " In short,"
        out.append(await t.gen(max_tokens=16, temperature=0))
    return out
'''

CASES = {"threads": ("long_threads", "answer"), "interrupt": ("ask_long", "ask_step")}   # workflow, last step

CHILD = r'''
import json, sys, time, anyio
import flowrt as fr
from flowrt.graph.loader import load_workflow

mode, wf_file, db, kv, model, dtype, threads, words, name, last = sys.argv[1:11]
wf = load_workflow(wf_file, name)
kw = {} if model == "-" else {"model": model}


async def lateness(out: list) -> None:
    """The longest the event loop was late for a 5 ms timer (a save holding the loop shows here)."""
    while True:
        t = time.perf_counter()
        await anyio.sleep(0.005)
        out[0] = max(out[0], time.perf_counter() - t - 0.005)


async def main():
    async with fr.Runtime(kw.get("model"), checkpoint=db, checkpoint_kv=kv if kv != "-" else False,
                          dtype=dtype) as rt:
        await rt.model()   # the engine starts before the clock
        if mode.startswith("pause"):
            if mode == "pause-inline":   # blocks written on the event loop, as before the writer thread
                from flowrt.checkpoint.kv import KVCheckpoint
                rt.kv_checkpoint = KVCheckpoint(kv, queue_bytes=0)
            late = [0.0]
            t0 = time.perf_counter()
            async with anyio.create_task_group() as tg:
                tg.start_soon(lateness, late)
                r = await rt.run(wf, threads=int(threads), words=int(words))
                tg.cancel_scope.cancel()
            print(json.dumps({"run_id": r.run_id, "status": r.status, "seconds": time.perf_counter() - t0,
                              "errors": {k: e.message for k, e in r.errors.items()},
                              "prefill": rt.stats()["prefill_tokens_computed"],
                              "blocked": r.stats["kv_save_blocked_s"], "late": late[0]}))
            return
        before = rt.stats()["prefill_tokens_computed"]
        t0 = time.perf_counter()
        r = await rt.resume(sys.argv[11], workflow=wf, answer="yes")
        dt = time.perf_counter() - t0
        print(json.dumps({"status": r.status, "seconds": dt, "outputs": r.outputs[last],
                          "prefill": rt.stats()["prefill_tokens_computed"] - before}))

anyio.run(main)
'''


def child(*args: str) -> dict:
    p = subprocess.run([sys.executable, "-c", CHILD, *args], cwd=ROOT, capture_output=True, text=True, timeout=1800)
    if p.returncode != 0:
        raise SystemExit(f"child failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="-", help="model path (default: the engine's default model)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--words", type=int, default=900, help="words in the first thread's prompt (+150 per thread)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--case", choices=sorted(CASES), default="threads",
                    help="threads: from an earlier step; interrupt: held by the step waiting in fr.interrupt")
    args = ap.parse_args()
    wf_name, last = CASES[args.case]
    print(banner(args.dtype), flush=True)
    with tempfile.TemporaryDirectory() as d:
        wf_file = os.path.join(d, "long_threads.py")
        Path(wf_file).write_text(WORKFLOW)
        for mode, how in (("pause-inline", "written on the event loop (before)"),
                          ("pause", "written by the writer thread (after)")):
            paused, kv = os.path.join(d, f"{mode}.db"), os.path.join(d, f"{mode}-blocks")
            info = child(mode, wf_file, paused, kv, args.model, args.dtype, str(args.threads), str(args.words),
                         wf_name, last)
            assert info["status"] == "interrupted", info
            blocks = sum(f.endswith(".kv") for _, _, fs in os.walk(kv) for f in fs)
            size = sum(os.path.getsize(os.path.join(p, f)) for p, _, fs in os.walk(kv) for f in fs
                       if f.endswith(".kv"))
            print(f"paused run ({args.case}), KV blocks {how}: {info['prefill']} prefill tokens, {info['seconds']:.2f} s; "
                  f"{blocks} KV blocks saved, {size / 2**20:.1f} MiB; kv_save_blocked_s {info['blocked']:.3f}, "
                  f"event loop late by at most {info['late'] * 1000:.0f} ms", flush=True)
        res: dict[str, list[dict]] = {"with": [], "without": []}
        outputs = set()
        for i in range(args.rounds):
            for name in (("with", "without") if i % 2 == 0 else ("without", "with")):
                db = os.path.join(d, f"r{i}{name}.db")
                with sqlite3.connect(paused) as src, sqlite3.connect(db) as dst:
                    src.backup(dst)   # with what is still in the write-ahead log
                r = child("resume", wf_file, db, kv if name == "with" else "-", args.model, args.dtype,
                          str(args.threads), str(args.words), wf_name, last, info["run_id"])
                assert r["status"] == "done", r
                outputs.add(json.dumps(r["outputs"]))
                res[name].append(r)
                print(f"round {i + 1} {name:>7} KV: {r['prefill']:6d} prefill tokens, {r['seconds']:.2f} s", flush=True)
    assert len(outputs) == 1, "resumes disagree"
    w = statistics.median(r["seconds"] for r in res["with"])
    wo = statistics.median(r["seconds"] for r in res["without"])
    pw = statistics.median(r["prefill"] for r in res["with"])
    pwo = statistics.median(r["prefill"] for r in res["without"])
    print(f"median: with KV {pw} prefill tokens, {w:.2f} s; without {pwo} tokens, {wo:.2f} s; {wo / w:.1f}x faster; "
          f"same greedy outputs")


if __name__ == "__main__":
    main()
