"""Issue 34 item 1: a run's KV survives every wait. A run paused by ``fr.interrupt`` saves the KV of every
thread it holds (those of the step waiting in the interrupt too, whose frame is gone by then), and a cold
resume (a fresh engine) computes at most one partial block per thread plus the answer, with the greedy
outputs of an uninterrupted run; so does the second resume of a run that waits again (threads restored from
token ids stay registered). A run cancelled mid-step (a server's shutdown, Ctrl-C, SIGTERM) saves its KV
too."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import anyio
import pytest

import flowrt as fr
from support import STORIES, flowrt_cli

BLOCK = 16

PROMPT = ("Once upon a time there was a little girl named Lily who lived in a small house near the big park. "
          "Every morning she went outside to play with her red ball and her friend Tom, a happy dog. ")
PROMPT2 = ("One day the sun was shining and the birds were singing in the tall green trees. Lily saw a big box "
           "under the tree and she wanted to know what was inside it, so she called her mom. ")

ASK = '''
import os, pathlib
import anyio
import flowrt as fr

wf = fr.Workflow("ask")


@wf.step
async def s1(prompt: str, llm: fr.Model) -> dict:
    t = llm.thread(prompt)
    return {"text": await t.gen(max_tokens=24, temperature=0), "t": t}


@wf.step
async def s2(s1: dict, prompt2: str, llm: fr.Model, wait: bool = True) -> dict:
    u = llm.thread(prompt2)          # the step's own thread: only its frame holds it while it waits
    first = await u.gen(max_tokens=16, temperature=0)
    if os.environ.get("FLOWRT_TEST_HANG") == "s2":
        pathlib.Path(os.environ["FLOWRT_TEST_READY"]).write_text("s2")
        await anyio.sleep(600)       # on the event loop: SIGTERM cancels the run here
    answer = await fr.interrupt("first?") if wait else "Yes."
    u += " " + answer
    return {"first": first, "second": await u.gen(max_tokens=16, temperature=0), "u": u}


@wf.step
async def s3(s1: dict, s2: dict, wait: bool = True) -> dict:
    answer = await fr.interrupt("second?") if wait else "Go on."
    t, u = s1["t"], s2["u"]          # restored from token ids by the first resume
    t += " " + answer
    u += " " + answer
    return {"a": await t.gen(max_tokens=16, temperature=0), "b": await u.gen(max_tokens=16, temperature=0)}
'''


@pytest.fixture
def ask(tmp_path):
    from flowrt.graph.loader import load_workflow

    f = tmp_path / "ask.py"
    f.write_text(ASK)
    return f, load_workflow(f)


def _engine():
    from flowrt.engine import AsyncLLM

    return AsyncLLM(model=str(STORIES), dtype="float32", seed=0, num_kv_blocks=256)


def _answer_tokens(text: str) -> int:
    from transformers import AutoTokenizer

    return len(AutoTokenizer.from_pretrained(STORIES)(" " + text, add_special_tokens=False)["input_ids"])


async def _on_fresh_engine(db: str, kv: object, go) -> tuple[fr.RunResult, int]:
    """``go(rt)`` on a runtime over a new engine (a cold start); the result and the prefill tokens computed."""
    eng = _engine()
    try:
        async with fr.Runtime(eng, checkpoint=db, checkpoint_kv=kv) as rt:
            r = await go(rt)
            return r, eng.stats()["prefill_tokens_computed"]
    finally:
        eng.shutdown()


def test_every_wait_keeps_the_runs_kv(tmp_path, ask, store_spec):
    """Interrupted at s2 (its own thread waits in the interrupt), resumed cold: s2's prompt comes from the
    saved blocks; interrupted again at s3, resumed cold: the threads the first resume restored from token ids
    come from saved blocks too. Both resumes, with and without KV blocks; outputs as an uninterrupted run's."""
    _, wf = ask
    db = store_spec
    kv_dir = db + ".kv" if "://" not in db else str(tmp_path / "blocks")
    inputs = {"prompt": PROMPT, "prompt2": PROMPT2}

    def resumed(kv: bool) -> tuple[list[fr.RunResult], list[int]]:
        kv_opt = kv_dir if kv else False
        r0, _ = anyio.run(_on_fresh_engine, db, kv_opt, lambda rt: rt.run(wf, **inputs))
        assert r0.status == "interrupted" and r0.interrupt["step"] == "s2"
        r1, n1 = anyio.run(_on_fresh_engine, db, kv_opt, lambda rt: rt.resume(r0.run_id, workflow=wf, answer="Yes."))
        assert r1.status == "interrupted" and r1.interrupt["step"] == "s3"
        r2, n2 = anyio.run(_on_fresh_engine, db, kv_opt,
                           lambda rt: rt.resume(r0.run_id, workflow=wf, answer="Go on."))
        assert r2.status == "done", r2.errors
        return [r0, r1, r2], [n1, n2]

    (_, r1, r2), (with1, with2) = resumed(True)
    _, (without1, without2) = resumed(False)
    ref, _ = anyio.run(_on_fresh_engine, str(tmp_path / "plain.db"), False, lambda rt: rt.run(wf, **inputs, wait=False))
    print(f"\ncold resumes: {with1}, {with2} prefill tokens with KV blocks; {without1}, {without2} without")
    assert r1.stats["kv_blocks_loaded"] > 0 and r2.stats["kv_blocks_loaded"] > 0
    assert r1.stats["kv_blocks_rejected"] == {} == r2.stats["kv_blocks_rejected"]
    assert with1 <= BLOCK + _answer_tokens("Yes.")            # s2's thread: its last partial block, the answer
    assert with2 <= 2 * (BLOCK + _answer_tokens("Go on."))    # s3's two threads likewise
    assert without1 > with1 + 2 * BLOCK and without2 > with2 + 4 * BLOCK
    assert r2.outputs["s3"] == ref.outputs["s3"]
    texts = ("first", "second")
    assert {k: r2.outputs["s2"][k] for k in texts} == {k: ref.outputs["s2"][k] for k in texts}


