"""Layering and the typed contract between the layers (DESIGN.md, "Layers and layout": it lives in the shared/
folder beside the repository, ../shared/DESIGN.md from its root).

Dependencies point one way: flowrt (runtime) -> engine -> kernels. Importing ``flowrt.engine`` or
``flowrt.kernels`` must not load the runtime above them (``flowrt/__init__`` imports lazily); engine/ and
kernels/ never import the runtime's modules; the runtime talks to the engine through ``EngineClient``.
"""

from __future__ import annotations

import ast
import functools
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from support import ROOT

MODEL = str(ROOT / "tests" / "models" / "stories260K")

# What the engine / kernels must not load: the runtime, its third-party dependencies, the server's.
RUNTIME_MODULES = ["flowrt.runner.executor", "flowrt.llm.thread", "flowrt.graph.workflow", "flowrt.llm.model",
                   "flowrt.runner.runtime", "flowrt.runner.trace", "flowrt.aio", "flowrt.cli.commands", "flowrt.server",
                   "networkx", "anyio", "fastapi"]


def _loaded_after(*steps: str) -> list[list[str]]:
    """Runs the code ``steps`` one after the other in one fresh interpreter: for each, the modules of
    RUNTIME_MODULES in sys.modules once it has run."""
    report = f"print(json.dumps(sorted(m for m in {RUNTIME_MODULES!r} if m in sys.modules)))"
    lines = ["import json, sys"]
    for code in steps:
        lines += [textwrap.dedent(code), report]
    proc = subprocess.run([sys.executable, "-c", "\n".join(lines)], capture_output=True, text=True, cwd=ROOT,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in proc.stdout.strip().splitlines()[-len(steps):]]


@pytest.mark.slow  # a fresh interpreter that imports torch: seconds
def test_import_kernels_then_engine_loads_only_them():
    """The kernels alone first, then the engine on top, in one interpreter (a fresh one costs torch's import)."""
    kernels, engine = _loaded_after("import flowrt.kernels",
                                    "import flowrt.engine\nfrom flowrt.engine import AsyncLLM, EngineClient")
    assert kernels == [], "flowrt.kernels loaded the runtime"
    assert engine == [], "flowrt.engine loaded the runtime"


def test_import_flowrt_is_lazy_and_every_public_name_resolves():
    assert _loaded_after("import flowrt") == [[]]
    import flowrt as fr

    assert fr.Workflow.__module__ == "flowrt.graph.workflow"
    assert fr.Model.__module__ == "flowrt.llm.model"
    for name in fr.__all__:
        if name in ("Retriever", "rag"):  # flowrt.retrieval needs the optional retrieval extra
            continue
        assert getattr(fr, name) is not None, name
    assert set(fr.__all__) <= set(dir(fr))
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        fr.nope  # noqa: B018
    from flowrt import Runtime, Thread  # from-imports go through the lazy __getattr__ too

    assert Runtime.__name__ == "Runtime" and Thread.__name__ == "Thread"


def test_a_workflow_without_a_model_does_not_load_the_engine(tmp_path):
    """The runtime (checkpoints, replica takeover) imports flowrt.engine only when a model is used: a script
    whose steps call no model must not pay torch's import."""
    code = textwrap.dedent("""
        import asyncio, sys
        import flowrt as fr

        wf = fr.Workflow("no-model")

        @wf.step
        def hello() -> str:
            return "hi"

        async def main():
            async with fr.Runtime(checkpoint=sys.argv[1]) as rt:
                assert (await rt.run(wf)).outputs["hello"] == "hi"

        asyncio.run(main())
        assert "flowrt.engine" not in sys.modules and "torch" not in sys.modules, "engine loaded"
    """)
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "runs.db")], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr


