"""Layering and the typed contract between the layers (DESIGN.md, "Layers and layout").

Dependencies point one way: flowrt (runtime) -> engine -> kernels. Importing ``flowrt.engine`` or
``flowrt.kernels`` must not load the runtime above them (``flowrt/__init__`` imports lazily); engine/ and
kernels/ never import the runtime's modules; the runtime talks to the engine through ``EngineClient``.
"""

from __future__ import annotations

import ast
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


def _loaded_after(code: str) -> list[str]:
    """Modules of RUNTIME_MODULES in sys.modules after running ``code`` in a fresh interpreter."""
    probe = "\n".join(["import json, sys", textwrap.dedent(code),
                       f"print(json.dumps(sorted(m for m in {RUNTIME_MODULES!r} if m in sys.modules)))"])
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_import_engine_loads_only_the_engine():
    assert _loaded_after("import flowrt.engine\nfrom flowrt.engine import AsyncLLM, EngineClient") == []


def test_import_kernels_loads_only_the_kernels():
    assert _loaded_after("import flowrt.kernels") == []


def test_import_flowrt_is_lazy_and_every_public_name_resolves():
    assert _loaded_after("import flowrt") == []
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
    # The static check above resolves relative imports (a `from ...llm import thread` in engine/models
    # would be flowrt.llm.thread).
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "m.py"
        p.write_text("from ...llm import thread\nfrom .. import cpu_ops\nfrom flowrt import kernels\n")
        mods = {m for _, m in _imports(p, "flowrt.engine.models")}
    assert {"flowrt.llm.thread", "flowrt.engine.cpu_ops", "flowrt.kernels"} <= mods


def test_thread_uses_only_models_public_surface():
    """Thread / ChatThread call ``Model``'s public methods, never its private ones or the engine behind it."""
    tree = ast.parse((ROOT / "flowrt" / "llm" / "thread.py").read_text(encoding="utf-8"))
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and node.value.attr == "model":
            if node.attr.startswith("_") or node.attr == "engine":
                bad.append(f"thread.py:{node.lineno}: .model.{node.attr}")
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
