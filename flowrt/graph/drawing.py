"""Drawing a workflow: ``render(wf, "text" | "mermaid" | "dot")`` (``flowrt graph``, ``wf.render``).

Mermaid and dot are one walk over the graph (``_draw``) in two dialects. A subgraph step
(``wf.step(sub)``) is drawn as a cluster holding its own steps: an edge into it goes to the inner steps
that take that input, an edge out of it leaves from its result step.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .workflow import Step, Workflow

__all__ = ["render", "step_label"]


def render(wf: Workflow, fmt: str = "text") -> str:
    from .workflow import WorkflowError

    if fmt == "text":
        return "\n".join(_text(wf))
    if fmt in _DIALECTS:
        return _DIALECTS[fmt](wf).draw()
    raise WorkflowError(f"unknown graph format {fmt!r} (use text, mermaid or dot)")


def step_label(s: Step) -> str:
    """``name (map items; retries 2; uses llm; async)``; a subgraph step: ``name (subgraph sub)``."""
    if s.sub is not None:
        return f"{s.name} (subgraph {s.sub.name})"
    bits = []
    if s.map:
        bits.append(f"map {s.map}")
    if s.retries:
        bits.append(f"retries {s.retries}")
    if s.timeout:
        bits.append(f"timeout {s.timeout:g}s")
    if s.resources:
        bits.append("uses " + ", ".join(s.resources))
    if s.routes and s.max_visits != 25:
        bits.append(f"max_visits {s.max_visits}")
    bits.append("async" if s.is_async else "sync")
    return f"{s.name} ({'; '.join(bits)})"


def _text(wf: Workflow, indent: str = "") -> list[str]:
    lines = [f"{indent}workflow {wf.name}"]
    specs = wf.inputs
    if specs:
        lines.append(f"{indent}inputs: " + ", ".join(n + ("" if sp.required else "?") for n, sp in specs.items()))
    lines.append(f"{indent}steps:")
    for name in wf.order():
        s = wf.steps[name]
        srcs = list(dict.fromkeys([p.name for p in s.params if not p.resource] + list(s.after)))
        arrow = f"  <- {', '.join(srcs)}" if srcs else ""
        lines.append(f"{indent}  {step_label(s)}{arrow}")
        if s.sub is not None:
            lines += _text(s.sub, indent + "    | ")
    routes = wf.route_edges()
    if routes:
        lines.append(f"{indent}routes (conditional, dashed):")
        lines += [f"{indent}  {u} -.-> {v}" + (" (loop)" if loop else "") for u, v, loop in routes]
    sinks = wf.sinks()
    if sinks:
        lines.append(f"{indent}results: " + ", ".join(sinks))
    return lines


def _entries(wf: Workflow, path: str, step: str, param: str | None) -> list[str]:
    """The paths of the steps an edge into ``step`` reaches: the step itself, or in a subgraph the inner
    steps that take ``param`` (all its first steps for an ordering or route edge)."""
    s = wf.steps[step]
    if s.sub is None:
        return [path + step]
    sub, inner = s.sub, path + step + "/"
    if param is not None and param in sub.inputs:
        names = list(sub.inputs[param].steps)
    else:
        names = [n for n in sub.order() if not sub.steps[n].deps and not sub.steps[n].gates]
    return [e for n in names for e in _entries(sub, inner, n, param)]


def _exit(wf: Workflow, path: str, step: str) -> str:
    """The path an edge out of ``step`` leaves from (a subgraph's result step)."""
    s = wf.steps[step]
    if s.sub is None:
        return path + step
    output = getattr(s.fn, "output", None) or s.sub.sinks()[0]
    return _exit(s.sub, path + step + "/", output)


class _Draw(ABC):
    """One walk over the graph; the dialects say how a node, an edge and a cluster are written."""

    def __init__(self, wf: Workflow) -> None:
        self.wf = wf
        self.lines: list[str] = []

    @abstractmethod
    def header(self) -> list[str]: ...

    @abstractmethod
    def footer(self) -> list[str]: ...

    @abstractmethod
    def input_node(self, n: str) -> str: ...

    @abstractmethod
    def step_node(self, path: str, label: str) -> str: ...

    @abstractmethod
    def open_cluster(self, path: str, label: str) -> str: ...

    @abstractmethod
    def close_cluster(self) -> str: ...

    @abstractmethod
    def edge(self, u: str, v: str, order_only: bool) -> str: ...

    @abstractmethod
    def route(self, u: str, v: str, loop: bool) -> str: ...

    def draw(self) -> str:
        self.lines = self.header()
        self.nodes(self.wf, "", "  ")
        self.edges(self.wf, "")
        self.lines += self.footer()
        return "\n".join(self.lines)

    def nodes(self, wf: Workflow, path: str, pad: str) -> None:
        for n, data in wf._graph.nodes(data=True):
            if data.get("kind") == "input":
                if not path:   # a subgraph's inputs come from the parent's edges
                    self.lines.append(pad + self.input_node(n))
            elif wf.steps[n].sub is not None:
                self.lines.append(pad + self.open_cluster(path + n, step_label(wf.steps[n])))
                self.nodes(wf.steps[n].sub, path + n + "/", pad + "  ")   # type: ignore[arg-type]
                self.lines.append(pad + self.close_cluster())
            else:
                self.lines.append(pad + self.step_node(path + n, step_label(wf.steps[n])))

    def edges(self, wf: Workflow, path: str) -> None:
        for u, v, data in wf._graph.edges(data=True):
            if data.get("route"):
                continue
            if u not in wf.steps:
                if path:   # a subgraph's input: drawn as the parent's edge into the cluster
                    continue
                src = u
            else:
                src = _exit(wf, path, u)
            for dst in _entries(wf, path, v, None if data.get("order_only") else u):
                self.lines.append("  " + self.edge(src, dst, bool(data.get("order_only"))))
        for u, v, loop in wf.route_edges():
            for dst in _entries(wf, path, v, None):
                self.lines.append("  " + self.route(_exit(wf, path, u), dst, loop))
        for n in wf.order():
            if wf.steps[n].sub is not None:
                self.edges(wf.steps[n].sub, path + n + "/")   # type: ignore[arg-type]


class _Mermaid(_Draw):
    @staticmethod
    def id(path: str) -> str:
        return path.replace("/", "__")

    @staticmethod
    def text(t: str) -> str:
        return t.replace('"', "#quot;")

    def header(self) -> list[str]:
        return ["flowchart TD"]

    def footer(self) -> list[str]:
        return []

    def input_node(self, n: str) -> str:
        return f'{n}[/"{self.text(n)}"/]'

    def step_node(self, path: str, label: str) -> str:
        return f'{self.id(path)}["{self.text(label)}"]'

    def open_cluster(self, path: str, label: str) -> str:
        return f'subgraph {self.id(path)}["{self.text(label)}"]'

    def close_cluster(self) -> str:
        return "end"

    def edge(self, u: str, v: str, order_only: bool) -> str:
        return f"{self.id(u)} {'-.->' if order_only else '-->'} {self.id(v)}"

    def route(self, u: str, v: str, loop: bool) -> str:
        return f"{self.id(u)} -. {'loop' if loop else 'route'} .-> {self.id(v)}"


class _Dot(_Draw):
    @staticmethod
    def q(t: str) -> str:
        return '"' + t.replace("\\", "\\\\").replace('"', '\\"') + '"'

    def header(self) -> list[str]:
        return [f"digraph {self.q(self.wf.name)} {{", "  rankdir=TB;"]

    def footer(self) -> list[str]:
        return ["}"]

    def input_node(self, n: str) -> str:
        return f"{self.q(n)} [shape=parallelogram];"

    def step_node(self, path: str, label: str) -> str:
        return f"{self.q(path)} [shape=box, label={self.q(label)}];"

    def open_cluster(self, path: str, label: str) -> str:
        return f"subgraph {self.q('cluster_' + path)} {{ label={self.q(label)};"

    def close_cluster(self) -> str:
        return "}"

    def edge(self, u: str, v: str, order_only: bool) -> str:
        return f"{self.q(u)} -> {self.q(v)}{' [style=dashed]' if order_only else ''};"

    def route(self, u: str, v: str, loop: bool) -> str:
        return (f"{self.q(u)} -> {self.q(v)} [style=dashed, label={self.q('loop' if loop else 'route')}"
                f"{', constraint=false' if loop else ''}];")


_DIALECTS: dict[str, type[_Draw]] = {"mermaid": _Mermaid, "dot": _Dot}
