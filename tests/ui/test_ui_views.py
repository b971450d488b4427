"""The viewer's graph layout (the nodes and edges ``flowrt graph`` draws, placed in rows) and step states."""

import flowrt as fr
from flowrt.checkpoint.store import RunRecord
from flowrt.ui.layout import layout
from flowrt.ui.views import step_states


def report() -> fr.Workflow:
    research = fr.Workflow("research")

    @research.step
    def search(topic: str) -> list:
        return [topic]

    @research.step
    def pick(search: list) -> str:
        return search[0]

    wf = fr.Workflow("report")

    @wf.step
    def topic(q: str) -> str:
        return q

    wf.step(research, name="findings")

    @wf.step
    def write(findings: str) -> str:
        return findings

    return wf


def agent() -> fr.Workflow:
    wf = fr.Workflow("agent")

    @wf.step(routes=["tool", "answer"])
    def think(question: str, tool: list | None = None) -> fr.Goto:
        return fr.goto("answer", question)

    @wf.step(routes=["think"])
    def tool(think: list) -> fr.Goto:
        return fr.goto("think", think)

    @wf.step
    def answer(think: str) -> str:
        return think

    return wf


def _box(lay, id_):
    return next(b for b in lay.nodes + lay.clusters if b.id == id_)


def test_subgraph_is_a_cluster_around_its_steps_in_rows():
    lay = layout(report())
    assert {b.id for b in lay.nodes} == {"q", "topic", "findings/search", "findings/pick", "write"}
    (cluster,) = lay.clusters
    assert cluster.id == "findings" and cluster.label == "findings (subgraph research)"
    for inner in ("findings/search", "findings/pick"):
        b = _box(lay, inner)
        assert cluster.x < b.x and b.x + b.w < cluster.x + cluster.w
        assert cluster.y < b.y and b.y + b.h < cluster.y + cluster.h
    ys = [_box(lay, n).y for n in ("q", "topic", "findings/search", "findings/pick", "write")]
    assert ys == sorted(ys) and len(set(ys)) == 5   # one row each: a chain
    edges = {(e.source, e.target, e.kind) for e in lay.edges}
    assert ("topic", "findings/search", "data") in edges and ("findings/pick", "write", "data") in edges
    assert all(0 <= b.x and b.x + b.w <= lay.width and 0 <= b.y and b.y + b.h <= lay.height
               for b in lay.nodes + lay.clusters)


def test_routes_and_loops_are_drawn_and_loops_do_not_set_rows():
    lay = layout(agent())
    kinds = {(e.source, e.target): e.kind for e in lay.edges}
    assert kinds[("think", "tool")] == "route" and kinds[("tool", "think")] == "loop"
    assert _box(lay, "think").y < _box(lay, "tool").y


def _record(status, step_status, errors=None):
    return RunRecord("r1", "report", status, state={"status": step_status, "errors": errors or {}})


def test_a_ready_step_of_a_running_run_shows_running():
    wf = report()
    rec = _record("running", {"topic": "done", "findings": "pending", "write": "pending"})
    states = step_states(wf, rec)
    assert states["topic"] == "done" and states["findings"] == "running" and states["write"] == "pending"
    assert states["findings/search"] == "pending"   # no subgraph state saved yet
    stopped = _record("failed", {"topic": "done", "findings": "pending", "write": "pending"})
    assert step_states(wf, stopped)["findings"] == "pending"   # not running: nothing is in flight


def test_states_shown_for_interrupted_skipped_and_not_routed_steps():
    wf = report()
    rec = _record("interrupted", {"topic": "failed", "findings": "failed", "write": "not_routed"},
                  errors={"topic": {"message": "x", "kind": "failed"}, "findings": {"message": "s", "kind": "skipped"}})
    assert step_states(wf, rec) == {"topic": "failed", "findings": "skipped", "findings/search": "pending",
                                    "findings/pick": "pending", "write": "skipped"}
    rec = _record("interrupted", {"topic": "done", "findings": "interrupted", "write": "pending"})
    assert step_states(wf, rec)["findings"] == "waiting"
    rec = _record("running", {"topic": "done", "findings": "interrupted", "write": "pending"})   # answered
    assert step_states(wf, rec)["findings"] == "running"


def test_steps_of_an_ended_subgraph_come_from_their_checkpoints():
    wf = report()
    rec = _record("done", {"topic": "done", "findings": "done", "write": "done"})
    history = [{"seq": 1, "step": "topic", "visit": 1, "status": "done", "result": {"json": "q"}, "created": 1.0},
               {"seq": 2, "step": "findings/search", "visit": 1, "status": "done", "result": {"json": ["q"]},
                "created": 2.0}]
    states = step_states(wf, rec, history)
    assert states["findings/search"] == "done" and states["findings/pick"] == "pending"
    from flowrt.ui.views import detail

    steps = {s["step"]: s for s in detail(rec, wf, history)["steps"]}
    assert steps["findings/search"]["result"] == ["q"]
