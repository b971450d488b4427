"""The example workflows (workflows/*.py) run end to end on the tiny test model, and their helpers work."""

from __future__ import annotations


import anyio
import pytest

import flowrt as fr
from flowrt.graph.loader import load_module, load_workflow
from support import ROOT

MODEL = str(ROOT / "tests" / "models" / "stories260K")

CASES = {
    "self_consistency": {"question": "Tom has 3 apples and buys 5 more. How many?", "samples": 3, "max_tokens": 8},
    "tree_of_thought": {"problem": "What is 2 + 2?", "breadth": 2, "depth": 2, "beam": 1},
    "skeleton_of_thought": {"question": "How do I plant a tree?", "points": 2},
    "map_reduce": {"words_per_chunk": 60},
    "react_agent": {"question": "What is 6 times 7?", "max_steps": 1},
}


def test_examples_run_on_the_test_model():
    pytest.importorskip("flowrt.engine")
    workflows = {name: load_workflow(ROOT / "workflows" / f"{name}.py") for name in CASES}

    async def main():
        async with fr.Runtime(model=MODEL, dtype="float32", num_kv_blocks=512) as rt:
            results = await fr.gather(*(rt.run(workflows[n], **CASES[n]) for n in CASES))  # all at once
            return dict(zip(CASES, results)), rt.stats()

    results, stats = anyio.run(main)
    for name, r in results.items():
        assert r.ok, (name, {k: e.traceback for k, e in r.errors.items()})
        assert r.output is not None or name == "react_agent"
    assert len(results["self_consistency"].outputs["solve"]) == 3
    assert len(results["tree_of_thought"].outputs["search"]) == 2
    assert len(results["map_reduce"].outputs["summarize"]) == len(results["map_reduce"].outputs["chunks"]) > 1
    assert stats["kv_blocks_used"] == 0 and stats["open_sequences"] == 0


def test_example_helpers():
    sc = load_module(ROOT / "workflows" / "self_consistency.py")
    assert sc.final_answer("so 3 + 5 = 8. The answer is 8.") == "8"
    assert sc.final_answer("first 12 then 1,234") == "1234"
    assert sc.final_answer("no digits") is None
    assert sc.vote(["The answer is 8.", "The answer is 7.", "answer is 8"]) == "8"
    ra = load_module(ROOT / "workflows" / "react_agent.py")
    assert ra.calculator("17 * 23 + 4") == "395"
    assert ra.calculator("2 ^ 10") == "1024"
    assert ra.calculator("__import__('os')").startswith("error")
    assert ra.calculator("9 ** 999").startswith("error")
    assert ra.lookup("Speed of light") == "299792 km/s"
    mr = load_module(ROOT / "workflows" / "map_reduce.py")
    assert len(mr.chunks(mr.SAMPLE, 60)) == 3