def test_a_cancelled_run_saves_its_kv(tmp_path, ask):
    """A run cancelled while a step runs (a server ending its requests at shutdown, Ctrl-C) saves a checkpoint
    with the KV of the threads it holds, the running step's included: the cold resume reuses them."""
    _, wf = ask
    db = str(tmp_path / "runs.db")
    inputs = {"prompt": PROMPT, "prompt2": PROMPT2}

    async def cancelled(rt: fr.Runtime) -> str:
        events: list = []
        with anyio.move_on_after(120) as scope:
            async for e in rt.stream(wf, **inputs, tokens=True):
                events.append(e)
                if e.type == "token" and e.step == "s2" and len(events) > 5:
                    scope.cancel()   # s2 is generating from its own thread
        assert scope.cancelled_caught
        return events[0].run_id

    run_id, _ = anyio.run(_on_fresh_engine, db, True, cancelled)
    r, computed = anyio.run(_on_fresh_engine, db, True, lambda rt: rt.resume(run_id, workflow=wf))
    assert r.status == "interrupted" and r.interrupt["step"] == "s2"
    print(f"\ncold resume after a cancel: {computed} prefill tokens computed with KV blocks")
    assert computed <= BLOCK   # s1's thread is whole in the blocks; s2's prompt but its last partial block


def _finish(p: subprocess.Popen, code: int = 0) -> dict:
    out, err = p.communicate(timeout=300)
    assert p.returncode == code, err
    return json.loads(out)


@pytest.mark.slow
def test_cli_interrupt_exit_and_sigterm_then_fresh_process_resumes(tmp_path, ask):
    """The CLI: `flowrt run` exits 3 at the first interrupt; each `flowrt resume` (a fresh process) computes
    at most a partial block per thread plus the answer; a `flowrt resume` ended by SIGTERM mid-step saves the
    KV too. Outputs as an uninterrupted run's."""
    f, _ = ask
    common = ["--model", str(STORIES), "--dtype", "float32", "--input", f"prompt={PROMPT}", "--input",
              f"prompt2={PROMPT2}", "--no-progress", "--json"]
    db = str(tmp_path / "runs.db")
    kv = ["--checkpoint", db, "--checkpoint-kv"]
    ref = _finish(flowrt_cli("run", str(f), *common, "--input", "wait=false"))["outputs"]
    first = _finish(flowrt_cli("run", str(f), *common, *kv), code=3)
    run_id = first["run_id"]
    # the first resume is ended by SIGTERM while s2 runs again (past its generation): it saves and exits 143
    ready = tmp_path / "ready"
    p = flowrt_cli("resume", run_id, *kv, "--answer", "Yes.", "--json", "--no-progress",
                   env={"FLOWRT_TEST_HANG": "s2", "FLOWRT_TEST_READY": str(ready)})
    deadline = time.time() + 300
    while not ready.exists():
        assert p.poll() is None and time.time() < deadline, p.communicate()
        time.sleep(0.1)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 143 and "terminated" in err, err
    # its checkpoint kept the answer: the next resume continues without one
    second = _finish(flowrt_cli("resume", run_id, *kv, "--json", "--no-progress"), code=3)
    third = _finish(flowrt_cli("resume", run_id, *kv, "--answer", "Go on.", "--json", "--no-progress"))
    n2, n3 = second["stats"]["prefill_tokens_computed"], third["stats"]["prefill_tokens_computed"]
    print(f"\nCLI cold resumes: {n2} and {n3} prefill tokens computed with KV blocks")
    assert n2 <= BLOCK + _answer_tokens("Yes.") and n3 <= 2 * (BLOCK + _answer_tokens("Go on."))
    assert third["outputs"]["s3"] == ref["s3"]
    assert os.listdir(db + ".kv")   # blocks were kept while the run waited


