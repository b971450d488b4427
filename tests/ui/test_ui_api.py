"""The run viewer's pages and JSON API over HTTP (flowrt.ui), on workflows of plain Python steps (no model)."""

import asyncio
import json
import textwrap
import time

import httpx
import pytest

WORKFLOW = textwrap.dedent('''
    import flowrt as fr

    wf = fr.Workflow("review")

    @wf.step
    def draft(topic: str) -> str:
        return f"a draft about {topic}"

    @wf.step
    async def approve(draft: str) -> str:
        return await fr.interrupt({"question": "publish?", "draft": draft})

    @wf.step
    def publish(draft: str, approve: str) -> str:
        return f"{draft} ({approve})"

    @wf.step
    def broken(topic: str) -> int:
        raise ValueError(f"no {topic}")

    @wf.step
    def after_broken(broken: int) -> int:
        return broken + 1
''')


def _run(db, path, **inputs):
    import flowrt as fr
    from flowrt.graph.loader import load_workflow

    wf = load_workflow(str(path), "review")

    async def go():
        with fr.Runtime(checkpoint=str(db)) as rt:
            return await rt.run(wf, **inputs)

    return asyncio.run(go())


@pytest.fixture
def viewer(tmp_path):
    """A ``flowrt ui`` app over a store holding one run waiting for an answer; yields (client, run id, db)."""
    from flowrt.checkpoint import open_store
    from flowrt.server.background import BackgroundServer
    from flowrt.ui.api import standalone_app
    from flowrt.ui.viewer import Viewer

    path = tmp_path / "review.py"
    path.write_text(WORKFLOW)
    db = tmp_path / "runs.db"
    result = _run(db, path, topic="owls")
    assert result.status == "interrupted"
    store = open_store(str(db), create=False)
    v = Viewer(lambda: store)
    srv = BackgroundServer(standalone_app(v)).start()
    srv.viewer, srv.store = v, store
    try:
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            c.server = srv
            yield c, result.run_id, db
    finally:
        srv.stop()
        store.close()


