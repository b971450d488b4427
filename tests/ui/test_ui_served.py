"""The run viewer under ``flowrt serve``: /ui over the served workflows' runs, its API behind the server's key, and an
answer from the viewer taking the same claim as the HTTP resume (stories260K as the engine; plain Python steps)."""

import time

import httpx
import pytest

from support import STORIES, serve_model
from test_ui_api import WORKFLOW

KEY = {"Authorization": "Bearer sesame"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from flowrt.server.workflows import load_workflows

    d = tmp_path_factory.mktemp("wf")
    (d / "review.py").write_text(WORKFLOW)
    for srv in serve_model(STORIES, served_model_name="stories260K", workflows=load_workflows([str(d / "review.py")]),
                           api_key="sesame"):
        yield srv


def _start(c) -> str:
    r = c.post("/v1/workflows/review/runs", json={"inputs": {"topic": "owls"}}, headers=KEY)
    assert r.status_code == 200 and r.json()["status"] == "interrupted", r.text
    return r.json()["run_id"]


def test_pages_open_and_the_api_needs_the_key(server):
    with httpx.Client(base_url=server.url) as c:
        assert c.get("/ui").status_code == 200
        assert c.get("/ui/static/app.js").status_code == 200
        run_id = _start(c)
        assert c.get("/ui/api/runs").status_code == 401
        assert c.get(f"/ui/api/runs/{run_id}").status_code == 401
        runs = c.get("/ui/api/runs", headers=KEY).json()["runs"]
        assert run_id in [r["run_id"] for r in runs]
        d = c.get(f"/ui/api/runs/{run_id}", headers=KEY).json()
        assert d["graph"] is not None   # the served workflow draws its graph
        assert {s["step"]: s["state"] for s in d["steps"]}["approve"] == "waiting"


def test_answer_from_the_viewer_then_the_http_resume_is_refused(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        run_id = _start(c)
        r = c.post(f"/ui/api/runs/{run_id}/answer", json={"answer": "ok"}, headers=KEY)
        assert r.status_code == 202, r.text
        deadline = time.time() + 20
        while (d := c.get(f"/ui/api/runs/{run_id}", headers=KEY).json())["run"]["status"] in ("running",
                                                                                               "interrupted"):
            assert time.time() < deadline
            time.sleep(0.1)
        publish = next(s for s in d["steps"] if s["step"] == "publish")
        assert publish["result"] == "a draft about owls (ok)"
        again = c.post(f"/v1/workflows/review/runs/{run_id}/resume", json={"answer": "no"}, headers=KEY)
        assert again.status_code == 409


def test_an_http_resume_holding_the_run_refuses_the_viewer(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        run_id = _start(c)
        from flowrt.checkpoint.lease import LEASE_TTL_S

        store = server.app.state.flowrt.workflow_runtime.checkpointer
        store.claim_run(run_id, "someone-else:1:x", LEASE_TTL_S, waiting=True)   # as a resume in flight holds it
        r = c.post(f"/ui/api/runs/{run_id}/answer", json={"answer": "ok"}, headers=KEY)
        assert r.status_code == 409 and "held by someone-else:1:x" in r.json()["error"]["message"]