def _serve(f, db: str, port: int, env: dict | None = None) -> subprocess.Popen:
    """`flowrt serve` of the ask workflow with KV checkpoints on ``port``, once it answers /health."""
    import httpx

    p = flowrt_cli("serve", "--model", str(STORIES), "--dtype", "float32", "--port", str(port), "--workflow", str(f),
                   "--checkpoint", db, "--checkpoint-kv", "--graceful-timeout", "1", env=env)
    deadline = time.time() + 120
    while True:
        assert p.poll() is None and time.time() < deadline, p.communicate()
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return p
        except httpx.HTTPError:
            time.sleep(0.2)


def _stop(p: subprocess.Popen) -> str:
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    return err


@pytest.mark.slow
def test_serve_sigterm_with_runs_waiting_and_running_then_resume_over_http(tmp_path, ask):
    """`flowrt serve`: a run waits at s2, the server gets SIGTERM; restarted, a resume of the run is ended by
    SIGTERM mid-step (past the grace period); restarted again, the resumes over HTTP compute at most a partial
    block per thread plus the answer, with an uninterrupted run's outputs."""
    import socket
    import threading

    import httpx

    f, wf = ask
    db = str(tmp_path / "runs.db")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/v1/workflows/ask/runs"
    inputs = {"prompt": PROMPT, "prompt2": PROMPT2}
    p = _serve(f, db, port)
    try:
        body = httpx.post(url, json={"inputs": inputs}, timeout=120).json()
    finally:
        _stop(p)
    assert body["status"] == "interrupted", body
    run_id = body["run_id"]
    ready = tmp_path / "ready"
    p = _serve(f, db, port, env={"FLOWRT_TEST_HANG": "s2", "FLOWRT_TEST_READY": str(ready)})
    try:
        answered = threading.Thread(target=lambda: httpx.post(f"{url}/{run_id}/resume", json={"answer": "Yes."},
                                                              timeout=120), daemon=True)
        answered.start()
        deadline = time.time() + 120
        while not ready.exists():
            assert time.time() < deadline
            time.sleep(0.1)
    finally:
        _stop(p)
    p = _serve(f, db, port)
    try:
        second = httpx.post(f"{url}/{run_id}/resume", json={}, timeout=120).json()
        n2 = second["stats"]["prefill_tokens_computed"]
        third = httpx.post(f"{url}/{run_id}/resume", json={"answer": "Go on."}, timeout=120).json()
        n3 = third["stats"]["prefill_tokens_computed"] - n2
    finally:
        _stop(p)
    ref, _ = anyio.run(_on_fresh_engine, str(tmp_path / "plain.db"), False, lambda rt: rt.run(wf, **inputs, wait=False))
    print(f"\nserve cold resumes: {n2} and {n3} prefill tokens computed with KV blocks")
    assert second["status"] == "interrupted" and not third["errors"] and "status" not in third, third   # done
    assert n2 <= BLOCK + _answer_tokens("Yes.") and n3 <= 2 * (BLOCK + _answer_tokens("Go on."))
    assert third["outputs"]["s3"] == ref.outputs["s3"]


def _nested() -> fr.Workflow:
    inner = fr.Workflow("inner")

    @inner.step
    async def ask(prompt: str, llm: fr.Model) -> str:
        t = llm.thread(prompt)
        first = await t.gen(max_tokens=16, temperature=0)
        t += " " + await fr.interrupt("ok?")
        return first + await t.gen(max_tokens=8, temperature=0)

    top = fr.Workflow("top")

    @top.step
    async def outer(prompt: str, prompt2: str, llm: fr.Model) -> str:
        u = llm.thread(prompt2)      # the enclosing step's thread waits with the subgraph's interrupt
        head = await u.gen(max_tokens=8, temperature=0)
        return head + await fr.subflow(inner, prompt=prompt)

    return top


def test_an_interrupt_inside_a_subgraph_keeps_the_enclosing_steps_threads(tmp_path):
    """Waiting inside fr.subflow: the KV of the subgraph step's thread and of the enclosing step's is saved;
    the cold resume computes a partial block of each plus the answer, with the outputs of a resume without KV."""
    wf = _nested()
    inputs = {"prompt": PROMPT, "prompt2": PROMPT2}

    def resumed(kv: bool) -> tuple[fr.RunResult, int]:
        db = str(tmp_path / f"{kv}.db")
        r0, _ = anyio.run(_on_fresh_engine, db, kv, lambda rt: rt.run(wf, **inputs))
        assert r0.status == "interrupted" and r0.interrupt["step"] == "outer/inner/ask"
        return anyio.run(_on_fresh_engine, db, kv, lambda rt: rt.resume(r0.run_id, workflow=wf, answer="Yes."))

    (with_kv, n_with), (without, n_without) = resumed(True), resumed(False)
    print(f"\ncold resume inside a subgraph: {n_with} prefill tokens with KV blocks, {n_without} without")
    assert with_kv.status == without.status == "done"
    assert with_kv.outputs == without.outputs
    assert n_with <= 2 * BLOCK + _answer_tokens("Yes.") and n_without > n_with + 4 * BLOCK
