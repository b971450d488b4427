"""Issue 35 item 1: the typed run state (flowrt.runner.state) and its one versioned on-disk codec
(flowrt.checkpoint.state_codec)."""

from __future__ import annotations

import copy
import json

import pytest

from flowrt.checkpoint import CheckpointError
from flowrt.checkpoint.codec import encode
from flowrt.checkpoint.state_codec import VERSION, dump, load, restore
from flowrt.runner.state import RunState, RunStatus, StepError, StepStatus, step_of


def test_statuses_read_as_their_strings_in_json_text_and_comparisons():
    assert json.dumps({"a": StepStatus.NOT_ROUTED, "run": RunStatus.INTERRUPTED}) == \
        '{"a": "not_routed", "run": "interrupted"}'
    assert f"{StepStatus.DONE}" == str(StepStatus.DONE) == "done" and StepStatus.DONE == "done"
    assert {"done": 1}[StepStatus.DONE] == 1 and StepStatus("skipped") is StepStatus.SKIPPED


def test_step_of_names_the_step_a_subgraph_key_belongs_to():
    assert [step_of(k) for k in ("rev", "each[3]", "ask/agent#2", "second/outer")] == ["rev", "each", "ask", "second"]


def _saved(**kw):
    return {"status": {"a": "done", "b": "running", "c": "interrupted", "d": "failed", "e": "done"},
            "visits": {"a": 1, "b": 2, "c": 1, "d": 1, "e": 1},
            "outputs": {"a": {"json": [1, {"__flowrt__": "tuple", "items": [2, 3]}]},
                        "b": {"json": "old"}, "e": {"placeholder": "<object>", "type": "object", "reason": "x"}},
            "routes": [{"step": "a", "visit": 1, "to": ["b"]}], "timings": {"a": 0.5}, **kw}


def test_restore_keeps_finished_steps_and_runs_the_others_again_without_changing_the_saved_state():
    saved = load(_saved())
    before = copy.deepcopy(saved)
    st = RunState.new("abcdef")
    restore(st, saved, None, run_id="r")
    assert saved == before   # the stored state is read, not rewritten (it was, in place, before issue 35)
    assert st.status == {"a": "done", "b": "pending", "c": "pending", "d": "pending", "e": "pending", "f": "pending"}
    assert all(isinstance(s, StepStatus) for s in st.status.values())
    # running or interrupted: that visit did not count; failed: it did; a placeholder's step runs again
    assert st.visits == {"a": 1, "b": 1, "c": 0, "d": 1, "e": 1, "f": 0}
    assert st.outputs["a"] == [1, (2, 3)] and "e" not in st.outputs and st.encoded["a"] == saved["outputs"]["a"]
    assert st.route_log == [{"step": "a", "visit": 1, "to": ["b"]}] and st.timings == {"a": 0.5}


def test_restore_refuses_a_step_the_workflow_lost_and_a_status_it_does_not_know():
    with pytest.raises(CheckpointError, match="has step 'sub/z', which the workflow no longer defines"):
        restore(RunState.new("a"), load({"status": {"z": "done"}}), None, run_id="r", path="sub")
    with pytest.raises(CheckpointError, match="status 'finished'.*corrupt"):
        restore(RunState.new("a"), load({"status": {"a": "finished"}}), None, run_id="r")


def test_version_1_flat_subgraph_states_load_nested_by_path():
    flat = _saved(subruns={"rev": {"status": {"x": "done"}}, "second/outer": {"status": {"inner": "interrupted"}},
                           "second/outer/inner/review": {"status": {"legal": "interrupted"}},
                           "each[2]/agent#2": {"status": {"y": "done"}}})
    original = copy.deepcopy(flat)
    state = load(flat)
    assert flat == original and state["version"] == VERSION
    assert state["subruns"] == {
        "rev": {"status": {"x": "done"}},
        "second/outer": {"status": {"inner": "interrupted"},
                         "subruns": {"inner/review": {"status": {"legal": "interrupted"}}}},
        "each[2]/agent#2": {"status": {"y": "done"}}}
    assert load(state) == state   # the current version loads as it is


