"""The line ``flowrt run`` ends with counts step runs and distinct steps, as ``stats.run`` does: an agent loop
that ran ``agent`` 3 times and ``tool`` twice is "6 step runs, 3 steps done", not "3 steps done"."""

from __future__ import annotations

import json
import textwrap

from flowrt.cli.commands import main
from flowrt.cli.progress import steps_done

LOOP = textwrap.dedent('''
    import flowrt as fr

    wf = fr.Workflow("agent-loop")


    @wf.step(routes=["tool", "answer"], max_visits=5)
    def agent(question: str, tool: list[str] | None = None) -> fr.Goto:
        notes = tool or []
        if len(notes) >= 2:
            return fr.goto("answer", notes)
        return fr.goto("tool", notes)


    @wf.step(routes=["agent"])
    def tool(agent: list[str]) -> fr.Goto:
        return fr.goto("agent", agent + [f"result {len(agent) + 1}"])


    @wf.step
    def answer(agent: list[str]) -> str:
        return "; ".join(agent)
''')


def test_footer_counts_step_runs_and_steps_of_a_loop(tmp_path, capsys):
    f = tmp_path / "loop.py"
    f.write_text(LOOP)
    assert main(["run", str(f), "--input", "question=q", "--json"]) == 0
    run = json.loads(capsys.readouterr().out)["stats"]["run"]
    assert (run["step_runs"], run["steps_completed"]) == (6, 3)   # agent 3, tool 2, answer 1

    assert main(["run", str(f), "--input", "question=q", "--no-progress"]) == 0
    out, err = capsys.readouterr()
    assert "result 1; result 2" in out
    assert "6 step runs, 3 steps done in " in err


def test_steps_done_wording():
    assert steps_done({"steps_completed": 3, "step_runs": 3}) == "3 steps done"   # no loop: one count
    assert steps_done({"steps_completed": 1, "step_runs": 1}) == "1 step done"
    assert steps_done({"steps_completed": 2, "step_runs": 5}) == "5 step runs, 2 steps done"
    assert steps_done({"steps_completed": 0, "step_runs": 1}) == "1 step run, 0 steps done"   # it failed
