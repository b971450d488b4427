"""Results that cannot be rendered become marked placeholders (everything else survives); a sync step
that overruns its timeout never keeps the process alive."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time

import anyio

import flowrt as fr
from flowrt.runner.executor import execute, to_jsonable
from support import ROOT



class NoStr:
    def __str__(self) -> str:
        raise RuntimeError("no str for you")

    def __repr__(self) -> str:
        raise RuntimeError("no repr either")


class BadMessage(Exception):
    def __str__(self) -> str:
        raise RuntimeError("cannot describe myself")


def test_to_jsonable_is_total():
    huge = 10 ** 5000
    out = to_jsonable({"big": huge, "bad": NoStr(), "ok": [1, "a"], NoStr(): 1, "lone": "x\ud800y",
                       "deep": {huge: (huge, 2)}})
    assert out["big"].startswith("<unrenderable int: Exceeds the limit (4300 digits)")
    assert out["bad"] == "<unrenderable NoStr: no str for you>"
    assert out["ok"] == [1, "a"] and out["<unrenderable NoStr: no str for you>"] == 1
    assert out["lone"] == "x\\ud800y"
    (key, value), = out["deep"].items()
    assert key.startswith("<unrenderable int") and value[1] == 2
    json.dumps(out, ensure_ascii=False).encode("utf-8")


def test_run_result_json_keeps_every_other_output():
    wf = fr.Workflow("odd")

    @wf.step
    def big() -> int:
        return 10 ** 5000

    @wf.step
    def nostr() -> object:
        return NoStr()

    @wf.step
    def fine() -> str:
        return "still here"

    @wf.step
    def fails() -> None:
        raise BadMessage()

    r = anyio.run(lambda: execute(wf, {}))
    d = json.loads(r.to_json())
    assert d["outputs"]["fine"] == "still here"
    assert "Exceeds the limit (4300 digits)" in d["outputs"]["big"]
    assert d["outputs"]["nostr"] == "<unrenderable NoStr: no str for you>"
    assert d["errors"]["fails"] == "BadMessage: <unrenderable BadMessage: cannot describe myself>"


def test_timed_out_sync_step_does_not_keep_flowrt_run_alive(tmp_path):
    f = tmp_path / "hang.py"
    f.write_text(textwrap.dedent("""
        import time
        import flowrt as fr

        wf = fr.Workflow("hang")

        @wf.step(timeout=1)
        def stuck() -> str:
            time.sleep(600)
            return "never"

        @wf.step
        def other() -> str:
            return "done"
    """))
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "flowrt.cli", "run", str(f), "--json"], capture_output=True,
                          text=True, timeout=300, cwd=str(ROOT))
    # The step sleeps 600 s: anything far below that means the process did not wait for its thread
    # (the margin is wide because interpreter start-up is slow on a loaded 2-core machine).
    assert time.perf_counter() - t0 < 120, "the abandoned step thread kept the process alive"
    assert proc.returncode == 1, proc.stderr
    d = json.loads(proc.stdout)
    assert d["outputs"] == {"other": "done"} and "timed out after 1s" in d["errors"]["stuck"]
