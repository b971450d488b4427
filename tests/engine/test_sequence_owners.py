"""Each part of an engine Sequence has one writer (engine/request/sequence.py's module docstring).

A static check over engine/: outside a part's owning module, no statement assigns, augments or deletes the
part, one of its fields, or an item of one, directly or through a local name bound to the part, nor calls a
list-mutating method on a field; the token list changes only through Sequence's own methods.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from support import ROOT

from flowrt.engine.request import sequence

OWNERS = {"sched": "core.scheduler", "kv": "kv.cache_manager", "sample": "core.output_processor",
          "detok": "core.detokenizer", "spec": "decoding.spec_decode", "grammar": "decoding.structured_output"}
PART_TYPES = {"sched": sequence.SchedState, "kv": sequence.KVState, "sample": sequence.SampleState,
              "detok": sequence.DetokState, "spec": sequence.SpecState, "grammar": sequence.GrammarState}
FIELDS = {part: {f.name for f in dataclasses.fields(t)} for part, t in PART_TYPES.items()}
MUTATORS = {"append", "extend", "insert", "pop", "remove", "clear", "sort", "reverse", "update", "add", "discard"}


def _targets(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        out = []
        for t in node.targets:
            out.extend(t.elts if isinstance(t, (ast.Tuple, ast.List)) else [t])
        return out
    if isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        return [node.target]
    if isinstance(node, ast.Delete):
        return list(node.targets)
    return []


def _written(expr: ast.expr) -> ast.expr:
    """`a.b[i]` writes a.b."""
    while isinstance(expr, ast.Subscript):
        expr = expr.value
    return expr


def violations(source: str, module: str) -> list[str]:
    """(line: what) for each write, in a module named `module`, to a Sequence part it does not own."""
    found: set[tuple[int, str]] = set()

    def check(expr: ast.expr, aliases: dict[str, str], line: int, what: str) -> None:
        if not isinstance(expr, ast.Attribute):
            return
        base = expr.value
        if expr.attr in OWNERS and not (isinstance(base, ast.Name) and base.id == "self"):
            part, name = expr.attr, expr.attr  # seq.kv = ...
        elif isinstance(base, ast.Attribute) and base.attr in OWNERS and expr.attr in FIELDS[base.attr]:
            part, name = base.attr, f"{base.attr}.{expr.attr}"  # seq.kv.block_table = ...
        elif isinstance(base, ast.Name) and base.id in aliases and expr.attr in FIELDS[aliases[base.id]]:
            part = aliases[base.id]  # kv = seq.kv; kv.block_table = ...
            name = f"{part}.{expr.attr}"
        elif expr.attr == "token_ids":
            part, name = "", "token_ids"
        else:
            return
        if (OWNERS[part] if part else "request.sequence") != module:
            found.add((line, f"{what} {name}"))

    def visit(body: list[ast.stmt]) -> None:
        aliases: dict[str, str] = {}
        for node in (n for stmt in body for n in ast.walk(stmt)):
            if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                    and isinstance(node.value, ast.Attribute) and node.value.attr in OWNERS):
                aliases[node.targets[0].id] = node.value.attr
            for t in _targets(node):
                check(_written(t), aliases, node.lineno, "writes")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
                check(_written(node.func.value), aliases, node.lineno, f"calls {node.func.attr} on")

    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            visit(node.body)
    return [f"{line}: {what}" for line, what in sorted(found)]


def test_the_check_finds_writes_by_other_modules():
    src = """
def f(seq, kv):
    seq.kv.num_computed_tokens += 1
    del seq.kv.block_hashes[3:]
    seq.kv.block_table.append(7)
    seq.token_ids.append(1)
    sample = seq.sample
    sample.finish_reason = "stop"
    seq.grammar = None
    self.kv = kv
    n = seq.kv.num_computed_tokens
"""
    assert [v.split(": ", 1)[1] for v in violations(src, "core.scheduler")] == [
        "writes kv.num_computed_tokens", "writes kv.block_hashes", "calls append on kv.block_table",
        "calls append on token_ids", "writes sample.finish_reason", "writes grammar"]
    assert [v.split(": ", 1)[1] for v in violations(src, "kv.cache_manager")] == [
        "calls append on token_ids", "writes sample.finish_reason", "writes grammar"]


def test_no_engine_module_writes_another_modules_part_of_a_sequence():
    bad = {}
    for path in sorted((ROOT / "engine").rglob("*.py")):
        found = violations(path.read_text(), ".".join(Path(path).relative_to(ROOT / "engine").with_suffix("").parts))
        if found:
            bad[str(path.relative_to(ROOT))] = found
    assert bad == {}
