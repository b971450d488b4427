"""Workflows as endpoints: POST /v1/workflows/{name}/runs on stories260K (plain JSON and SSE step events)."""

import json
import textwrap

import anyio
import httpx
import pytest

from support import ROOT, STORIES, serve_model


WORKFLOW = textwrap.dedent('''
    import flowrt as fr

    wf = fr.Workflow("story")

    @wf.step
    async def draft(start: str, llm: fr.Model) -> str:
        return await (llm.thread(start)).gen(max_tokens=8, temperature=0)

    @wf.step
    async def branches(start: str, llm: fr.Model) -> list[str]:
        t = llm.thread(start + " Lily")
        return await fr.gather(*(b.gen(max_tokens=6, temperature=0.8, seed=i) for i, b in enumerate(t.fork(2))))

    @wf.step
    def shout(draft: str, branches: list[str]) -> dict:
        return {"draft": draft.upper(), "n": len(branches)}

    broken = fr.Workflow("broken")

    @broken.step
    def explode(x: int) -> int:
        raise ValueError(f"cannot handle {x}")
''')


# Results that cannot be rendered as they are: each becomes a placeholder, the others survive.
ODD = textwrap.dedent('''
    import flowrt as fr

    wf = fr.Workflow("odd")

    class Mute:
        def __str__(self):
            raise RuntimeError("no words")

        __repr__ = __str__

    @wf.step
    def huge() -> int:
        return 10 ** 5000

    @wf.step
    def mute() -> object:
        return Mute()

    @wf.step
    def lone() -> str:
        return "a\\ud800b"

    @wf.step
    def fine(huge: int, mute: object) -> str:
        return "still here"
''')


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from flowrt.server.workflows import load_workflows

    d = tmp_path_factory.mktemp("wf")
    (d / "story.py").write_text(WORKFLOW)
    (d / "odd.py").write_text(ODD)  # also a `wf` variable: served side by side, by Workflow name
    workflows = load_workflows([str(d / "story.py"), str(d / "odd.py")])
    for srv in serve_model(STORIES, served_model_name="stories260K", workflows=workflows):
        srv.workflows = workflows
        yield srv


def test_list_workflows(server):
    data = httpx.get(server.url + "/v1/workflows").json()["data"]
    by_id = {w["id"]: w for w in data}
    assert set(by_id) == {"story", "broken", "odd"}
    assert by_id["story"]["inputs"] == {"start": {"required": True, "type": "str"}}
    assert by_id["story"]["steps"] == ["draft", "branches", "shout"]


def test_run_returns_flowrt_run_json(server):
    r = httpx.post(server.url + "/v1/workflows/story/runs", json={"inputs": {"start": "Once upon a time"}},
                   timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) == {"outputs", "errors", "stats"} and body["errors"] == {}
    # the same run through fr.Runtime, as `flowrt run --json` does it
    from flowrt.runner.runtime import Runtime

    async def direct():
        async with Runtime(model=server.engine) as rt:
            return (await rt.run(server.workflows["story"], start="Once upon a time")).to_dict()

    expected = anyio.run(direct)
    assert body["outputs"] == expected["outputs"]
    assert set(body["stats"]) == set(expected["stats"])
    assert body["outputs"]["shout"] == {"draft": body["outputs"]["draft"].upper(), "n": 2}
    assert body["outputs"]["draft"].startswith(", there was a little girl")
    # endpoints are named by fr.Workflow(name) only, not by the variable (every example's is `wf`)
    r = httpx.post(server.url + "/v1/workflows/wf/runs", json={"inputs": {"start": "Hi"}}, timeout=60)
    assert r.status_code == 404 and "served: story, broken, odd" in r.json()["error"]["message"]


def test_run_stream_step_events(server):
    with httpx.stream("POST", server.url + "/v1/workflows/story/runs", timeout=60,
                      json={"inputs": {"start": "Once upon a time"}, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    events = [json.loads(d) for d in data[:-1]]
    assert events[0]["type"] == "run" and events[-1]["type"] == "result"
    steps = [(e["step"], e["status"]) for e in events if e["type"] == "step"]
    for step in ("draft", "branches", "shout"):
        assert (step, "running") in steps and (step, "done") in steps
        assert steps.index((step, "running")) < steps.index((step, "done"))
    assert steps.index(("draft", "done")) < steps.index(("shout", "running"))
    assert events[-1]["outputs"]["draft"].startswith(", there was a little girl")


def test_run_errors(server):
    url = server.url + "/v1/workflows/{}/runs"
    r = httpx.post(url.format("nope"), json={"inputs": {}})
    assert r.status_code == 404 and r.json()["error"]["code"] == "workflow_not_found"
    r = httpx.post(url.format("story"), json={"inputs": {}})
    assert r.status_code == 400 and "start" in r.json()["error"]["message"]
    r = httpx.post(url.format("story"), json={"inputs": {"start": "x", "bogus": 1}})
    assert r.status_code == 400
    # a failing step is reported in the result, as `flowrt run --json` does
    r = httpx.post(url.format("broken"), json={"inputs": {"x": 3}}, timeout=30)
    assert r.status_code == 200
    assert "cannot handle 3" in r.json()["errors"]["explode"]


def test_unrenderable_results_do_not_lose_the_run(server):
    url = server.url + "/v1/workflows/odd/runs"
    r = httpx.post(url, json={}, timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    with httpx.stream("POST", url, json={"stream": True}, timeout=30) as s:
        assert s.status_code == 200
        data = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    streamed = json.loads(data[-2])
    assert streamed["type"] == "result"
    for out in (body["outputs"], streamed["outputs"]):
        assert out["fine"] == "still here"
        assert out["huge"].startswith("<unrenderable int") and out["mute"].startswith("<unrenderable Mute")
        assert out["lone"].startswith("a") and out["lone"].endswith("b")
    assert body["errors"] == streamed["errors"] == {}


def test_workflow_name_clash_is_reported(tmp_path):
    from flowrt.server.workflows import load_workflows
    from flowrt.graph.workflow import WorkflowError

    examples = ROOT / "workflows"
    a, b = str(examples / "self_consistency.py"), str(examples / "map_reduce.py")
    assert set(load_workflows([a, b])) == {"self-consistency", "map-reduce"}  # both hold it in `wf`
    copy = tmp_path / "copy.py"
    copy.write_text((examples / "map_reduce.py").read_text())
    with pytest.raises(WorkflowError, match=r"two served workflows are named 'map-reduce' \(in .*map_reduce\.py and "
                                            r".*copy\.py\)"):
        load_workflows([b, str(copy)])
