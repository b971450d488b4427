"""Issue 34 item 4: every pending interrupt of a subgraph (``wf.step(sub)``, ``fr.subflow``, at any depth)
is pending at once in the parent, each answered by its path (``answers={path: value}``, ``--answer
PATH=VALUE``, the HTTP body); a partial set of answers lets the answered steps continue and keeps the others
pending."""

from __future__ import annotations

import json
import textwrap

import anyio
import httpx
import pytest

import flowrt as fr
from flowrt.checkpoint import CheckpointError
from flowrt.cli.commands import EXIT_INTERRUPTED, main
from support import load_workflow_source

FILE = textwrap.dedent('''
    import flowrt as fr

    CALLS = []

    review = fr.Workflow("review")

    @review.step
    async def legal(doc: str) -> str:
        CALLS.append("legal")
        return f"legal: {await fr.interrupt({'ask': 'legal ok?', 'doc': doc})}"

    @review.step
    async def tech(doc: str) -> str:
        CALLS.append("tech")
        return f"tech: {await fr.interrupt({'ask': 'tech ok?', 'doc': doc})}"

    @review.step
    def verdict(legal: str, tech: str) -> str:
        return f"{legal}; {tech}"

    wf = fr.Workflow("docs")

    @wf.step
    def doc(name: str) -> str:
        CALLS.append("doc")
        return name.upper()

    wf.step(review, name="rev")

    @wf.step
    async def second(doc: str) -> str:     # the same subgraph again, through fr.subflow, one level deeper
        return await fr.subflow(_outer, doc=doc)

    _outer = fr.Workflow("outer")   # private: the file's one workflow is wf

    @_outer.step
    async def inner(doc: str) -> str:
        return await fr.subflow(review, doc=doc + "2")

    @wf.step
    def report(rev: str, second: str) -> str:
        return f"{rev} | {second}"
''')

PATHS = ["rev/legal", "rev/tech", "second/outer/inner/review/legal", "second/outer/inner/review/tech"]


def load(tmp_path):
    return load_workflow_source(tmp_path, "docs.py", FILE, "doc")


def test_every_interrupt_of_a_subgraph_is_pending_and_answered_by_path(tmp_path):
    _, wf, calls = load(tmp_path)

    async def go() -> list:
        async with fr.Runtime(checkpoint=str(tmp_path / "runs.db")) as rt:
            events = [e async for e in rt.stream(wf, name="d")]
            r1 = events[-1].result
            with pytest.raises(CheckpointError, match="waits for 4 answers"):
                await rt.resume(r1.run_id, answer="yes", workflow=wf)
            with pytest.raises(CheckpointError, match="no pending interrupt at 'rev'"):
                await rt.resume(r1.run_id, answers={"rev": 1}, workflow=wf)
            r2 = await rt.resume(r1.run_id, answers={"rev/tech": "fine", PATHS[2]: "ok2"}, workflow=wf)
            r3 = await rt.resume(r1.run_id, answers={"rev/legal": "signed", PATHS[3]: "fine2"}, workflow=wf)
            return [events, r1, r2, r3]

    events, r1, r2, r3 = anyio.run(go)
    assert r1.status == "interrupted" and sorted(i["step"] for i in r1.interrupts) == PATHS
    assert {i["step"]: i["payload"]["doc"] for i in r1.interrupts} == dict(zip(PATHS, ["D", "D", "D2", "D2"]))
    assert sorted(e.step for e in events if e.type == "interrupted") == PATHS
    assert r2.status == "interrupted" and sorted(i["step"] for i in r2.interrupts) == ["rev/legal", PATHS[3]]
    assert r3.status == "done", r3.errors
    assert r3.outputs["report"] == "legal: signed; tech: fine | legal: ok2; tech: fine2"
    # each resume re-ran the waiting steps only: the answered ones once more, the others again
    assert calls.count("doc") == 1 and calls.count("legal") == calls.count("tech") == 2 + 2 + 1


def test_cli_answers_each_interrupt_of_a_subgraph_by_path(tmp_path, capsys):
    f, _, _ = load(tmp_path)
    db = str(tmp_path / "runs.db")
    assert main(["run", f, "--input", "name=d", "--checkpoint", db, "--no-progress"]) == EXIT_INTERRUPTED
    err = capsys.readouterr().err
    run_id = err.split("flowrt run: run ")[1].split(";")[0].split()[0]
    assert "waiting for 4 answers" in err and all(f"--answer '{p}=...'" in err for p in PATHS)
    code = main(["resume", run_id, "--checkpoint", db, "--answer", "rev/legal=ok", "--answer", "rev/tech=fine",
                 "--json", "--no-progress"])
    out = json.loads(capsys.readouterr().out)
    assert code == EXIT_INTERRUPTED and sorted(i["step"] for i in out["interrupts"]) == PATHS[2:]
    assert out["outputs"]["rev"] == "legal: ok; tech: fine"
    code = main(["resume", run_id, "--checkpoint", db, "--answer", f"{PATHS[2]}=a", "--answer", f"{PATHS[3]}=b",
                 "--json", "--no-progress"])
    assert code == 0 and json.loads(capsys.readouterr().out)["outputs"]["report"] == \
        "legal: ok; tech: fine | legal: a; tech: b"


def test_http_answers_each_interrupt_of_a_subgraph_by_path(tmp_path):
    from support import STORIES, serve_model

    from flowrt.server.workflows import load_workflows

    f, _, _ = load(tmp_path)
    for srv in serve_model(str(STORIES), {"num_kv_blocks": 32}, workflows=load_workflows([f])):
        url = srv.url + "/v1/workflows/docs/runs"
        body = httpx.post(url, json={"inputs": {"name": "d"}}, timeout=60).json()
        assert body["status"] == "interrupted" and sorted(i["step"] for i in body["interrupts"]) == PATHS
        r = httpx.post(f"{url}/{body['run_id']}/resume", json={"answers": dict(zip(PATHS, "abcd"))}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["outputs"]["report"] == "legal: a; tech: b | legal: c; tech: d"
