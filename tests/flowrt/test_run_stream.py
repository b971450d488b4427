"""Run events: rt.stream yields step events and every thread's tokens (tagged with step, thread id and fork
index) in order, each token once; `flowrt run --stream` prints them live."""

from __future__ import annotations

import anyio
import pytest

import flowrt as fr
from flowrt import events as ev


@pytest.fixture(scope="module")
def engine(stories_path):
    from flowrt.engine import AsyncLLM

    eng = AsyncLLM(model=stories_path, dtype="float32", seed=0, num_kv_blocks=512)
    yield eng
    eng.shutdown()


def forking_workflow() -> fr.Workflow:
    wf = fr.Workflow("forks")

    @wf.step
    async def branches(start: str, llm: fr.Model) -> list[dict]:
        t = llm.thread(start)
        kids = t.fork(3)
        prompts = [" The cat", " The dog", " The bird"]
        for k, p in zip(kids, prompts):
            k += p
        texts = await fr.gather(*(k.gen(max_tokens=10 + 3 * i, temperature=0) for i, k in enumerate(kids)))
        return [{"thread": k.id, "fork": k.fork_index, "text": text, "ids": list(k.last_output.outputs[0].token_ids)}
                for k, text in zip(kids, texts)]

    @wf.step(routes=["summary"])
    def route(branches: list[dict]) -> fr.Goto:
        return fr.goto("summary", [b["text"] for b in branches])

    @wf.step
    async def summary(route: list[str], llm: fr.Model) -> dict:
        with llm.thread("Once upon a time" + route[0]) as t:
            text = await t.gen(max_tokens=8, temperature=0)
            return {"thread": t.id, "fork": t.fork_index, "text": text,
                    "ids": list(t.last_output.outputs[0].token_ids)}

    return wf


def test_stream_events_order_and_every_token_once(engine):
    wf = forking_workflow()

    async def go() -> tuple[list, fr.RunResult]:
        async with fr.Runtime(engine) as rt:
            plain = await rt.run(wf, start="Once upon a time")
            events = [e async for e in rt.stream(wf, start="Once upon a time")]
            return events, plain

    events, plain = anyio.run(go)
    assert isinstance(events[0], ev.RunStarted) and isinstance(events[-1], ev.RunFinished)
    result = events[-1].result
    assert events[-1].status == "done"

    def strip(o: dict) -> dict:   # thread ids differ between the runs
        return {"branches": [{k: v for k, v in b.items() if k != "thread"} for b in o["branches"]],
                "route": o["route"], "summary": {k: v for k, v in o["summary"].items() if k != "thread"}}

    assert strip(result.outputs) == strip(plain.outputs)   # streaming changes nothing
    types = [type(e).__name__ for e in events]
    for step in ("branches", "route", "summary"):
        start = next(i for i, e in enumerate(events) if isinstance(e, ev.StepStarted) and e.step == step)
        end = next(i for i, e in enumerate(events) if isinstance(e, ev.StepFinished) and e.step == step)
        toks = [i for i, e in enumerate(events) if isinstance(e, ev.Token) and e.step == step]
        assert start < end and all(start < i < end for i in toks), types
    routed = [e for e in events if isinstance(e, ev.Routed)]
    assert [(r.step, r.targets) for r in routed] == [("route", ["summary"])]

    expected = {b["thread"]: b for b in result.outputs["branches"]}
    expected[result.outputs["summary"]["thread"]] = result.outputs["summary"]
    by_thread: dict[int, list[ev.Token]] = {}
    for e in events:
        if isinstance(e, ev.Token):
            by_thread.setdefault(e.thread_id, []).append(e)
    assert set(by_thread) == set(expected)
    for tid, toks in by_thread.items():
        want = expected[tid]
        assert [i for t in toks for i in t.token_ids] == want["ids"]        # every token once, in order
        assert "".join(t.text for t in toks) == want["text"]
        assert {t.fork_index for t in toks} == {want["fork"]}
    assert sorted(b["fork"] for b in result.outputs["branches"]) == [0, 1, 2]
    assert {e.step for e in events if isinstance(e, ev.Token)} == {"branches", "summary"}


def test_stream_without_tokens_and_leaving_early(engine):
    wf = forking_workflow()

    async def go() -> tuple[list, list]:
        async with fr.Runtime(engine) as rt:
            quiet = [e async for e in rt.stream(wf, start="Once upon a time", tokens=False)]
            first = []
            async for e in rt.stream(wf, start="Once upon a time"):
                first.append(e)
                if isinstance(e, ev.Token):
                    break      # the run is cancelled, its threads closed
            return quiet, first

    quiet, first = anyio.run(go)
    assert not any(isinstance(e, ev.Token) for e in quiet) and isinstance(quiet[-1], ev.RunFinished)
    assert isinstance(first[-1], ev.Token)
    assert engine.stats()["open_sequences"] == 0


def test_event_dicts_are_json():
    import json

    e = ev.Token("s", 3, 1, "hi", [5, 6])
    assert json.loads(json.dumps(e.to_dict())) == {"type": "token", "step": "s", "thread_id": 3, "fork_index": 1,
                                                    "text": "hi", "token_ids": [5, 6]}


def test_cli_stream_prints_tokens_live(tmp_path, capsys, stories_path):
    from flowrt.cli.commands import main

    f = tmp_path / "story.py"
    f.write_text("import flowrt as fr\nwf = fr.Workflow('story')\n"
                 "@wf.step\nasync def tell(start: str, llm: fr.Model) -> str:\n"
                 "    return await llm.generate(start, max_tokens=12, temperature=0)\n")
    code = main(["run", str(f), "--input", "start=Once upon a time", "--model", stories_path, "--dtype", "float32",
                 "--stream", "--no-progress"])
    out, err = capsys.readouterr()
    assert code == 0, err
    streamed = out.split("] ", 1)[1].split("\n")[0]
    assert out.startswith("\n[tell #") and streamed and f"tell (result): {streamed}" in out
    assert "-- tell started" in err and "-- tell finished" in err
    assert main(["run", str(f), "--stream", "--json"]) == 2
