"""A resume loads the model only when what is left needs it: the steps that run again use it, or a kept
result holds a thread. A loop route back to a model step loads it when that step starts."""

from __future__ import annotations

import json
import textwrap

import anyio
import pytest

import flowrt as fr
from flowrt.checkpoint.needs import resources_to_continue
from flowrt.cli.commands import EXIT_INTERRUPTED, main
from flowrt.graph.loader import load_workflow

REVIEW = textwrap.dedent('''
    import flowrt as fr

    wf = fr.Workflow("review")


    @wf.step
    async def draft(start: str, llm: fr.Model, review: str | None = None) -> str:
        prompt = start + (review or "")
        return prompt + await llm.generate(prompt, max_tokens=6, temperature=0)


    @wf.step(routes=["draft", "publish"])
    async def review(draft: str) -> fr.Goto:
        verdict = await fr.interrupt({"draft": draft})
        if verdict == "again" and "Again," not in draft:   # once: a resumed step's answer is given again
            return fr.goto("draft", " Again,")
        return fr.goto("publish", draft)


    @wf.step
    def publish(review: str) -> str:
        return f"published: {review}"
''')


def _interrupted_run(tmp_path, capsys, stories_path) -> tuple[str, str, str]:
    f = tmp_path / "review.py"
    f.write_text(REVIEW)
    db = str(tmp_path / "runs.db")
    code = main(["run", str(f), "--input", "start=Once upon a time", "--checkpoint", db, "--model", stories_path,
                 "--dtype", "float32", "--num-kv-blocks", "64", "--no-progress"])
    out, err = capsys.readouterr()
    assert code == EXIT_INTERRUPTED, err
    return str(f), db, err.split("flowrt run: run ")[1].split(";")[0]


def test_resume_whose_steps_need_no_model_never_loads_it(tmp_path, capsys, stories_path):
    _, db, run_id = _interrupted_run(tmp_path, capsys, stories_path)
    code = main(["resume", run_id, "--checkpoint", db, "--answer", "yes", "--model", str(tmp_path / "no-model"),
                 "--json", "--no-progress"])
    out, err = capsys.readouterr()
    assert code == 0, err   # loading the missing model would be exit 2, "cannot start the engine"
    assert json.loads(out)["outputs"]["publish"].startswith("published: ")
    assert "flowrt engine:" not in err   # the engine's start-up line


def test_resume_that_loops_back_to_a_model_step_loads_it_then(tmp_path, capsys, stories_path):
    f, db, run_id = _interrupted_run(tmp_path, capsys, stories_path)
    wf = load_workflow(f)

    async def go() -> tuple[fr.RunResult, bool]:
        async with fr.Runtime(model=stories_path, checkpoint=db, dtype="float32", num_kv_blocks=64) as rt:
            result = await rt.resume(run_id, answer="again", workflow=wf)   # review, draft again, ...
            return result, rt.llm is not None

    result, loaded = anyio.run(go)
    assert result.ok, {k: e.traceback for k, e in result.errors.items()}
    assert result.visits == {"draft": 2, "review": 2} and loaded
    assert result.output.startswith("published: Once upon a time Again,")
    assert result.stats["engine"]   # the engine's counters, once it was loaded


def _wf() -> fr.Workflow:
    wf = fr.Workflow("needs")

    @wf.step
    async def gen(llm: fr.Model) -> str:
        return ""

    @wf.step
    def keep(gen: str) -> str:
        return gen

    return wf


@pytest.mark.parametrize("state,needed", [
    (None, ["llm"]),   # a new run: everything
    ({"status": {"gen": "done", "keep": "pending"}, "outputs": {"gen": {"json": "x"}}}, []),
    ({"status": {"gen": "running"}, "outputs": {}}, ["llm"]),
    ({"status": {"gen": "done", "keep": "pending"}, "outputs": {"gen": {"placeholder": "x"}}}, ["llm"]),
    ({"status": {"gen": "done", "keep": "pending"},
      "outputs": {"gen": {"json": {"t": [{"__flowrt__": "thread", "token_ids": [1], "text": "a"}]}}}}, ["llm"]),
])
def test_resources_to_continue(state, needed):
    assert resources_to_continue(_wf(), state) == needed