def _imports(path: Path, package: str) -> list[tuple[int, str]]:
    """(line, absolute module) of every import in a file of ``package`` (``from X import name`` counts as
    X.name too, since name may be a submodule)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    parts = package.split(".")  # relative imports resolve against the file's package (level 1 = it)
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            out.append((node.lineno, base))
            out += [(node.lineno, f"{base}.{a.name}") for a in node.names]
    return out


@pytest.mark.parametrize("folder,allowed", [
    ("engine", ("flowrt.engine", "flowrt.kernels")),
    ("kernels", ("flowrt.kernels",)),
])
def test_lower_layers_never_import_the_runtime(folder, allowed):
    root = ROOT / folder
    bad = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        package = ".".join(["flowrt", folder, *rel.parent.parts])
        for line, mod in _imports(path, package):
            if mod == "flowrt" or not mod.startswith("flowrt."):
                continue  # third-party, or `from flowrt import kernels` (checked as flowrt.kernels)
            top = ".".join(mod.split(".")[:2])
            if top not in allowed:
                bad.append(f"{folder}/{rel}:{line}: {mod}")
    assert not bad, "lower layers import the runtime:\n" + "\n".join(bad)


def test_import_check_sees_relative_imports():
    # The static check above resolves relative imports (a `from ....llm import thread` in engine/model/models
    # would be flowrt.llm.thread).
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "m.py"
        p.write_text("from ....llm import thread\nfrom ...cpu import ops\nfrom flowrt import kernels\n")
        mods = {m for _, m in _imports(p, "flowrt.engine.model.models")}
    assert {"flowrt.llm.thread", "flowrt.engine.cpu.ops", "flowrt.kernels"} <= mods


@pytest.mark.parametrize("name", ["thread.py", "chat.py"])
def test_thread_uses_only_models_public_surface(name):
    """Thread / ChatThread call ``Model``'s public methods, never its private ones or the engine behind it."""
    tree = ast.parse((ROOT / "flowrt" / "llm" / name).read_text(encoding="utf-8"))
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and node.value.attr == "model":
            if node.attr.startswith("_") or node.attr == "engine":
                bad.append(f"{name}:{node.lineno}: .model.{node.attr}")
    assert not bad, bad



