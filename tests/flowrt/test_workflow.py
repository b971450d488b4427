"""Workflow DAG definition and the executor, with plain Python steps (no engine needed)."""

from __future__ import annotations

import json
import threading
import time

import anyio
import pytest

import flowrt as fr
from flowrt.runner.executor import execute
from flowrt.graph.workflow import WorkflowError


def run(wf: fr.Workflow, provider=None, **inputs):
    return anyio.run(lambda: execute(wf, inputs, provider))


# ------------------------------------------------------------------------------------------- definition
def test_steps_wire_by_parameter_names():
    wf = fr.Workflow("w")

    @wf.step
    def double(x: int) -> int:
        return 2 * x

    @wf.step
    async def inc(double: int) -> int:
        return double + 1

    @wf.step
    def both(double, inc, scale: int = 1):
        return [double * scale, inc * scale]

    assert set(wf.graph.edges) == {("x", "double"), ("double", "inc"), ("double", "both"), ("inc", "both"),
                                   ("scale", "both")}
    assert wf.inputs["x"].required and not wf.inputs["scale"].required
    assert wf.order() == ["double", "inc", "both"]
    assert wf.sinks() == ["both"]
    r = wf.run(x=3)
    assert r.ok and r.outputs == {"double": 6, "inc": 7, "both": [6, 7]}
    assert r.output == [6, 7]
    assert wf.run(x=3, scale=10).outputs["both"] == [60, 70]
    assert double(5) == 10  # steps stay callable


def test_duplicate_step_is_an_error():
    wf = fr.Workflow("w")

    @wf.step
    def a(x):
        return x

    with pytest.raises(WorkflowError, match="duplicate step 'a'"):
        @wf.step(name="a")
        def other(x):
            return x


def test_cycle_is_an_error_naming_the_cycle_and_leaves_the_workflow_intact():
    wf = fr.Workflow("w")

    @wf.step
    def a(b):
        return b

    with pytest.raises(WorkflowError, match=r"cycle between steps: (a -> b -> a|b -> a -> b)"):
        @wf.step
        def b(a):
            return a

    assert list(wf.steps) == ["a"]
    with pytest.raises(WorkflowError, match="depends on itself"):
        @wf.step
        def c(c):
            return c


def test_unknown_name_with_declared_inputs():
    wf = fr.Workflow("w", inputs=["question"])

    @wf.step
    def ok(question):
        return question

    with pytest.raises(WorkflowError, match="unknown name 'questoin'"):
        @wf.step
        def typo(questoin):
            return questoin


def test_missing_and_unknown_inputs_are_named_before_anything_runs():
    wf = fr.Workflow("w")
    ran = []

    @wf.step
    def a(question: str, k: int = 2):
        ran.append(1)
        return question * k

    with pytest.raises(WorkflowError, match=r"missing input\(s\) 'question'.*step\(s\) a"):
        wf.run()
    with pytest.raises(WorkflowError, match="unknown input.*'questoin'"):
        wf.run(question="x", questoin="y")
    assert ran == []


def test_bad_step_definitions():
    wf = fr.Workflow("w")
    with pytest.raises(WorkflowError, match="map='items' is not one of its parameters"):
        @wf.step(map="items")
        def m(things):
            return things
    with pytest.raises(WorkflowError, match=r"\*args"):
        @wf.step
        def v(*args):
            return args
    with pytest.raises(WorkflowError, match="reserved"):
        @wf.step
        def llm(x):
            return x
    with pytest.raises(WorkflowError, match="retries"):
        @wf.step(retries=-1)
        def r(x):
            return x
    with pytest.raises(WorkflowError, match="timeout"):
        @wf.step(timeout=0)
        def t(x):
            return x
    with pytest.raises(WorkflowError, match="no steps"):
        wf.run()


def test_after_orders_without_passing_a_value():
    wf = fr.Workflow("w")
    log = []

    @wf.step
    async def first():
        await anyio.sleep(0.05)
        log.append("first")

    @wf.step(after=["first"])
    def second():
        log.append("second")
        return "ok"

    r = wf.run()
    assert r.ok and log == ["first", "second"]
    wf2 = fr.Workflow("w2")

    @wf2.step(after=["nope"])
    def s():
        return 1

    with pytest.raises(WorkflowError, match="after='nope'"):
        wf2.run()


def test_render_formats():
    wf = fr.Workflow("render-me")

    @wf.step(map="items", retries=1, timeout=5)
    async def each(items: list, llm: fr.Model):
        return items

    @wf.step
    def total(each):
        return each

    text = wf.render("text")
    assert "each (map items; retries 1; timeout 5s; uses llm; async)" in text and "total (sync)  <- each" in text
    mer = wf.render("mermaid")
    assert mer.startswith("flowchart TD") and "each --> total" in mer and "items --> each" in mer
    dot = wf.render("dot")
    assert dot.startswith('digraph "render-me" {') and '"each" -> "total";' in dot and dot.rstrip().endswith("}")
    with pytest.raises(WorkflowError):
        wf.render("svg")


