#!/usr/bin/env python
"""Checkpoint storage under a long loop: the database size of an agent loop (agent -> tool -> agent ...) run
for N iterations, against the size of the step results it holds (each result's stored JSON, summed over the
run's checkpoints). A compact store keeps each result once and no copy of earlier state per step, so the
ratio stays near 1 whatever N; a store that saves the whole state (or every live thread) at every step grows
with steps x state.

    python bench/checkpoint_size.py [--iterations 200] [--result-bytes 400] [--checkpoint runs.db|postgresql://...]

SQLite: the file's size after the store is closed (WAL folded in). PostgreSQL: pg_total_relation_size of the
flowrt tables.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import flowrt as fr  # noqa: E402
from flowrt.checkpoint import open_store  # noqa: E402


def loop_workflow(iterations: int, result_bytes: int) -> fr.Workflow:
    """An agent that calls a tool ``iterations`` times; every call returns a new observation of about
    ``result_bytes`` characters, and the agent routes on with the latest one (not the whole history)."""
    wf = fr.Workflow("long_loop")

    @wf.step(routes=["tool", "answer"], max_visits=iterations + 1)
    def agent(question: str, tool: dict | None = None) -> fr.Goto:
        n = tool["n"] if tool else 0
        if n >= iterations:
            return fr.goto("answer", f"{question}: {n} calls")
        return fr.goto("tool", {"n": n, "plan": f"call the tool for the {n}th time"})

    @wf.step(routes=["agent"], max_visits=iterations)
    def tool(agent: dict) -> fr.Goto:
        n = agent["n"] + 1
        text = f"observation {n}: " + "".join(chr(97 + (n * 7 + i) % 26) for i in range(result_bytes))
        return fr.goto("agent", {"n": n, "observation": text})

    @wf.step
    def answer(agent: str) -> str:
        return agent.upper()

    return wf


def _db_bytes(spec: str) -> int:
    if spec.startswith(("postgresql://", "postgres://")):
        import psycopg

        with psycopg.connect(spec, autocommit=True) as c:
            return int(c.execute("SELECT COALESCE(SUM(pg_total_relation_size(c.oid)), 0) FROM pg_class c "
                                 "JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.relkind = 'r' "
                                 "AND n.nspname = current_schema() AND c.relname LIKE 'flowrt%%'").fetchone()[0])
    return sum(os.path.getsize(spec + suffix) for suffix in ("", "-wal") if os.path.exists(spec + suffix))


def measure(spec: str, iterations: int = 200, result_bytes: int = 400) -> dict[str, Any]:
    """Run the loop once into the store at ``spec``; its database size against the results it holds."""
    wf = loop_workflow(iterations, result_bytes)

    async def go() -> fr.RunResult:
        rt = fr.Runtime(checkpoint=spec)
        try:
            return await rt.run(wf, question="q")
        finally:
            rt.checkpointer.close()   # the last connection: SQLite folds its WAL into the file

    result = anyio.run(go)
    assert result.ok, result.errors
    store = open_store(spec)
    try:
        hist = store.history(result.run_id)
    finally:
        store.close()
    results = sum(len(json.dumps(h["result"], separators=(",", ":"))) for h in hist if h["result"] is not None)
    db = _db_bytes(spec)
    return {"iterations": iterations, "checkpoints": len(hist), "results_bytes": results, "db_bytes": db,
            "ratio": db / results}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iterations", type=int, default=200)
    ap.add_argument("--result-bytes", type=int, default=400, help="size of each tool observation")
    ap.add_argument("--checkpoint", help="store to measure (default: a fresh SQLite file); a PostgreSQL "
                    "database should be empty")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        spec = args.checkpoint or os.path.join(d, "runs.db")
        m = measure(spec, args.iterations, args.result_bytes)
    print(f"{m['iterations']} iterations, {m['checkpoints']} checkpoints: results {m['results_bytes']:,} B, "
          f"database {m['db_bytes']:,} B, ratio {m['ratio']:.2f}")
    print(json.dumps(m))


if __name__ == "__main__":
    main()
