"""A workflow's drawing as positioned boxes and edges, for the viewer's SVG.

The nodes, clusters and edges are the ones ``flowrt graph`` draws (the same walk over the graph,
flowrt.graph.drawing's ``_Draw``, in a dialect that collects them instead of writing text); the layout is
layered: each node's row is its longest path from an input over the edges that are not loop routes, nodes of
a row side by side in the order the walk met them, and a subgraph step's cluster is the box around its
inner steps.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import networkx as nx

from ..graph.drawing import _Draw

if TYPE_CHECKING:
    from ..graph.workflow import Workflow

__all__ = ["Layout", "layout"]

NODE_W, NODE_H, GAP_X, GAP_Y, PAD = 190, 44, 30, 46, 14


@dataclass
class Box:
    id: str
    label: str
    kind: str          # "input", "step" or "cluster"
    x: float = 0.0
    y: float = 0.0
    w: float = NODE_W
    h: float = NODE_H


@dataclass
class Edge:
    source: str
    target: str
    kind: str          # "data", "order", "route" or "loop"


@dataclass
class Layout:
    nodes: list[Box] = field(default_factory=list)
    clusters: list[Box] = field(default_factory=list)
    edges: list[Edge] = field(default_factory=list)
    width: float = 0.0
    height: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class _Collect(_Draw):
    """The drawing walk as data: every dialect method records what it would write."""

    def __init__(self, wf: Workflow) -> None:
        super().__init__(wf)
        self.boxes: list[Box] = []
        self.clusters: list[tuple[str, str, list[str]]] = []   # (path, label, its node ids)
        self.open: list[int] = []
        self.links: list[Edge] = []

    def header(self) -> list[str]:
        return []

    footer = header

    def _node(self, box: Box) -> str:
        self.boxes.append(box)
        for i in self.open:
            self.clusters[i][2].append(box.id)
        return ""

    def input_node(self, n: str) -> str:
        return self._node(Box(n, n, "input"))

    def step_node(self, path: str, label: str) -> str:
        return self._node(Box(path, label, "step"))

    def open_cluster(self, path: str, label: str) -> str:
        self.clusters.append((path, label, []))
        self.open.append(len(self.clusters) - 1)
        return ""

    def close_cluster(self) -> str:
        self.open.pop()
        return ""

    def edge(self, u: str, v: str, order_only: bool) -> str:
        self.links.append(Edge(u, v, "order" if order_only else "data"))
        return ""

    def route(self, u: str, v: str, loop: bool) -> str:
        self.links.append(Edge(u, v, "loop" if loop else "route"))
        return ""


def layout(wf: Workflow) -> Layout:
    """``wf``'s drawing laid out in rows (see the module docstring)."""
    walk = _Collect(wf)
    walk.draw()
    g = nx.DiGraph()
    g.add_nodes_from(b.id for b in walk.boxes)
    g.add_edges_from((e.source, e.target) for e in walk.links if e.kind != "loop")
    rank: dict[str, int] = {}
    for n in nx.topological_sort(g):
        rank[n] = max((rank[p] + 1 for p in g.predecessors(n)), default=0)
    rows: dict[int, list[Box]] = {}
    for b in walk.boxes:
        rows.setdefault(rank[b.id], []).append(b)
    width = max((len(r) for r in rows.values()), default=0) * (NODE_W + GAP_X) + GAP_X
    for r, row in rows.items():
        span = len(row) * (NODE_W + GAP_X) - GAP_X
        for i, b in enumerate(row):
            b.x = (width - span) / 2 + i * (NODE_W + GAP_X)
            b.y = GAP_Y / 2 + r * (NODE_H + GAP_Y)
    by_id = {b.id: b for b in walk.boxes}
    clusters = []
    for path, label, ids in walk.clusters:
        inner = [by_id[i] for i in ids]
        if not inner:
            continue
        pad = PAD * (1 + max(c.count("/") for c in ids) - path.count("/") - 1)   # nested clusters fit inside
        x0, y0 = min(b.x for b in inner) - pad, min(b.y for b in inner) - pad - 16
        x1, y1 = max(b.x + b.w for b in inner) + pad, max(b.y + b.h for b in inner) + pad
        clusters.append(Box(path, label, "cluster", x0, y0, x1 - x0, y1 - y0))
    left, top = min([0.0] + [c.x - PAD for c in clusters]), min([0.0] + [c.y - PAD for c in clusters])
    for b in walk.boxes + clusters:   # a cluster's padding may reach past the top left corner
        b.x, b.y = b.x - left, b.y - top
    right = max([width] + [b.x + b.w + PAD for b in walk.boxes + clusters])
    bottom = max([0.0] + [b.y + b.h + GAP_Y / 2 for b in walk.boxes + clusters])
    return Layout(walk.boxes, clusters, walk.links, right, bottom)