# ------------------------------------------------------------------------------- flowrt/: folders, no circles
def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _load_time_imports(body: list[ast.stmt]):
    """The import statements Python runs when the module is imported: at module level and in class bodies,
    ``if`` / ``try`` blocks included, ``if TYPE_CHECKING:`` left out; imports inside functions are not."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If):
            if not _is_type_checking(node.test):
                yield from _load_time_imports(node.body)
            yield from _load_time_imports(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, *(h.body for h in node.handlers), node.orelse, node.finalbody):
                yield from _load_time_imports(block)
        elif isinstance(node, ast.ClassDef):
            yield from _load_time_imports(node.body)


def flowrt_import_graph(root: Path, folder: str = "flowrt", package: str = "flowrt") -> dict[str, set[str]]:
    """module -> the modules of ``folder`` (the package ``package``) it imports when it is imported (``from P
    import name`` counts P, and P.name when that is a module; a package's ``__init__`` is a module of its own)."""
    files = {}
    for path in sorted((root / folder).rglob("*.py")):
        parts = [*package.split("."), *path.relative_to(root / folder).with_suffix("").parts]
        is_pkg = parts[-1] == "__init__"
        files[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    graph: dict[str, set[str]] = {}
    for module, (path, is_pkg) in files.items():
        package = module if is_pkg else module.rpartition(".")[0]
        deps: set[str] = set()
        for node in _load_time_imports(ast.parse(path.read_text(encoding="utf-8")).body):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                names = [base, *(f"{base}.{a.name}" for a in node.names)]
            deps |= {n for n in names if n in files and n != module}
        graph[module] = deps
    return graph


@functools.cache
def repo_import_graph(folder: str = "flowrt", package: str = "flowrt") -> dict[str, set[str]]:
    """flowrt_import_graph of this repository's ``folder``, parsed once for the tests that read it."""
    return flowrt_import_graph(ROOT, folder, package)


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(circles)


def test_no_module_of_flowrt_imports_one_that_imports_it_back():
    """Upward calls (``Workflow.run`` -> the runtime, ``Model.thread`` -> ``Thread``) import inside the function
    that needs them; nothing of flowrt/ imports, as it loads, a module that imports it back."""
    graph = repo_import_graph()
    assert {"flowrt.graph.workflow", "flowrt.llm.model", "flowrt.runner.runtime", "flowrt.context"} <= set(graph)
    assert "flowrt.context" in graph["flowrt.llm.model"] and "flowrt.context" in graph["flowrt.runner.executor"]
    assert import_circles(graph) == []


def test_import_circles_are_found():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a", "e"}, "e": {"d"}, "f": set()}
    assert import_circles(graph) == [["a", "b", "c"], ["d", "e"]]
    import tempfile

    with tempfile.TemporaryDirectory() as d:  # a package whose __init__ imports a module importing it back
        pkg = Path(d) / "flowrt" / "p"
        pkg.mkdir(parents=True)
        (pkg.parent / "__init__.py").write_text("")
        (pkg / "__init__.py").write_text("from .s import X\n")
        (pkg / "s.py").write_text("from typing import TYPE_CHECKING\nfrom . import t\nif TYPE_CHECKING:\n"
                                  "    from .u import U\nX = 1\n")
        (pkg / "t.py").write_text("def f():\n    from .s import X\n")  # inside a function: not at load
        (pkg / "u.py").write_text("from .s import X\n")  # only for the type checker: no circle
        graph = flowrt_import_graph(Path(d))
    assert graph["flowrt.p.s"] == {"flowrt.p", "flowrt.p.t"}
    assert import_circles(graph) == [["flowrt.p", "flowrt.p.s"]]


# Each folder of flowrt/ is a layer; a module imports, as it loads, only from its own layer or lower ones.
LAYERS = {
    "base": 0,  # flowrt/*.py: the public package, context, events, aio, render, worker
    "llm": 1, "replicas": 1,  # handles on an engine
    "graph": 2,  # defining workflows (their resources name fr.Model)
    "runner": 3,  # running them: builds Models, executes graphs (its RunState and Checkpointer protocol: the seam)
    "checkpoint": 4,  # saves runs: the runner's RunState, behind the runner's Checkpointer protocol
    "cli": 5, "server": 5, "ui": 5,  # front ends
}


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in LAYERS) else "base"


def test_flowrt_folders_are_layers():
    graph = repo_import_graph()
    assert {_layer(m) for m in graph} == set(LAYERS), "a folder of flowrt/ that LAYERS does not place"
    bad = [f"{m} -> {d}" for m, deps in sorted(graph.items()) for d in sorted(deps)
           if _layer(m) != _layer(d) and LAYERS[_layer(d)] >= LAYERS[_layer(m)]]
    assert not bad, "imports that go up or sideways between layers:\n" + "\n".join(bad)



# ------------------------------------------------------------------------------- engine/: folders are layers
# Each folder of engine/ is a layer (engine/*.py, the orchestration and public surface, is the top one); a module
# imports, as it loads, only from its own layer or lower ones. Upward calls import inside the function, and
# names used only in annotations import under ``if TYPE_CHECKING:``.
ENGINE_LAYERS = {
    "cpu": 0,  # the CPU kernels' build, bindings, threads, malloc tuning
    "quant": 1,  # weights kept quantized, multiplied by the CPU kernels
    "model": 2,  # attention, the network, loaders, weights, tokenizer, the runner
    "request": 3,  # sequences and their typed parts, outputs, program contexts
    "kv": 4,  # KV blocks, their manager, the cache tensor, transfer
    "decoding": 4,  # sampler, speculation, structured output
    "core": 5,  # scheduler and policy, sampling parameters, input / output processing
    "top": 6,  # engine/*.py: LLMEngine, LLM, AsyncLLM, beam search, EngineArgs, the interfaces
}


def _engine_layer(module: str) -> str:
    parts = module.split(".")  # flowrt.engine[.folder[.module]]
    return parts[2] if len(parts) > 3 or (len(parts) == 3 and parts[2] in ENGINE_LAYERS) else "top"


def _engine_upward(graph: dict[str, set[str]]) -> list[str]:
    return [f"{m} -> {d}" for m, deps in sorted(graph.items()) for d in sorted(deps)
            if _engine_layer(m) != _engine_layer(d)
            and ENGINE_LAYERS[_engine_layer(d)] >= ENGINE_LAYERS[_engine_layer(m)]]


def test_engine_folders_are_layers():
    graph = repo_import_graph("engine", "flowrt.engine")
    assert {"flowrt.engine.core.scheduler", "flowrt.engine.cpu.ops", "flowrt.engine.kv.block_pool",
            "flowrt.engine.model.runner", "flowrt.engine.decoding.sampler", "flowrt.engine.request.sequence",
            "flowrt.engine.llm_engine"} <= set(graph)
    assert "flowrt.engine.cpu.ops" in graph["flowrt.engine.quant.kernels"]  # the graph sees `from ..cpu import`
    assert {_engine_layer(m) for m in graph} == set(ENGINE_LAYERS), "a folder of engine/ ENGINE_LAYERS does not place"
    bad = _engine_upward(graph)
    assert not bad, "imports that go up or sideways between engine layers:\n" + "\n".join(bad)


def test_no_module_of_the_engine_imports_one_that_imports_it_back():
    # A module's own package is loaded before it (``from . import sibling`` names the package): no circle.
    graph = {m: {d for d in deps if not m.startswith(d + ".")}
             for m, deps in repo_import_graph("engine", "flowrt.engine").items()}
    assert "flowrt.engine.quant.dequant" in graph["flowrt.engine.quant.linear"]
    assert import_circles(graph) == []


def test_engine_layer_check_sees_an_upward_import():
    import tempfile

    with tempfile.TemporaryDirectory() as d:  # kv imports core at load (up), core imports kv (down)
        for rel, code in {"engine/__init__.py": "", "engine/kv/__init__.py": "", "engine/core/__init__.py": "",
                          "engine/kv/m.py": "from ..core.s import S\n", "engine/core/s.py": "from ..kv import m\n",
                          "engine/core/t.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                              "    from ..llm_engine import E\n"}.items():
            (Path(d) / rel).parent.mkdir(parents=True, exist_ok=True)
            (Path(d) / rel).write_text(code)
        graph = flowrt_import_graph(Path(d), "engine", "flowrt.engine")
    assert graph["flowrt.engine.kv.m"] == {"flowrt.engine.core.s"}
    assert graph["flowrt.engine.core.s"] == {"flowrt.engine.kv", "flowrt.engine.kv.m"}
    assert graph["flowrt.engine.core.t"] == set()  # only for the type checker: not a load-time import
    assert _engine_upward(graph) == ["flowrt.engine.kv.m -> flowrt.engine.core.s"]
    assert [_engine_layer(m) for m in ("flowrt.engine", "flowrt.engine.llm", "flowrt.engine.kv", "flowrt.engine.kv.m")
            ] == ["top", "top", "kv", "kv"]


def test_replicas_use_the_engines_public_api_only():
    """flowrt/replicas import names flowrt.engine exports (``__all__``), never its modules."""
    import flowrt.engine

    bad = []
    for path in sorted((ROOT / "flowrt" / "replicas").glob("*.py")):
        for line, mod in _imports(path, "flowrt.replicas"):
            if mod.startswith("flowrt.engine.") and mod.removeprefix("flowrt.engine.") not in flowrt.engine.__all__:
                bad.append(f"replicas/{path.name}:{line}: {mod}")
    assert not bad, bad


# ---------------------------------------------------------------------------------------------- the contract
def test_engine_client_protocol_members():
    from flowrt.engine import EngineClient, SequenceHandle

    members = {n for n in dir(EngineClient) if not n.startswith("_")}
    assert {"open", "generate", "stream", "abort", "shutdown", "tokenizer", "stats", "max_model_len"} <= members
    assert {"token_ids", "append", "fork", "close"} <= {n for n in dir(SequenceHandle) if not n.startswith("_")}
    assert not isinstance("a/model/path", EngineClient)
    assert not isinstance(object(), SequenceHandle)


@pytest.fixture(scope="module")
def engine():
    from flowrt.engine import AsyncLLM

    eng = AsyncLLM(model=MODEL, dtype="float32", num_kv_blocks=64, seed=0)
    yield eng
    eng.shutdown()


def test_async_llm_implements_engine_client(engine):
    import flowrt as fr
    from flowrt.engine import EngineClient, SequenceHandle

    assert isinstance(engine, EngineClient)
    seq = engine.open([1, 2, 3])
    try:
        assert isinstance(seq, SequenceHandle)
        kids = seq.fork(1)
        assert all(isinstance(k, SequenceHandle) for k in kids)
        for k in kids:
            k.close()
    finally:
        seq.close()
    rt = fr.Runtime(model=engine)  # recognised as an engine by the protocol, wrapped in an fr.Model
    assert isinstance(rt.llm, fr.Model) and rt.llm.engine is engine
    assert not isinstance(fr.Model(engine), EngineClient)  # a Model is the runtime's handle, not an engine


def test_runtime_refuses_an_object_that_is_not_an_engine():
    import flowrt as fr

    class NotAnEngine:
        def open(self, *a):  # what the old duck-typed check (hasattr(model, "open")) accepted
            return None

    with pytest.raises(TypeError, match="EngineClient"):
        fr.Runtime(model=NotAnEngine())
    rt = fr.Runtime(model=Path(MODEL))  # a path (os.PathLike) is a model path, not an engine
    assert rt.llm is None


def test_model_public_surface_on_the_engine(engine):
    import anyio

    import flowrt as fr
    from flowrt.engine import SamplingParams

    llm = fr.Model(engine)

    async def go():
        seq = llm.open_sequence(llm.encode("Once upon a time", first=True))
        try:
            out = await llm.prefill(seq, len(seq))
            assert out.outputs[0].token_ids == []
            n = len(seq)
            params = SamplingParams(max_tokens=4, temperature=0)
            out = await llm.run(seq, params, kind="gen")
            assert len(seq) == n + len(out.outputs[0].token_ids)
            assert llm.kv_text(out.outputs[0], params).startswith(out.outputs[0].text)
            outs = [o async for o in llm.stream(seq, params)]
            assert outs[-1].finished
        finally:
            seq.close()

    anyio.run(go)
