"""Issue 27 item 10: ``rt.resume`` uses the workflow that is already loaded (``workflow=``, or the run's file
when it is already imported) and imports the file only when it is not: a script without a
``if __name__ == "__main__":`` guard can resume its own runs."""

from __future__ import annotations

import subprocess
import sys

import anyio

import flowrt as fr
from flowrt.graph.loader import load_module, loaded_workflow

STEPS = '''
wf = fr.Workflow("self-resume")


@wf.step
async def ask() -> str:
    return await fr.interrupt("name?")


@wf.step
def greet(ask: str) -> str:
    return f"hello {ask}"
'''

SCRIPT = '''
import asyncio
import sys

import flowrt as fr

with open(sys.argv[2], "a") as f:   # the top level runs once: a second import would append again
    f.write("imported\\n")
''' + STEPS + '''

async def main():
    async with fr.Runtime(checkpoint=sys.argv[1]) as rt:
        first = await rt.run(wf)
        done = await rt.resume(first.run_id, answer="Ada")
        print(first.status, done.outputs["greet"])


asyncio.run(main())
'''


def test_a_script_without_a_main_guard_resumes_its_own_run(tmp_path):
    script, log = tmp_path / "agent.py", tmp_path / "imports.log"
    script.write_text(SCRIPT)
    p = subprocess.run([sys.executable, str(script), str(tmp_path / "runs.db"), str(log)], capture_output=True,
                       text=True, timeout=120, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["interrupted", "hello", "Ada"]
    assert log.read_text().split() == ["imported"]


MODULE = '''
import sys
import flowrt as fr

LOADS = getattr(sys, "_flowrt_test_loads", 0) + 1
sys._flowrt_test_loads = LOADS
''' + STEPS


def test_resume_takes_the_imported_modules_workflow_by_identity(tmp_path, monkeypatch):
    f = tmp_path / "mod.py"
    f.write_text(MODULE)
    monkeypatch.setattr(sys, "_flowrt_test_loads", 0, raising=False)
    module = load_module(f)
    assert loaded_workflow(f, "self-resume") is module.wf and loaded_workflow(f, "wf") is module.wf
    assert loaded_workflow(f, "other") is None and loaded_workflow(tmp_path / "absent.py", "wf") is None

    async def go() -> fr.RunResult:
        async with fr.Runtime(checkpoint=str(tmp_path / "runs.db")) as rt:
            first = await rt.run(module.wf)
            return await rt.resume(first.run_id, answer="Bo")

    assert anyio.run(go).outputs["greet"] == "hello Bo"
    assert sys._flowrt_test_loads == 1     # not imported again
