"""Human in the loop: fr.interrupt pauses a run (checkpointed), resume continues it with an answer, in
Python, through the CLI (exit code 3, `flowrt resume --answer`) and over HTTP (`.../resume`)."""

from __future__ import annotations

import json

import anyio
import httpx
import pytest

import flowrt as fr
from flowrt.checkpoint import CheckpointError
from flowrt.cli.commands import EXIT_INTERRUPTED, main


def approval_workflow(calls: list[str]) -> fr.Workflow:
    wf = fr.Workflow("approve")

    @wf.step
    def draft(topic: str) -> str:
        calls.append("draft")
        return f"a post about {topic}"

    @wf.step
    async def review(draft: str) -> dict:
        calls.append("review:before")            # runs again on resume (the step restarts)
        verdict = await fr.interrupt({"draft": draft, "question": "publish?"})
        calls.append("review:after")
        title = await fr.interrupt("title?") if verdict == "yes" else None
        return {"verdict": verdict, "title": title}

    @wf.step
    def publish(review: dict, draft: str) -> str:
        calls.append("publish")
        return f"{review['title']}: {draft}" if review["verdict"] == "yes" else "dropped"

    return wf


def test_interrupt_pauses_and_each_resume_answers_the_next_call(tmp_path):
    calls: list[str] = []
    wf = approval_workflow(calls)

    async def go() -> list:
        async with fr.Runtime(checkpoint=str(tmp_path / "runs.db")) as rt:
            r1 = await rt.run(wf, topic="KV caches")
            r2 = await rt.resume(r1.run_id, answer="yes", workflow=wf)
            r3 = await rt.resume(r1.run_id, answer="Blocks", workflow=wf)
            with pytest.raises(CheckpointError, match="already finished"):
                await rt.resume(r1.run_id, answer="again", workflow=wf)
            return [r1, r2, r3]

    r1, r2, r3 = anyio.run(go)
    assert r1.status == "interrupted" and r1.interrupt["payload"] == {"draft": "a post about KV caches",
                                                                       "question": "publish?"}
    assert r1.outputs == {"draft": "a post about KV caches"} and r1.run_id
    assert r1.to_dict()["status"] == "interrupted" and r1.to_dict()["run_id"] == r1.run_id
    assert r2.status == "interrupted" and r2.interrupt["payload"] == "title?" and r2.run_id == r1.run_id
    assert r3.status == "done" and r3.outputs["publish"] == "Blocks: a post about KV caches"
    # draft ran once; review restarted from its beginning on every resume
    assert calls == ["draft", "review:before", "review:before", "review:after", "review:before", "review:after",
                     "publish"]


def test_interrupt_without_a_checkpointer_is_a_clear_error():
    r = approval_workflow([]).run(topic="x")
    assert r.status == "failed"
    assert "needs a checkpointer" in r.errors["review"].message and "--checkpoint" in r.errors["review"].message


def test_answer_to_a_run_not_waiting_is_refused(tmp_path):
    wf = fr.Workflow("plain")

    @wf.step
    def a() -> int:
        raise RuntimeError("boom")

    async def go() -> None:
        async with fr.Runtime(checkpoint=str(tmp_path / "runs.db")) as rt:
            r = await rt.run(wf)
            with pytest.raises(CheckpointError, match="not waiting for an answer"):
                await rt.resume(r.run_id, answer="x", workflow=wf)

    anyio.run(go)


FILE = '''
import flowrt as fr

wf = fr.Workflow("story-review")


@wf.step
async def draft(start: str, llm: fr.Model) -> str:
    return await llm.generate(start, max_tokens=12, temperature=0)


@wf.step
async def review(draft: str) -> str:
    answer = await fr.interrupt({"draft": draft, "question": "keep it?"})
    return f"{answer}: {draft}"
'''