def test_a_newer_or_unknown_state_format_is_refused():
    with pytest.raises(CheckpointError, match="state format 3; this flowrt reads formats 1 to 2"):
        load({"version": VERSION + 1, "status": {}})
    with pytest.raises(CheckpointError, match="state format 'x'"):
        load({"version": "x"})
    assert load(None) is None and load({}) is None


def _state_with_children() -> RunState:
    st = RunState.new(["a", "sub", "b"])
    st.status.update(a=StepStatus.DONE, sub=StepStatus.INTERRUPTED)
    st.visits.update(a=1, sub=1)
    st.outputs["a"], st.encoded["a"] = (1, "x"), encode((1, "x"))
    st.errors["b"] = StepError("b", "boom", "tb", kind="failed", attempts=2)
    st.not_routed["c"] = StepError("c", "not routed: a chose another route", kind="not_routed")
    st.chosen["a"] = {"b": (2,)}
    st.interrupt = {"step": "sub/ask", "index": 0, "payload": {"q": 1}}
    st.interrupts = [st.interrupt, {"step": "sub/other", "index": 0, "payload": None}]
    child = RunState.new(["ask", "other"])
    child.status.update(ask=StepStatus.INTERRUPTED, other=StepStatus.INTERRUPTED)
    grandchild = RunState.new(["x"])
    child.children["other/agent"] = grandchild
    st.children["sub"] = child
    st.restoring["later"] = {"status": {"y": "done"}}   # found by a resume, not started again yet: kept as found
    st.held_threads["sub/ask"] = [[1, 2, 3]]
    return st


def test_dump_writes_the_versioned_json_form_with_subgraphs_nested():
    state = dump(_state_with_children(), answers={"sub/ask": ["yes"]}, held_threads=True)
    assert json.loads(json.dumps(state)) == state
    assert state["version"] == VERSION and state["status"] == {"a": "done", "sub": "interrupted", "b": "pending"}
    assert type(state["status"]["a"]) is str
    assert state["outputs"] == {"a": {"json": {"__flowrt__": "tuple", "items": [1, "x"]}}}
    assert state["errors"] == {"b": {"message": "boom", "kind": "failed", "traceback": "tb", "attempts": 2}}
    assert state["not_routed"] == {"c": "not routed: a chose another route"}
    assert state["chosen"] == {"a": {"b": {"json": {"__flowrt__": "tuple", "items": [2]}}}}
    assert len(state["interrupts"]) == 2 and state["answers"] == {"sub/ask": ["yes"]}
    assert set(state["subruns"]) == {"sub", "later"} and state["subruns"]["later"] == {"status": {"y": "done"}}
    sub = state["subruns"]["sub"]
    assert sub["status"] == {"ask": "interrupted", "other": "interrupted"} and sub["answers"] == {}
    assert sub["subruns"]["other/agent"]["status"] == {"x": "pending"} and "version" not in sub
    assert state["held_threads"] == {"sub/ask": [[1, 2, 3]]}
    assert "held_threads" not in dump(_state_with_children())   # saved with KV checkpoints only


def test_dump_then_restore_gives_the_run_state_back():
    st = _state_with_children()
    back = RunState.new(["a", "sub", "b"])
    restore(back, load(json.loads(json.dumps(dump(st, held_threads=True)))), None, run_id="r")
    assert back.status == {"a": "done", "sub": "pending", "b": "pending"} and back.visits == {"a": 1, "sub": 0, "b": 0}
    assert back.outputs == {"a": (1, "x")} and back.chosen == {"a": {"b": (2,)}}
    assert back.held_threads == st.held_threads and set(back.restoring) == {"sub", "later"}
    assert back.restoring["sub"]["subruns"]["other/agent"]["status"] == {"x": "pending"}
