"""Issue 34 item 3, over HTTP: ``GET /v1/workflows/{name}/runs/{id}/history`` and ``POST .../runs/{id}/fork``
(``at``, ``inputs``), behind the API key, with the CLI's refusals (an unknown step: 404 naming it; a run
that is running now: 409), on plain Python steps (no model); and item 5's step cache in the step events."""

from __future__ import annotations

import json

import httpx
import pytest

import flowrt as fr
from flowrt.checkpoint.lease import new_holder
from flowrt.cli.commands import main

KEY = "sekret"
AUTH = {"Authorization": f"Bearer {KEY}"}
CALLS: list[str] = []


class _NoEngine:
    """The server's engine, for workflows of plain Python steps."""

    def stats(self) -> dict:
        return {}


def _workflow() -> fr.Workflow:
    inner = fr.Workflow("inner")

    @inner.step
    def a(x: int) -> int:
        CALLS.append("a")
        return x + 1

    @inner.step
    def b(a: int, k: int = 1) -> int:
        CALLS.append("b")
        return a * k

    top = fr.Workflow("top")

    @top.step
    def x(n: int) -> int:
        CALLS.append("x")
        return n

    top.step(inner, name="outer")

    @top.step
    def report(outer: int) -> str:
        CALLS.append("report")
        return f"got {outer}"

    other = fr.Workflow("other")

    @other.step(cache=fr.Cache())
    def y(n: int) -> int:
        return n

    return top, other


@pytest.fixture
def server(tmp_path):
    from flowrt.server.app import create_app
    from flowrt.server.background import BackgroundServer

    top, other = _workflow()
    rt = fr.Runtime(checkpoint=str(tmp_path / "runs.db"))   # no model
    srv = BackgroundServer(create_app(_NoEngine(), api_key=KEY, workflows={"top": top, "other": other},
                                      workflow_runtime=rt)).start()
    srv.db, srv.store = str(tmp_path / "runs.db"), rt.checkpointer
    CALLS.clear()
    try:
        yield srv
    finally:
        srv.stop()


def _run(srv, n: int = 2) -> str:
    r = httpx.post(srv.url + "/v1/workflows/top/runs", json={"inputs": {"n": n}}, headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["outputs"]["report"] == f"got {n + 1}"
    return r.headers["X-Flowrt-Run-Id"]


def test_history_lists_the_runs_checkpoints_as_the_cli_does(server):
    rid = _run(server)
    url = f"{server.url}/v1/workflows/top/runs/{rid}/history"
    assert httpx.get(url, timeout=30).status_code == 401   # behind the API key, as every /v1 route
    r = httpx.get(url, headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["run_id"] == rid
    assert body["data"] == server.store.history(rid)   # what `flowrt runs history --json` prints
    assert [h["step"] for h in body["data"]] == ["x", "outer/a", "outer/b", "outer", "report", None]   # None: the end
    assert body["data"][-2]["result"] == {"json": "got 3"}


def test_fork_inside_a_subgraph_reruns_the_step_and_its_downstream_only(server):
    rid = _run(server)
    CALLS.clear()
    url = f"{server.url}/v1/workflows/top/runs/{rid}/fork"
    assert httpx.post(url, json={"at": "outer/b"}, timeout=30).status_code == 401
    r = httpx.post(url, json={"at": "outer/b", "inputs": {"k": 5}}, headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["outputs"] == {"x": 2, "outer": 15, "report": "got 15"}
    assert CALLS == ["b", "report"]   # x and outer/a keep their results
    new = r.headers["X-Flowrt-Run-Id"]
    assert new != rid and server.store.get_run(new).meta["forked_from"]["run_id"] == rid
    assert server.store.get_run(rid).inputs == {"n": 2}   # the source is unchanged


def test_fork_streams_like_a_run(server):
    rid = _run(server)
    with httpx.stream("POST", f"{server.url}/v1/workflows/top/runs/{rid}/fork", headers=AUTH, timeout=30,
                      json={"at": "report", "stream": True}) as r:
        assert r.status_code == 200
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]" and '"report":"got 3"' in lines[-2]


def test_fork_refusals_are_the_clis(server, capsys, tmp_path):
    rid = _run(server)
    fork = f"{server.url}/v1/workflows/top/runs/{rid}/fork"

    def post(url: str, body: dict) -> httpx.Response:
        return httpx.post(url, json=body, headers=AUTH, timeout=30)

    r = post(fork, {"at": "nope"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "at"
    assert "workflow 'top' has no step 'nope' to fork at" in r.json()["error"]["message"]
    r = post(fork, {"at": "outer/zz"})
    assert r.status_code == 404 and "workflow 'inner' has no step 'zz'" in r.json()["error"]["message"]
    r = post(fork, {"at": "x/a"})
    assert r.status_code == 400 and "step 'x' of workflow 'top' runs no subgraph" in r.json()["error"]["message"]
    r = post(fork, {"at": "x", "inputs": {"bogus": 1}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "inputs"
    assert post(f"{server.url}/v1/workflows/top/runs/nosuchrun/fork", {"at": "x"}).status_code == 404
    assert httpx.get(f"{server.url}/v1/workflows/top/runs/nosuchrun/history", headers=AUTH).status_code == 404
    assert post(f"{server.url}/v1/workflows/other/runs/{rid}/fork", {"at": "y"}).status_code == 404
    assert post(f"{server.url}/v1/workflows/nope/runs/{rid}/fork", {"at": "x"}).status_code == 404
    assert len(server.store.list_runs()) == 1   # no refused fork left a run behind

    # a run that is running now (held by a live process: this one) is refused, over HTTP and by the CLI
    server.store.create_run("busy1", "top", {"n": 1}, holder=new_holder(), ttl=60)
    r = post(f"{server.url}/v1/workflows/top/runs/busy1/fork", {"at": "x"})
    assert r.status_code == 409 and "run busy1 is held by" in r.json()["error"]["message"]
    f = tmp_path / "top.py"
    f.write_text("import flowrt as fr\nwf = fr.Workflow('top')\n\n@wf.step\ndef x(n: int) -> int:\n    return n\n")
    capsys.readouterr()
    assert main(["runs", "fork", "busy1", "--at", "x", "--file", str(f), "--checkpoint", server.db]) == 2
    assert "run busy1 is held by" in capsys.readouterr().err


def test_step_events_mark_a_result_from_the_step_cache(server):
    def stream() -> list[dict]:
        with httpx.stream("POST", f"{server.url}/v1/workflows/other/runs", headers=AUTH, timeout=30,
                          json={"inputs": {"n": 7}, "stream": True}) as r:
            lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        return [json.loads(d) for d in lines[:-1] if json.loads(d)["type"] == "step" and
                json.loads(d)["status"] == "done"]

    assert [e.get("cached") for e in stream()] == [None]
    (done,) = stream()
    assert done["step"] == "y" and done["cached"] is True