def _wait_status(c, run_id, status, timeout=20.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        d = c.get(f"/ui/api/runs/{run_id}").json()
        if d["run"]["status"] == status:
            return d
        time.sleep(0.1)
    raise AssertionError(f"run {run_id} did not reach {status}: {d['run']}")


def test_pages_are_served(viewer):
    c, run_id, _ = viewer
    for path in ("/ui", f"/ui/runs/{run_id}"):
        r = c.get(path)
        assert r.status_code == 200 and "text/html" in r.headers["content-type"]
        assert '<script defer src="/ui/static/app.js">' in r.text
    assert "function renderGraph" in c.get("/ui/static/app.js").text
    assert c.get("/ui/static/style.css").status_code == 200
    assert c.get("/", follow_redirects=False).headers["location"] == "/ui"


def test_run_list_and_status_filter(viewer):
    c, run_id, db = viewer
    done = _run(db, db.parent / "review.py", topic="cats")   # a second run, waiting too
    data = c.get("/ui/api/runs").json()
    assert {r["run_id"] for r in data["runs"]} == {run_id, done.run_id}
    row = next(r for r in data["runs"] if r["run_id"] == run_id)
    assert row["workflow"] == "review" and row["status"] == "interrupted" and row["duration"] >= 0
    assert set(row["tokens"]) == {"llm_calls", "prompt_tokens", "cached_tokens", "generated_tokens"}
    assert data["counts"] == {"interrupted": 2}
    assert c.get("/ui/api/runs", params={"status": "done"}).json()["runs"] == []
    assert len(c.get("/ui/api/runs", params={"status": "interrupted"}).json()["runs"]) == 2


def test_run_detail_shows_step_states_results_errors_and_graph(viewer):
    c, run_id, _ = viewer
    d = c.get(f"/ui/api/runs/{run_id}").json()
    steps = {s["step"]: s for s in d["steps"]}
    assert {n: s["state"] for n, s in steps.items()} == {
        "draft": "done", "approve": "waiting", "publish": "pending", "broken": "failed", "after_broken": "skipped"}
    assert steps["draft"]["result"] == "a draft about owls"
    assert "ValueError: no owls" in steps["broken"]["error"]["message"]
    assert steps["broken"]["error"]["traceback"]
    assert d["run"]["interrupts"] == [{"step": "approve", "index": 0,
                                       "payload": {"question": "publish?", "draft": "a draft about owls"}}]
    ids = {n["id"]: n["kind"] for n in d["graph"]["nodes"]}
    assert ids == {"topic": "input", "draft": "step", "approve": "step", "publish": "step", "broken": "step",
                   "after_broken": "step"}
    assert {"source": "approve", "target": "publish", "kind": "data"} in d["graph"]["edges"]
    assert [h["step"] for h in d["history"]][:1] and all("seq" in h for h in d["history"])


def test_answer_from_the_api_finishes_the_run_and_a_second_answer_is_refused(viewer):
    c, run_id, _ = viewer
    assert c.post(f"/ui/api/runs/{run_id}/answer", json={}).status_code == 400
    r = c.post(f"/ui/api/runs/{run_id}/answer", json={"answer": "yes"})
    assert r.status_code == 202, r.text
    again = c.post(f"/ui/api/runs/{run_id}/answer", json={"answer": "no"})
    assert again.status_code == 409   # held by the first answer's resume, or finished by now
    d = _wait_status(c, run_id, "failed")   # `broken` failed: the run ends failed, with publish done
    steps = {s["step"]: s for s in d["steps"]}
    assert steps["publish"]["state"] == "done" and steps["publish"]["result"] == "a draft about owls (yes)"
    assert steps["approve"]["result"] == "yes" and steps["approve"]["answers"] == ["yes"]
    assert c.post(f"/ui/api/runs/{run_id}/answer", json={"answer": "x"}).status_code == 409


def test_event_stream_sends_the_run_until_it_ends(viewer):
    c, run_id, _ = viewer
    with c.stream("GET", f"/ui/api/runs/{run_id}/events") as s:   # an interrupted run: one state, then the end
        text = s.read().decode()
    kinds = [line[len("event: "):] for line in text.splitlines() if line.startswith("event: ")]
    assert kinds == ["run", "end"]
    first = json.loads(text.split("data: ", 1)[1].split("\n", 1)[0])
    assert first["run"]["run_id"] == run_id and first["run"]["status"] == "interrupted"


def test_event_stream_of_a_running_run_ends_when_the_viewer_stops(viewer):
    import threading

    from flowrt.checkpoint.lease import LEASE_TTL_S

    c, run_id, _ = viewer
    c.server.store.claim_run(run_id, "elsewhere:1:x", LEASE_TTL_S, waiting=True)   # running, in another process
    got: list[str] = []

    def read():
        with c.stream("GET", f"/ui/api/runs/{run_id}/events") as s:
            for line in s.iter_lines():
                got.append(line)

    t = threading.Thread(target=read)
    t.start()
    deadline = time.time() + 10
    while not any(line.startswith("data: ") for line in got):
        assert time.time() < deadline
        time.sleep(0.05)
    time.sleep(3 * 0.25)
    assert t.is_alive() and "event: end" not in got   # a running run is followed
    assert '"status": "running"' in next(line for line in got if line.startswith("data: "))
    c.server.viewer.stop_all()
    t.join(timeout=10)
    assert not t.is_alive() and "event: end" in got


def test_fork_at_a_step_makes_a_new_run(viewer):
    c, run_id, _ = viewer
    r = c.post(f"/ui/api/runs/{run_id}/fork", json={"at": "draft", "inputs": {"topic": "bats"}})
    assert r.status_code == 202, r.text
    new = r.json()["run_id"]
    assert new != run_id
    d = _wait_status(c, new, "interrupted")
    assert d["run"]["forked_from"]["run_id"] == run_id and d["run"]["inputs"] == {"topic": "bats"}
    assert next(s for s in d["steps"] if s["step"] == "draft")["result"] == "a draft about bats"
    assert c.post(f"/ui/api/runs/{run_id}/fork", json={"at": "nope"}).status_code == 404
    assert c.post(f"/ui/api/runs/{run_id}/fork", json={"at": "draft", "inputs": {"x": 1}}).status_code == 400
    from flowrt.checkpoint.lease import LEASE_TTL_S

    c.server.store.claim_run(run_id, "elsewhere:1:x", LEASE_TTL_S, waiting=True)   # running now, elsewhere
    busy = c.post(f"/ui/api/runs/{run_id}/fork", json={"at": "draft"})
    assert busy.status_code == 409 and "elsewhere:1:x" in busy.json()["detail"]


def test_unknown_run_is_404(viewer):
    c, _, _ = viewer
    assert c.get("/ui/api/runs/nope").status_code == 404
    assert c.get("/ui/api/runs/nope/events").status_code == 404
    assert c.post("/ui/api/runs/nope/answer", json={"answer": 1}).status_code == 404


def test_api_key_guards_the_json_api_not_the_page(tmp_path):
    from flowrt.checkpoint import open_store
    from flowrt.server.background import BackgroundServer
    from flowrt.ui.api import standalone_app
    from flowrt.ui.viewer import Viewer

    store = open_store(str(tmp_path / "runs.db"))
    srv = BackgroundServer(standalone_app(Viewer(lambda: store, api_key="sesame"))).start()
    try:
        with httpx.Client(base_url=srv.url) as c:
            assert c.get("/ui").status_code == 200
            assert c.get("/ui/api/runs").status_code == 401
            assert c.get("/ui/api/runs", headers={"Authorization": "Bearer wrong"}).status_code == 401
            ok = c.get("/ui/api/runs", headers={"Authorization": "Bearer sesame"})
            assert ok.status_code == 200 and ok.json() == {"runs": [], "counts": {}}
    finally:
        srv.stop()
        store.close()


def test_flowrt_ui_refuses_a_missing_database(tmp_path, capsys):
    import argparse

    from flowrt.ui.cli import run   # (the whole command line loads the engine for its options: the browser test)

    args = argparse.Namespace(checkpoint=str(tmp_path / "none.db"), host="127.0.0.1", port=0, api_key=None,
                              index=None, log_level="warning", model=None)
    assert run(args) == 2
    assert "flowrt ui: error:" in capsys.readouterr().err
    assert not (tmp_path / "none.db").exists()   # never creates one
