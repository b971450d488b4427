"""A checkpointed run's LLM calls and thread forks, saved with its state for the run viewer
(flowrt.runner.activity), on stories260K."""

import anyio

import flowrt as fr
from flowrt.checkpoint.fork import fork_state
from flowrt.render import clip

wf = fr.Workflow("activity")


@wf.step
async def draft(start: str, llm: fr.Model) -> str:
    return await llm.thread(start).gen(max_tokens=5, temperature=0)


@wf.step
async def branches(draft: str, llm: fr.Model) -> list[str]:
    t = llm.thread("Once upon a time " + draft)
    return await fr.gather(*(b.gen(max_tokens=4, temperature=0.8, seed=i) for i, b in enumerate(t.fork(3))))


@wf.step
async def ask(branches: list[str]) -> str:
    return await fr.interrupt({"pick": branches})


def test_calls_and_forks_are_saved_and_kept_across_a_resume(engine, tmp_path):
    async def go():
        rt = fr.Runtime(model=engine, checkpoint=str(tmp_path / "runs.db"))
        first = await rt.run(wf, start="Lily")
        state = rt.checkpointer.get_run(first.run_id).state
        await rt.resume(first.run_id, answer="b")
        return first, state, rt.checkpointer.get_run(first.run_id).state

    first, state, after = anyio.run(go)
    assert first.status == "interrupted"
    calls = state["llm_calls"]
    (d,) = calls["draft"]
    assert d["kind"] == "gen" and d["prompt"].endswith("Lily") and d["generated_tokens"] == 5
    assert d["output"] == first.outputs["draft"] and d["seconds"] > 0 and d["prompt_tokens"] >= 2
    gens = [c for c in calls["branches"] if c["kind"] == "gen"]
    assert len(gens) == 3 and all(c["cached_tokens"] > 0 for c in gens)   # the forks reuse the shared prefix
    (f,) = state["forks"]
    assert f["step"] == "branches" and len(f["children"]) == 3 and f["tokens"] > 0
    assert sorted(c["thread_id"] for c in gens) == sorted(f["children"])
    assert state["llm_totals"]["llm_calls"] == len(calls["draft"]) + len(calls["branches"])
    assert state["block_size"] > 0
    # the resume (ask runs again, no LLM call) keeps what the first execution recorded
    assert after["llm_calls"] == calls and after["forks"] == state["forks"]
    assert after["llm_totals"] == state["llm_totals"]
    # a fork at branches keeps draft's calls only, and counts those
    forked = fork_state(after, wf, "branches")
    assert set(forked["llm_calls"]) == {"draft"} and forked["forks"] == [] and forked["llm_totals"] is None


def test_clip_keeps_head_and_tail():
    assert clip("short") == "short"
    text = "A" * 3000 + "B" * 3000
    out = clip(text, 400)
    assert out.startswith("A" * 100) and out.endswith("B" * 300) and "5600 characters left out" in out


def test_a_later_execution_numbers_its_threads_after_the_earlier_ones():
    from flowrt.runner.activity import RunActivity
    from flowrt.runner.trace import Tracer

    before = {"llm_calls": {"a": [{"step": "a", "thread_id": 3, "prompt_tokens": 4}]},
              "forks": [{"step": "a", "parent": 3, "children": [4, 5], "tokens": 2}]}
    t = Tracer()
    t.end(t.start("gen", "llm", kind="gen", step="b", thread_id=1, prompt_tokens=7))
    t.fork("b", 1, [2], 7)   # a fresh process counts threads from 1 again
    state = RunActivity(t, before).state()
    assert [c["thread_id"] for c in state["llm_calls"]["b"]] == [6]
    assert state["forks"][1] == {"step": "b", "parent": 6, "children": [7], "tokens": 7}
    assert state["llm_calls"]["a"] == before["llm_calls"]["a"]
    assert state["llm_totals"]["llm_calls"] == 2 and state["llm_totals"]["prompt_tokens"] == 11


def test_prompt_text_is_decoded_only_when_asked(engine):
    from flowrt.context import current_tracer
    from flowrt.runner.trace import Tracer

    tracer = Tracer()

    async def go():
        token = current_tracer.set(tracer)
        try:
            return await fr.Model(engine).thread("Lily").gen(max_tokens=2, temperature=0)
        finally:
            current_tracer.reset(token)

    out = anyio.run(go)
    (s,) = tracer.llm_spans()
    assert "prompt" not in s.args and s.args["output"] == out   # nothing decoded on the call's path
    assert s.prompt_text().endswith("Lily")
    assert "Lily" not in str(tracer.to_chrome())                 # nor exported with the trace