# ------------------------------------------------------------------------------------------- executor
def test_independent_steps_overlap_in_time():
    wf = fr.Workflow("w")

    @wf.step
    async def a():
        await anyio.sleep(0.4)
        return time.perf_counter()

    @wf.step
    async def b():
        await anyio.sleep(0.4)
        return time.perf_counter()

    @wf.step
    def c():  # sync: runs in a worker thread, concurrently too
        time.sleep(0.4)
        return threading.current_thread() is not threading.main_thread()

    @wf.step
    def d():
        time.sleep(0.4)
        return 1

    t0 = time.perf_counter()
    r = wf.run()
    elapsed = time.perf_counter() - t0
    assert r.ok and r.outputs["c"] is True
    assert elapsed < 1.1, elapsed  # one after another: 1.6 s
    spans = {s.name: s for s in r.tracer.step_spans()}
    assert spans["a"].start_ns < spans["b"].end_ns and spans["b"].start_ns < spans["a"].end_ns


def test_failure_is_isolated_dependents_skipped_others_finish():
    wf = fr.Workflow("w")

    @wf.step
    def source():
        return [1, 2, 3]

    @wf.step
    def broken(source):
        raise ValueError("bad data in source")

    @wf.step
    def after_broken(broken):
        return "never"

    @wf.step
    def deeper(after_broken):
        return "never"

    @wf.step
    async def fine(source):
        await anyio.sleep(0.05)
        return sum(source)

    r = run(wf)
    assert not r.ok
    assert r.outputs == {"source": [1, 2, 3], "fine": 6}
    err = r.errors["broken"]
    assert err.kind == "failed" and err.message == "ValueError: bad data in source"
    assert "raise ValueError" in err.traceback and "def broken" not in err.message
    assert r.errors["after_broken"].kind == "skipped" and "'broken'" in r.errors["after_broken"].message
    assert r.errors["deeper"].kind == "skipped" and "'after_broken'" in r.errors["deeper"].message
    assert r.stats["steps_failed"] == 1 and r.stats["steps_skipped"] == 2 and r.stats["steps_completed"] == 2
    d = json.loads(r.to_json())
    assert set(d) == {"outputs", "errors", "stats"}
    assert d["errors"]["broken"] == "ValueError: bad data in source"
    with pytest.raises(fr.StepFailed, match="broken"):
        r["after_broken"]
    with pytest.raises(fr.StepFailed, match="bad data"):
        r.raise_for_errors()


def test_retries():
    wf = fr.Workflow("w")
    calls = {"flaky": 0, "always": 0}

    @wf.step(retries=2)
    def flaky():
        calls["flaky"] += 1
        if calls["flaky"] < 3:
            raise ConnectionError(f"try {calls['flaky']}")
        return "third time lucky"

    @wf.step(retries=1, retry_delay=0.01)
    async def always():
        calls["always"] += 1
        raise RuntimeError("nope")

    r = run(wf)
    assert r.outputs == {"flaky": "third time lucky"}
    assert calls == {"flaky": 3, "always": 2}
    assert r.errors["always"].message == "RuntimeError: nope (after 2 attempts)"
    assert r.errors["always"].attempts == 2
    attempts = [s.args["attempt"] for s in r.tracer.step_spans() if s.name == "flaky"]
    assert attempts == [1, 2, 3]


def test_timeouts_async_and_sync():
    wf = fr.Workflow("w")

    @wf.step(timeout=0.2)
    async def slow():
        await anyio.sleep(10)

    @wf.step(timeout=0.2)
    def slow_sync():
        time.sleep(1.5)  # abandoned in its worker thread
        return "late"

    @wf.step(timeout=5)
    async def quick():
        return "ok"

    t0 = time.perf_counter()
    r = run(wf)
    assert time.perf_counter() - t0 < 1.0
    assert r.outputs == {"quick": "ok"}
    assert r.errors["slow"].kind == "timeout" and "timed out after 0.2s" in r.errors["slow"].message
    assert r.errors["slow_sync"].kind == "timeout"


def test_timeout_then_retry_succeeds():
    wf = fr.Workflow("w")
    n = {"k": 0}

    @wf.step(timeout=0.1, retries=1)
    async def sometimes_slow():
        n["k"] += 1
        if n["k"] == 1:
            await anyio.sleep(5)
        return n["k"]

    r = run(wf)
    assert r.outputs == {"sometimes_slow": 2}


def test_map_runs_items_concurrently_and_keeps_order():
    wf = fr.Workflow("w")

    @wf.step
    def items(n: int):
        return list(range(n))

    @wf.step(map="items")
    async def square(items: int, offset: int = 0):
        await anyio.sleep(0.3 - 0.02 * items)  # later items finish first (1.5 s one after another)
        return items * items + offset

    @wf.step
    def total(square):
        return sum(square)

    t0 = time.perf_counter()
    r = run(wf, n=6, offset=1)
    assert time.perf_counter() - t0 < 0.9
    assert r.outputs["square"] == [1, 2, 5, 10, 17, 26]
    assert r.outputs["total"] == 61
    names = sorted(s.name for s in r.tracer.step_spans() if s.name.startswith("square"))
    assert names == [f"square[{i}]" for i in range(6)]


