"""Several pending interrupts in one run (parallel branches): each is answered by its step, in Python
(``answers={step: value}``), from the CLI (``--answer STEP=VALUE``) and over HTTP (``{"answers": {...}}``)."""

from __future__ import annotations

import textwrap

import anyio
import httpx
import pytest

import flowrt as fr
from flowrt.checkpoint import CheckpointError

FILE = textwrap.dedent('''
    import flowrt as fr

    wf = fr.Workflow("two-reviews")

    @wf.step
    async def legal(doc: str) -> str:
        return f"legal: {await fr.interrupt({'ask': 'legal ok?', 'doc': doc})}"

    @wf.step
    async def tech(doc: str) -> str:
        return f"tech: {await fr.interrupt({'ask': 'tech ok?', 'doc': doc})}"

    @wf.step
    def verdict(legal: str, tech: str) -> str:
        return f"{legal}; {tech}"
''')


def _wf(tmp_path):
    from flowrt.graph.loader import load_workflow

    f = tmp_path / "reviews.py"
    f.write_text(FILE)
    return f, load_workflow(f)


def test_parallel_interrupts_are_answered_by_step(tmp_path):
    _, wf = _wf(tmp_path)

    async def go() -> list:
        async with fr.Runtime(checkpoint=str(tmp_path / "runs.db")) as rt:
            r1 = await rt.run(wf, doc="d")
            with pytest.raises(CheckpointError, match="waits for 2 answers .*legal, tech.*STEP=VALUE"):
                await rt.resume(r1.run_id, answer="yes", workflow=wf)
            with pytest.raises(CheckpointError, match="no pending interrupt at 'verdict'"):
                await rt.resume(r1.run_id, answers={"verdict": 1}, workflow=wf)
            r2 = await rt.resume(r1.run_id, answers={"tech": "fine"}, workflow=wf)   # one of two
            r3 = await rt.resume(r1.run_id, answers={"legal": "signed"}, workflow=wf)
            return [r1, r2, r3]

    r1, r2, r3 = anyio.run(go)
    assert r1.status == "interrupted"
    assert sorted(i["step"] for i in r1.interrupts) == ["legal", "tech"]
    assert {i["step"]: i["payload"]["ask"] for i in r1.interrupts} == {"legal": "legal ok?", "tech": "tech ok?"}
    assert r1.to_dict()["interrupts"] == r1.interrupts
    assert r2.status == "interrupted" and [i["step"] for i in r2.interrupts] == ["legal"]
    assert r2.outputs["tech"] == "tech: fine"
    assert r3.status == "done" and r3.outputs["verdict"] == "legal: signed; tech: fine"


def test_cli_answers_each_step(tmp_path, capsys):
    from flowrt.cli.commands import main

    f, _ = _wf(tmp_path)
    db = str(tmp_path / "runs.db")
    assert main(["run", str(f), "--input", "doc=d", "--checkpoint", db, "--no-progress"]) == 3
    err = capsys.readouterr().err
    run_id = err.split("run ", 1)[1].split(";", 1)[0].split()[0]
    assert "waiting for 2 answers" in err and "--answer 'legal=...' --answer 'tech=...'" in err
    assert main(["resume", run_id, "--checkpoint", db, "--answer", "ok"]) == 2
    assert "waits for 2 answers" in capsys.readouterr().err
    assert main(["resume", run_id, "--checkpoint", db, "--answer", "a", "--answer", "b"]) == 2
    assert "given twice" in capsys.readouterr().err
    code = main(["resume", run_id, "--checkpoint", db, "--answer", "legal=signed", "--answer", 'tech={"ok": 1}',
                 "--json", "--no-progress"])
    out = capsys.readouterr().out
    assert code == 0 and '"verdict": "legal: signed; tech: {\'ok\': 1}"' in out


@pytest.fixture
def server(tmp_path):
    from support import STORIES, serve_model

    from flowrt.server.workflows import load_workflows

    f, _ = _wf(tmp_path)
    yield from serve_model(str(STORIES), {"num_kv_blocks": 32}, workflows=load_workflows([str(f)]))


def test_http_resume_body_names_the_steps(server):
    url = server.url + "/v1/workflows/two-reviews/runs"
    body = httpx.post(url, json={"inputs": {"doc": "d"}}, timeout=60).json()
    assert body["status"] == "interrupted" and len(body["interrupts"]) == 2
    rid = body["run_id"]
    r = httpx.post(f"{url}/{rid}/resume", json={"answer": "x"}, timeout=60)
    assert r.status_code == 409 and "waits for 2 answers" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/{rid}/resume", json={"answer": "x", "answers": {"legal": 1}}, timeout=60)
    assert r.status_code == 400 and "not both" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/{rid}/resume", json={"answers": {"legal": "signed", "tech": "fine"}}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["outputs"]["verdict"] == "legal: signed; tech: fine"
