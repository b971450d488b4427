"""Compact checkpoints (flowrt.checkpoint.compact): a loop's database grows with the results it holds, not
with steps x state; the stored state comes back exactly; format-1 SQLite files are migrated."""

from __future__ import annotations

import json
import sqlite3
import sys
from pathlib import Path

import pytest

from flowrt.checkpoint import SCHEMA_VERSION, open_store

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from checkpoint_size import measure  # noqa: E402


def test_a_loop_database_grows_within_twice_the_results_it_holds(tmp_path):
    """40 more loop iterations than a first run (fresh files both) add at most twice the size of the results
    they add: no copy of earlier state per step (format 1 copied the whole state into every checkpoint row:
    this growth ratio was 23 at these sizes, and rising with the loop's length)."""
    small = measure(str(tmp_path / "small.db"), iterations=20, result_bytes=400)
    big = measure(str(tmp_path / "big.db"), iterations=60, result_bytes=400)
    growth = (big["db_bytes"] - small["db_bytes"]) / (big["results_bytes"] - small["results_bytes"])
    assert big["checkpoints"] == 123 and growth <= 2.0, (small, big)


def _saves(store, run_id: str) -> dict:
    """A loop's checkpoints as the executor saves them: outputs by reference, a failed visit that repeats
    an earlier route, a final save without a step. Returns the last state given."""
    state: dict = {"status": {}, "visits": {}, "outputs": {}, "routes": [], "timings": {}}
    for i in range(1, 4):
        for step in ("agent", "tool"):
            route = {"step": step, "visit": i, "to": ["tool" if step == "agent" else "agent"]}
            result = {"json": {"step": step, "i": i, "text": "x" * i}}
            state = {**state, "visits": {**state["visits"], step: i}, "routes": state["routes"] + [route],
                     "outputs": {**state["outputs"], step: result}, "status": {**state["status"], step: "done"}}
            store.save(run_id, step=step, visit=i, step_status="done", result=result, route=route, threads=[],
                       state=state, run_status="running")
    # tool fails at visit 4: its old output stays, the route passed is visit 3's
    state = {**state, "visits": {**state["visits"], "tool": 4}, "status": {**state["status"], "tool": "failed"}}
    store.save(run_id, step="tool", visit=4, step_status="failed", result=state["outputs"]["tool"],
               route=state["routes"][-1], threads=[{"id": 1, "token_ids": [1, 2]}], state=state, run_status="running")
    store.save(run_id, step=None, visit=0, step_status="failed", result=None, route=None, threads=[], state=state,
               run_status="failed")
    return state


def test_stored_state_comes_back_exactly(store_spec):
    store = open_store(store_spec)
    store.create_run("r", "wf", {})
    state = _saves(store, "r")
    back = store.get_run("r").state
    assert back == state and list(back["outputs"]) == list(state["outputs"])
    assert [h["step"] for h in store.history("r")] == ["agent", "tool"] * 3 + ["tool", None]
    # a state written whole (a fork's first checkpoint): outputs and routes no row holds stay inline
    store.create_run("f", "wf", {})
    store.save("f", step=None, visit=0, step_status="running", result=None, route=None, threads=[], state=state,
               run_status="running")
    assert store.get_run("f").state == state
    store.close()


def test_format_1_sqlite_file_is_migrated(tmp_path):
    db = tmp_path / "old.db"
    con = sqlite3.connect(db)
    con.executescript("""
        CREATE TABLE schema_version (version INTEGER NOT NULL);
        INSERT INTO schema_version VALUES (1);
        CREATE TABLE runs (run_id TEXT PRIMARY KEY, workflow TEXT NOT NULL, file TEXT, status TEXT NOT NULL,
            inputs TEXT NOT NULL, meta TEXT NOT NULL, interrupt TEXT, created REAL NOT NULL, updated REAL NOT NULL);
        CREATE TABLE checkpoints (run_id TEXT NOT NULL REFERENCES runs(run_id), seq INTEGER NOT NULL, step TEXT,
            visit INTEGER NOT NULL, status TEXT NOT NULL, result TEXT, route TEXT, threads TEXT NOT NULL,
            state TEXT NOT NULL, created REAL NOT NULL, PRIMARY KEY (run_id, seq));
        INSERT INTO runs VALUES ('r', 'wf', 'f.py', 'interrupted', '{"x":1}', '{}', '{"step":"b"}', 1.0, 2.0);
    """)
    s1 = {"status": {"a": "done"}, "outputs": {"a": {"json": 1}}, "routes": [{"step": "a", "visit": 1, "to": ["b"]}]}
    s2 = {**s1, "status": {"a": "done", "b": "interrupted"}}
    for seq, step, st in ((1, "a", s1), (2, "b", s2)):
        con.execute("INSERT INTO checkpoints VALUES ('r', ?, ?, 1, 'done', ?, 'null', '[]', ?, 1.5)",
                    (seq, step, json.dumps({"json": seq}), json.dumps(st)))
    con.commit()
    con.close()
    store = open_store(str(db))
    rec = store.get_run("r")
    assert rec.state == s2 and rec.status == "interrupted" and rec.checkpoints == 2 and rec.interrupt == {"step": "b"}
    assert [h["result"] for h in store.history("r")] == [{"json": 1}, {"json": 2}]
    store.save("r", step="b", visit=1, step_status="done", result={"json": 3}, route=None, threads=[],
               state={**s2, "outputs": {**s2["outputs"], "b": {"json": 3}}}, run_status="running")
    assert store.get_run("r").state["outputs"] == {"a": {"json": 1}, "b": {"json": 3}}
    store.close()
    con = sqlite3.connect(db)
    assert con.execute("SELECT version FROM schema_version").fetchall() == [(SCHEMA_VERSION,)]
    assert "state" not in {r[1] for r in con.execute("PRAGMA table_info(checkpoints)")}
    con.close()


@pytest.mark.parametrize("bad", ["ref", "routes"])
def test_a_state_that_refers_to_missing_rows_is_a_clear_error(tmp_path, bad):
    from flowrt.checkpoint import CheckpointError

    db = str(tmp_path / "runs.db")
    store = open_store(db)
    store.create_run("r", "wf", {})
    _saves(store, "r")
    con = sqlite3.connect(db)
    if bad == "ref":
        con.execute("DELETE FROM checkpoints WHERE step = 'agent'")
    else:
        con.execute("UPDATE checkpoints SET route = 'null' WHERE seq = 1")
    con.commit()
    con.close()
    with pytest.raises(CheckpointError, match="corrupt"):
        store.get_run("r")
    store.close()
