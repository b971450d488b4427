"""The README's workflow files run as they are (no undefined names, real signatures), here on the tiny
test model instead of the default one; every python block in it compiles; and its self-consistency workflow,
the shipped workflows/self_consistency.py, answers its question right on the default model."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import anyio
import pytest

import flowrt as fr
from flowrt.graph.loader import load_workflow
from support import ROOT

MODEL = str(ROOT / "tests" / "models" / "stories260K")

pytest.importorskip("flowrt.engine")


def readme_block(section: str) -> str:
    """The first ```python block after the heading ``section``."""
    text = (ROOT / "README.md").read_text()
    start = text.index(section)
    return re.search(r"```python\n(.*?)```", text[start:], re.S).group(1)


@pytest.fixture(scope="module")
def engine():
    from flowrt.engine import AsyncLLM

    eng = AsyncLLM(model=MODEL, dtype="float32", num_kv_blocks=256, seed=0)
    yield eng
    eng.shutdown()


def run_file(tmp_path: Path, name: str, src: str, engine, **inputs) -> fr.RunResult:
    path = tmp_path / name
    path.write_text(src)
    wf = load_workflow(path)

    async def main() -> fr.RunResult:
        async with fr.Runtime(model=engine) as rt:
            return await rt.run(wf, **inputs)

    return anyio.run(main)


def python_blocks() -> list[tuple[int, str, str]]:
    """Every ```python block of the README (those indented in a list too): (line, the text before it, code)."""
    text = (ROOT / "README.md").read_text()
    return [(text.count("\n", 0, m.start()) + 1, text[:m.start()], textwrap.dedent(m.group(2)))
            for m in re.finditer(r"^( *)```python\n(.*?)^\1```", text, re.S | re.M)]


# The blocks the README says run as they are, by their section, and the tests that run them.
RUN_BY_TESTS = {
    "## Workflows": "here: test_readme_workflow_runs_as_is, test_readme_self_consistency_answers_8_...",
    "## Routing, checkpoints, interrupts and streaming": "test_workflow_routing.py: test_readme_routed_agent_loop_...",
    "## Subgraphs and time travel": "here: test_readme_subgraphs_and_time_travel_block_runs",
    "## Threads and chat": "here: test_readme_threads_and_chat_block_runs",
    "### Structured output and tools": "test_tools.py: test_readme_structured_and_tools_block_runs",
}


def test_every_readme_python_block_compiles_and_those_said_to_run_are_run():
    blocks = python_blocks()
    assert len(blocks) >= 8
    said_to_run = set()
    for line, before, code in blocks:
        compile(code, f"README.md:{line}", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)   # `async with` in a list
        paragraph = " ".join(before.rstrip("\n").rsplit("\n\n", 1)[-1].split())
        if "runs as it is" in paragraph or "workflow file too" in paragraph:
            said_to_run.add(re.findall(r"^#+ .*$", before, re.M)[-1])
    assert said_to_run == set(RUN_BY_TESTS)


def test_readme_workflows_block_is_the_shipped_self_consistency_file():
    shipped = (ROOT / "workflows" / "self_consistency.py").read_text()
    docstring = ast.get_docstring(ast.parse(shipped), clean=False)
    assert readme_block("## Workflows") == shipped.split(docstring + '"""\n', 1)[1].lstrip("\n")


@pytest.mark.slow
def test_readme_self_consistency_answers_8_on_the_default_model(tmp_path):
    """`python sc.py` as the README says, on the default model (SmolLM2-135M-Instruct): seeded samples, so the
    same samples every run (on one machine and dtype); 8 must win the vote, by most of the samples."""
    path = tmp_path / "sc.py"
    path.write_text(readme_block("## Workflows"))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=600, env=env,
                          cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    vote, answers = proc.stdout.strip().splitlines()[-1].split(" ", 1)
    assert vote == "8", proc.stdout
    assert ast.literal_eval(answers).count("8") >= 5, proc.stdout


def test_readme_workflow_runs_as_is(tmp_path, engine):
    src = readme_block("## Workflows")
    assert 'if __name__ == "__main__":' in src  # importing it defines the workflow without running it
    r = run_file(tmp_path, "sc.py", src, engine, question="Tom has 3 apples and buys 5 more?", samples=2)
    assert r.ok, r.errors
    assert len(r.outputs["solve"]) == 2 and isinstance(r.output, str)


def test_readme_threads_and_chat_block_runs(tmp_path, engine):
    r = run_file(tmp_path, "threads.py", readme_block("## Threads and chat"), engine)
    assert r.ok, {k: e.traceback for k, e in r.errors.items()}
    out = r.output
    assert out["pick"] in (" a cat", " a dog") and set(out["odds"]) == {" a cat", " a dog"}
    assert [m["role"] for m in out["chat"]] == ["system", "user", "assistant", "user", "assistant"]
    assert engine.stats()["open_sequences"] == 0


def test_readme_subgraphs_and_time_travel_block_runs(tmp_path, capsys):
    """The README's subgraph example as its commands run it: interrupt inside the subgraph, resume, history,
    fork at `write` with another tone (findings is not asked again)."""
    import json

    from flowrt.cli.commands import main

    path = tmp_path / "report.py"
    path.write_text(readme_block("## Subgraphs and time travel"))
    db = str(tmp_path / "runs.db")
    assert main(["graph", str(path), "-w", "report", "-f", "mermaid"]) == 0
    assert 'subgraph findings["findings (subgraph research)"]' in capsys.readouterr().out
    assert main(["run", str(path), "-w", "report", "--input", "question=What is paging?", "--checkpoint", db,
                 "--no-progress"]) == 3
    run_id = capsys.readouterr().err.split("flowrt run: run ")[1].split(";")[0]
    assert main(["resume", run_id, "--checkpoint", db, "--answer", "1", "--json", "--no-progress"]) == 0
    done = json.loads(capsys.readouterr().out)["outputs"]
    assert done["write"] == ("[plain] What is paging: source 1; see also outline of What is paging (history), "
                             "outline of What is paging (use)")
    assert main(["runs", "history", run_id, "--checkpoint", db]) == 0
    assert "findings/pick" in capsys.readouterr().out
    assert main(["runs", "fork", run_id, "--at", "write", "--input", "tone=formal", "--checkpoint", db,
                 "--json", "--no-progress"]) == 0   # no interrupt: findings kept its answer
    assert json.loads(capsys.readouterr().out)["outputs"]["write"].startswith("[formal] What is paging: source 1")