def test_map_limits_concurrency_and_fails_on_a_bad_item():
    wf = fr.Workflow("w")
    live = {"now": 0, "peak": 0}

    @wf.step(map="xs", max_concurrency=2)
    async def limited(xs):
        live["now"] += 1
        live["peak"] = max(live["peak"], live["now"])
        await anyio.sleep(0.03)
        live["now"] -= 1
        return xs

    @wf.step(map="xs")
    def picky(xs):
        if xs == 3:
            raise ValueError("three is bad")
        return xs

    @wf.step
    def word() -> str:
        return "abc"

    @wf.step(map="word")
    def not_a_list(word: str):  # a step's result that is not a list fails the mapped step alone
        return word

    r = run(wf, xs=[1, 2, 3, 4, 5])
    assert r.outputs["limited"] == [1, 2, 3, 4, 5] and live["peak"] == 2
    assert r.errors["picky"].message.startswith("ValueError: three is bad") and "(item 2)" in r.errors["picky"].message
    assert "must be a list" in r.errors["not_a_list"].message


def test_map_over_empty_list():
    wf = fr.Workflow("w")

    @wf.step(map="xs")
    def f(xs):
        return xs

    assert run(wf, xs=[]).outputs["f"] == []


def test_resources_injected_by_type_or_name_and_missing_resource_skips():
    wf = fr.Workflow("w")

    class FakeModel(fr.Model):
        def __init__(self):  # no engine needed for injection
            pass

    fake = FakeModel()

    @wf.step
    def uses_model(llm: fr.Model):
        return llm is fake

    @wf.step
    def by_name(llm):
        return llm is fake

    @wf.step
    def needs_retriever(retriever, q: str = "x"):
        return "never"

    @wf.step
    def independent():
        return 1

    assert wf.resources == ["llm", "retriever"]
    assert "retriever" not in wf.inputs and "llm" not in wf.inputs
    rt = fr.Runtime(resources={"llm": fake})
    r = anyio.run(lambda: rt.run(wf))
    assert r.outputs == {"uses_model": True, "by_name": True, "independent": 1}
    assert r.errors["needs_retriever"].kind == "skipped"
    assert "resource 'retriever' is unavailable" in r.errors["needs_retriever"].message
    assert "--index" in r.errors["needs_retriever"].message


def test_string_annotations_still_inject(tmp_path):
    src = tmp_path / "wf_str_ann.py"
    src.write_text(
        "from __future__ import annotations\n"
        "import flowrt as fr\n"
        "wf = fr.Workflow('s')\n"
        "@wf.step\n"
        "def a(llm: fr.Model, x: int) -> int:\n"
        "    return x\n")
    from flowrt.graph.loader import load_workflow

    wf = load_workflow(src)
    assert wf.steps["a"].resources == ["llm"] and list(wf.inputs) == ["x"]


def test_result_json_handles_odd_values():
    from dataclasses import dataclass

    @dataclass
    class P:
        a: int
        b: set

    wf = fr.Workflow("w")

    @wf.step
    def odd():
        return {"p": P(1, {2, 1}), "t": (1, 2), "f": float("nan"), "o": object}

    d = json.loads(run(wf).to_json())
    assert d["outputs"]["odd"]["p"] == {"a": 1, "b": [1, 2]} and d["outputs"]["odd"]["t"] == [1, 2]
    assert d["outputs"]["odd"]["f"] == "nan"


def test_many_runs_share_one_runtime_concurrently():
    wf = fr.Workflow("w")

    @wf.step
    async def slow(x: int):
        await anyio.sleep(0.3)
        return x

    async def main():
        rt = fr.Runtime()
        results = await fr.gather(*(rt.run(wf, x=i) for i in range(5)))
        return [r.outputs["slow"] for r in results]

    t0 = time.perf_counter()
    assert anyio.run(main) == [0, 1, 2, 3, 4]
    assert time.perf_counter() - t0 < 0.9  # one after another: 1.5 s


def test_gather_order_errors_and_return_exceptions():
    async def val(x, d):
        await anyio.sleep(d)
        return x

    async def boom():
        await anyio.sleep(0.01)
        raise KeyError("k")

    async def main():
        assert await fr.gather(val(1, 0.05), val(2, 0.0), val(3, 0.02)) == [1, 2, 3]
        assert await fr.gather(val(i, 0) for i in range(3)) == [0, 1, 2]  # an iterable works too
        assert await fr.gather() == []
        with pytest.raises(KeyError):
            await fr.gather(val(1, 1.0), boom())  # the slow one is cancelled, the error is itself
        out = await fr.gather(val(1, 0), boom(), return_exceptions=True)
        assert out[0] == 1 and isinstance(out[1], KeyError)
        with pytest.raises(TypeError, match="not awaitable"):
            await fr.gather(val(1, 0), 5)

    t0 = time.perf_counter()
    anyio.run(main)
    assert time.perf_counter() - t0 < 0.5
