"""Tracing: step and LLM-call spans exported as Chrome trace-format JSON."""

from __future__ import annotations

import json
import time
from collections import defaultdict

import anyio
import pytest

import flowrt as fr
from flowrt.runner.trace import Tracer
from support import STORIES

MODEL = str(STORIES)


def check_chrome_trace(obj: dict, window_us: float) -> list[dict]:
    """Validates the Chrome trace event format; returns the complete ("X") events. Times count from the tracer's
    creation, so every event lies within ``window_us``: the microseconds from before the tracer was made until
    after the trace was taken."""
    text = json.dumps(obj)  # serializable
    obj = json.loads(text)
    assert isinstance(obj["traceEvents"], list)
    xs = []
    for e in obj["traceEvents"]:
        assert e["ph"] in ("X", "M", "C"), e
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int) and isinstance(e["name"], str)
        if e["ph"] == "X":
            assert isinstance(e["ts"], (int, float)) and isinstance(e["dur"], (int, float))
            assert 0 <= e["ts"] <= e["ts"] + e["dur"] <= window_us, (e, window_us)
            assert isinstance(e.get("args", {}), dict)
            xs.append(e)
        elif e["ph"] == "C":
            assert 0 <= e["ts"] <= window_us, (e, window_us)
            assert all(isinstance(v, (int, float)) for v in e["args"].values())
    # complete events on one row never partly overlap (viewers need proper nesting)
    rows = defaultdict(list)
    for e in xs:
        rows[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"]))
    for spans in rows.values():
        spans.sort()
        for (s0, e0), (s1, e1) in zip(spans, spans[1:]):
            assert s1 >= e0 - 1e-3 or e1 <= e0, (s0, e0, s1, e1)
    return xs


def test_workflow_trace_has_a_span_per_step_and_overlapping_steps_get_lanes(tmp_path):
    wf = fr.Workflow("traced")

    @wf.step
    async def a():
        await anyio.sleep(0.1)
        return 1

    @wf.step
    async def b():
        await anyio.sleep(0.1)
        return 2

    @wf.step(map="xs")
    async def each(xs, a, b):
        await anyio.sleep(0.02)
        return xs

    @wf.step
    def fails(a):
        raise ValueError("x")

    t0 = time.perf_counter()
    r = wf.run(xs=[1, 2, 3])
    trace = r.tracer.to_chrome()
    window = (time.perf_counter() - t0) * 1e6
    xs = check_chrome_trace(trace, window)
    names = sorted(e["name"] for e in xs)
    assert names == ["a", "b", "each[0]", "each[1]", "each[2]", "fails"]
    lanes = {e["name"]: e["tid"] for e in xs}
    assert lanes["a"] != lanes["b"]
    span = {e["name"]: (e["ts"], e["ts"] + e["dur"]) for e in xs}
    assert all(end - start >= 0.099e6 for start, end in (span["a"], span["b"]))  # each slept 0.1 s
    assert all(span[f"each[{i}]"][0] >= max(span["a"][1], span["b"][1]) - 1e-3 for i in range(3))  # after both
    failed = next(e for e in xs if e["name"] == "fails")
    assert failed["args"]["status"] == "error" and "ValueError" in failed["args"]["error"]
    path = tmp_path / "t.json"
    r.tracer.save(path)
    assert check_chrome_trace(json.loads(path.read_text()), (time.perf_counter() - t0) * 1e6)


def test_tracer_spans_and_unfinished_spans():
    t0 = time.perf_counter()
    tr = Tracer()
    with tr.span("outer", "step", step="outer"):
        s = tr.start("inner", "llm", kind="gen")
        tr.end(s, prompt_tokens=5, tokens_computed=3, cached_tokens=2, generated_tokens=4)
    dangling = tr.start("never-ends", "step")
    xs = check_chrome_trace(tr.to_chrome(), (time.perf_counter() - t0) * 1e6)
    assert {e["name"] for e in xs} == {"outer", "inner", "never-ends"}
    assert next(e for e in xs if e["name"] == "never-ends")["args"]["unfinished"] is True
    assert tr.llm_totals == {"llm_calls": 1, "prompt_tokens": 5, "tokens_computed": 3, "cached_tokens": 2,
                             "prefix_cache_hit_tokens": 0, "generated_tokens": 4}
    tr.end(dangling)
    with pytest.raises(KeyError):
        with tr.span("boom"):
            raise KeyError("k")
    assert tr.spans[-1].args["error"].startswith("KeyError")


def test_llm_calls_are_spans_with_token_counts():
    pytest.importorskip("flowrt.engine")
    wf = fr.Workflow("llm-traced")

    @wf.step
    async def sample(llm: fr.Model) -> list[str]:
        t = llm.thread("Once upon a time, there was a little girl who loved to play in the park")
        return await fr.gather(*(b.gen(max_tokens=3, temperature=0.5, seed=i) for i, b in enumerate(t.fork(3))))

    @wf.step
    async def pick(llm: fr.Model, sample: list[str]) -> str:
        t = llm.thread("The best one is")
        return await t.select([" " + s.strip() for s in sample if s.strip()] or [" none"])

    async def main():
        async with fr.Runtime(model=MODEL, dtype="float32", num_kv_blocks=256) as rt:
            return await rt.run(wf)

    t0 = time.perf_counter()
    r = anyio.run(main)
    assert r.ok, r.errors
    xs = check_chrome_trace(r.tracer.to_chrome(), (time.perf_counter() - t0) * 1e6)
    llm = [e for e in xs if e["cat"] == "llm"]
    kinds = [e["args"]["kind"] for e in llm]
    assert kinds.count("gen") == 3 and "prefill" in kinds and "select" in kinds
    for e in llm:
        a = e["args"]
        assert a["step"] in ("sample", "pick")
        assert a["prompt_tokens"] == a["tokens_computed"] + a["cached_tokens"]
    gens = [e["args"] for e in llm if e["args"]["kind"] == "gen"]
    assert all(g["generated_tokens"] == 3 and g["cached_tokens"] > 10 for g in gens)  # shared prompt reused
    assert all(g["prefix_cache_hit_tokens"] == 0 for g in gens)  # reused through the fork, not the cache
    assert r.stats["run_llm_calls"] == len(llm)
    assert r.stats["run_generated_tokens"] == 9
    assert "prefill_tokens_computed" in r.stats and "kv_blocks_used" in r.stats  # engine stats
    counters = [e for e in r.tracer.to_chrome()["traceEvents"] if e["ph"] == "C"]
    assert counters and "used" in counters[0]["args"]
