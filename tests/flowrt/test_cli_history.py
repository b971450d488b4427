"""``flowrt runs history``: its columns stay aligned however long a step's path is (subgraph steps such as
``related/summary#2/outline``)."""

from __future__ import annotations

import re
import textwrap

from flowrt.cli.commands import main
from flowrt.cli.table import text_table

NESTED = textwrap.dedent('''
    import flowrt as fr

    summary = fr.Workflow("summary")


    @summary.step
    def outline(topic: str) -> str:
        return f"outline of {topic}"


    wf = fr.Workflow("report")


    @wf.step
    async def related(topic: str) -> list[str]:
        return await fr.gather(*(fr.subflow(summary, topic=f"{topic} ({a})") for a in ("history", "use")))


    @wf.step
    def write(related: list[str]) -> str:
        return ", ".join(related)
''')

ROW = re.compile(r"^ *\d+  \d{4}-\d\d-\d\d \d\d:\d\d:\d\d  (\S+) +(\S+)")


def test_history_columns_align_for_nested_step_paths(tmp_path, capsys):
    f = tmp_path / "report.py"
    f.write_text(NESTED)
    db = str(tmp_path / "runs.db")
    assert main(["run", str(f), "-w", "report", "--input", "topic=paging", "--checkpoint", db, "--no-progress"]) == 0
    run_id = capsys.readouterr().err.split("flowrt run: run ")[1].split(";")[0]
    assert main(["runs", "history", run_id, "--checkpoint", db]) == 0
    rows = [ROW.match(line) for line in capsys.readouterr().out.splitlines()]
    assert all(rows)
    assert "related/summary#2/outline" in [m.group(1) for m in rows]
    assert len({m.start(2) for m in rows}) == 1   # every status starts in the same column


def test_text_table_widths_come_from_the_cells():
    rows = [("1", "a", "done", "x"), ("10", "related/summary#2/outline", "done", "y y")]
    assert text_table(rows, right=frozenset({0})) == [" 1  a                          done  x",
                                                      "10  related/summary#2/outline  done  y y"]
    assert text_table([("1", "a", "")]) == ["1  a"]   # no trailing spaces
    assert text_table([]) == []