def test_cli_interrupt_exit_code_payload_and_resume(tmp_path, capsys, stories_path):
    f = tmp_path / "review.py"
    f.write_text(FILE)
    db = str(tmp_path / "runs.db")
    args = ["--model", stories_path, "--dtype", "float32", "--no-progress"]
    code = main(["run", str(f), "--input", "start=Once upon a time", "--checkpoint", db, *args])
    out, err = capsys.readouterr()
    assert code == EXIT_INTERRUPTED == 3
    payload = json.loads(out[out.index("{\n"):])
    assert payload["question"] == "keep it?" and payload["draft"]
    run_id = err.split("flowrt run: run ")[1].split(";")[0]
    assert f"flowrt resume {run_id} --checkpoint {db} --answer" in err

    assert main(["runs", "list", "--checkpoint", db]) == 0
    assert f"{run_id}  interrupted" in capsys.readouterr().out

    code = main(["resume", run_id, "--checkpoint", db, "--answer", "kept", "--json", "--no-progress"])
    out, err = capsys.readouterr()
    assert code == 0, err
    body = json.loads(out)
    assert body["outputs"]["review"] == f"kept: {payload['draft']}"
    assert main(["resume", run_id, "--checkpoint", db, "--answer", "again"]) == 2
    assert "already finished" in capsys.readouterr().err


@pytest.fixture(scope="module")
def server(tmp_path_factory, stories_path):
    from support import serve_model

    f = tmp_path_factory.mktemp("wf") / "review.py"
    f.write_text(FILE)
    from flowrt.server.workflows import load_workflows

    yield from serve_model(stories_path, {"num_kv_blocks": 256}, workflows=load_workflows([str(f)]))


def test_http_interrupt_and_resume(server):
    url = server.url + "/v1/workflows/story-review/runs"
    r = httpx.post(url, json={"inputs": {"start": "Once upon a time"}}, timeout=120)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["status"] == "interrupted" and body["run_id"]
    assert body["interrupt"]["payload"]["question"] == "keep it?"
    assert r.headers["x-flowrt-run-id"] == body["run_id"]
    draft = body["outputs"]["draft"]
    rid = body["run_id"]

    r = httpx.post(f"{url}/{rid}/resume", json={"answer": "kept"}, timeout=120)
    assert r.status_code == 200, r.text
    done = r.json()
    assert done["outputs"] == {"draft": draft, "review": f"kept: {draft}"} and done["errors"] == {}

    # in memory, a finished run is forgotten: resuming it again is an unknown run
    r = httpx.post(f"{url}/{rid}/resume", json={"answer": "again"}, timeout=60)
    assert r.status_code == 404 and rid in r.json()["error"]["message"]
    r = httpx.post(f"{url}/nope/resume", json={"answer": "x"}, timeout=60)
    assert r.status_code == 404


def test_http_resume_of_a_run_not_waiting_is_409(tmp_path, stories_path):
    from support import serve_model

    from flowrt.server.workflows import load_workflows

    f = tmp_path / "review.py"
    f.write_text(FILE)
    wfs = load_workflows([str(f)])
    gen = serve_model(stories_path, {"num_kv_blocks": 128}, workflows=wfs)
    srv = next(gen)
    try:
        rt = fr.Runtime(srv.engine, checkpoint=str(tmp_path / "runs.db"))
        srv.app.state.flowrt.workflow_runtime = rt
        url = srv.url + "/v1/workflows/story-review/runs"
        rid = httpx.post(url, json={"inputs": {"start": "Once"}}, timeout=120).json()["run_id"]
        assert httpx.post(f"{url}/{rid}/resume", json={"answer": "a"}, timeout=120).status_code == 200
        r = httpx.post(f"{url}/{rid}/resume", json={"answer": "b"}, timeout=60)
        assert r.status_code == 409 and "not waiting" in r.json()["error"]["message"]
    finally:
        gen.close()


def test_http_interrupt_streamed(server):
    url = server.url + "/v1/workflows/story-review/runs"
    with httpx.stream("POST", url, json={"inputs": {"start": "Once"}, "stream": True, "stream_tokens": True},
                      timeout=120) as r:
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    events = [json.loads(ln[6:]) for ln in lines if ln != "data: [DONE]"]
    kinds = [e.get("type") for e in events]
    assert "interrupt" in kinds and "token" in kinds
    final = events[-1]
    assert final["type"] == "result" and final["status"] == "interrupted"
    rid = final["run_id"]
    with httpx.stream("POST", f"{url}/{rid}/resume", json={"answer": "ok", "stream": True}, timeout=120) as r:
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    final = json.loads(lines[-2][6:])
    assert final["type"] == "result" and final["outputs"]["review"].startswith("ok: ")
