"""Workflows: steps (plain async or sync functions) wired into a DAG by their parameter names.

A step's parameters name

* another step -> that step's result (an edge in the DAG),
* a resource -> injected (``llm: fr.Model``, ``retriever: fr.Retriever``; see flowrt.graph.resources),
* anything else -> a workflow input, given to ``run`` (a parameter default makes the input optional).

The graph is a networkx DiGraph, validated every time a step is added: a duplicate step, a cycle, an
unknown name (when the workflow declares its inputs), a bad ``map=`` or ``after=`` is a ``WorkflowError``
that names the culprit.
"""

from __future__ import annotations

import inspect
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import networkx as nx

from .cache import Cache
from .inputs import coerce_inputs
from .resources import match_resource, resource_kinds

__all__ = ["Workflow", "Step", "Param", "WorkflowError", "InputSpec", "SubgraphCall"]


class WorkflowError(ValueError):
    """A workflow definition or invocation is invalid (the message names what is wrong)."""


_MISSING = inspect.Parameter.empty


@dataclass(frozen=True)
class Param:
    name: str
    annotation: Any = _MISSING
    default: Any = _MISSING
    resource: str | None = None       # resource name when injected

    @property
    def has_default(self) -> bool:
        return self.default is not _MISSING


@dataclass
class Step:
    name: str
    fn: Callable[..., Any]
    params: list[Param]
    map: str | None = None             # parameter whose value (a list) the step is mapped over
    retries: int = 0
    timeout: float | None = None       # seconds, per attempt (per item for mapped steps)
    retry_delay: float = 0.0
    max_concurrency: int | None = None  # mapped steps: items in flight at once
    after: tuple[str, ...] = ()        # ordering-only dependencies (no value passed)
    is_async: bool = False
    doc: str = ""
    # filled by the workflow: names of the steps this one depends on
    deps: tuple[str, ...] = field(default=())
    routes: tuple[str, ...] = ()       # successors this step may route to (fr.goto)
    max_visits: int = 25               # most runs of this step in one run (loops)
    # filled by the workflow: forward routes into this step (it runs only when one of them chooses it) and
    # loop routes into it (routes back from a later step; their value arrives in the parameter of that name)
    gates: tuple[str, ...] = field(default=())
    loop_sources: tuple[str, ...] = field(default=())
    sub: "Workflow | None" = None      # a subgraph step: the workflow it runs (``wf.step(sub)``)
    cache: Cache | None = None         # its result cache policy (``fr.Cache``; flowrt.runner.step_cache)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Steps stay callable as the plain functions they wrap (handy in tests)."""
        return self.fn(*args, **kwargs)

    @property
    def resources(self) -> list[str]:
        return [p.resource for p in self.params if p.resource]


@dataclass(frozen=True)
class InputSpec:
    name: str
    required: bool
    annotation: Any = _MISSING
    steps: tuple[str, ...] = ()        # steps that take it


def _resolved_hints(fn: Callable[..., Any]) -> dict[str, Any]:
    target = inspect.unwrap(fn)
    try:
        return typing.get_type_hints(target)
    except Exception:  # noqa: BLE001 - unresolvable hints: fall back to none
        return {}


def _is_async_callable(fn: Callable[..., Any]) -> bool:
    if inspect.iscoroutinefunction(fn):
        return True
    call = type(fn).__call__ if callable(fn) else None  # an instance with an async __call__ is awaited too
    return call is not None and inspect.iscoroutinefunction(call)


class _Unset:
    def __repr__(self) -> str:
        return "<the subgraph's own default>"


_UNSET: Any = _Unset()


class SubgraphCall:
    """The function of a subgraph step (``wf.step(sub)``): runs ``sub`` inside the parent run (its steps
    are the parent's, under the step's path; flowrt.runner.executor.run_subgraph) and returns the result of its
    last step, or of the step named ``output``."""

    def __init__(self, sub: "Workflow", output: str | None) -> None:
        self.sub = sub
        self.output = output
        self.__name__ = sub.name

    async def __call__(self, **kwargs: Any) -> Any:
        from ..runner.executor import run_subgraph

        skip = set(self.sub.resources)
        inputs = {k: v for k, v in kwargs.items() if v is not _UNSET and k not in skip}
        return await run_subgraph(self.sub, inputs, output=self.output)

    def params(self) -> list[Param]:
        """The sub-workflow's inputs (optional ones default to its own defaults) and its resources."""
        out = [Param(n, spec.annotation, _MISSING if spec.required else _UNSET)
               for n, spec in self.sub.inputs.items()]
        return out + [Param(r, _MISSING, _MISSING, r) for r in self.sub.resources]


class Workflow:
    """A named DAG of steps.

    >>> wf = Workflow("demo")
    >>> @wf.step
    ... def double(x: int) -> int: return 2 * x
    >>> @wf.step
    ... def inc(double: int) -> int: return double + 1
    >>> wf.run(x=3).outputs["inc"]
    7
    """

    def __init__(self, name: str | None = None, *, inputs: Iterable[str] | None = None,
                 description: str = "") -> None:
        self.name = name or "workflow"
        self.description = description
        self.declared_inputs: tuple[str, ...] | None = tuple(inputs) if inputs is not None else None
        self.steps: dict[str, Step] = {}
        self._graph: nx.DiGraph = nx.DiGraph()

    def __repr__(self) -> str:
        return f"Workflow({self.name!r}, steps={list(self.steps)})"

    # ------------------------------------------------------------------ definition
    def step(self, fn: Callable[..., Any] | None = None, *, name: str | None = None, map: str | None = None,
             retries: int = 0, timeout: float | None = None, retry_delay: float = 0.0,
             max_concurrency: int | None = None, after: Iterable[str] = (), routes: Iterable[str] = (),
             max_visits: int = 25, output: str | None = None, cache: Cache | None = None) -> Any:
        """Register a step; usable as ``@wf.step`` or ``@wf.step(map="items", retries=2, timeout=30)``.

        ``map``: the name of a parameter holding a list; the step runs once per item (concurrently, at
        most ``max_concurrency`` at a time) with that parameter bound to the item, and its result is the
        list of the per-item results, in order. ``retries``: extra attempts after a failure (per item
        when mapped). ``timeout``: seconds per attempt. ``after``: steps that must finish first although
        their result is not a parameter. ``routes``: successors the step chooses among by returning
        ``fr.goto(name, value)`` (flowrt.graph.routing); a route back to an earlier step makes a loop, and
        ``max_visits`` bounds how often the step runs in one run. ``cache``: an ``fr.Cache`` (a TTL, a
        ``key`` function): a later run with the same inputs takes the step's kept result (flowrt.graph.cache).

        ``wf.step(sub, name="research")`` with a ``Workflow`` adds it as a subgraph: its inputs are matched
        by name like parameters, its steps run inside this run (events, traces and checkpoints under
        ``research/...``), and its result is its last step's (or that of the step named ``output``).
        """

        def register(f: Callable[..., Any]) -> Step:
            return self.add_step(f, name=name, map=map, retries=retries, timeout=timeout,
                                 retry_delay=retry_delay, max_concurrency=max_concurrency, after=after,
                                 routes=routes, max_visits=max_visits, output=output, cache=cache)

        if fn is not None:
            return register(fn)
        return register

    def add_step(self, fn: Callable[..., Any], *, name: str | None = None, map: str | None = None,
                 retries: int = 0, timeout: float | None = None, retry_delay: float = 0.0,
                 max_concurrency: int | None = None, after: Iterable[str] = (), routes: Iterable[str] = (),
                 max_visits: int = 25, output: str | None = None, cache: Cache | None = None) -> Step:
        if isinstance(fn, Step):
            fn = fn.fn
        if isinstance(fn, Workflow):
            fn = self._subgraph_call(fn, output)
        elif output is not None:
            raise WorkflowError(f"workflow {self.name!r}: output= is for a subgraph step (a Workflow), not {fn!r}")
        if not callable(fn):
            raise WorkflowError(f"workflow {self.name!r}: a step must be a function, got {fn!r}")
        step_name = name or getattr(fn, "__name__", None)
        if not step_name or not str(step_name).isidentifier():
            raise WorkflowError(f"workflow {self.name!r}: step name {step_name!r} is not a Python identifier")
        if step_name in self.steps:
            raise WorkflowError(f"workflow {self.name!r}: duplicate step {step_name!r} (a step of that name "
                                f"is already defined)")
        if step_name in resource_kinds():
            raise WorkflowError(f"workflow {self.name!r}: step name {step_name!r} is reserved for the "
                                f"injected resource of that name")
        if self.declared_inputs is not None and step_name in self.declared_inputs:
            raise WorkflowError(f"workflow {self.name!r}: step {step_name!r} has the name of a declared input")
        if inspect.isasyncgenfunction(fn) or inspect.isgeneratorfunction(fn):
            raise WorkflowError(f"step {step_name!r}: generator functions are not steps; return a value")
        if not isinstance(retries, int) or retries < 0:
            raise WorkflowError(f"step {step_name!r}: retries must be an int >= 0, got {retries!r}")
        if timeout is not None and not (isinstance(timeout, (int, float)) and timeout > 0):
            raise WorkflowError(f"step {step_name!r}: timeout must be a positive number of seconds, got {timeout!r}")
        if max_concurrency is not None and (not isinstance(max_concurrency, int) or max_concurrency < 1):
            raise WorkflowError(f"step {step_name!r}: max_concurrency must be an int >= 1")

        if cache is not None and not isinstance(cache, Cache):
            raise WorkflowError(f"step {step_name!r}: cache= takes an fr.Cache(ttl=..., key=...), got {cache!r}")
        params = fn.params() if isinstance(fn, SubgraphCall) else self._params(step_name, fn)
        self._check_map(step_name, params, map)
        after = tuple(after)
        routes = self._check_routes(step_name, routes, map, max_visits)
        if cache is not None and routes:
            raise WorkflowError(f"step {step_name!r}: a routing step cannot be cached (cache= and routes= together): "
                                f"its route choice is part of the run")
        step = Step(name=step_name, fn=fn, params=params, map=map, retries=retries,
                    timeout=float(timeout) if timeout is not None else None, retry_delay=float(retry_delay),
                    max_concurrency=max_concurrency, after=after, is_async=_is_async_callable(fn),
                    doc=inspect.getdoc(fn) or "", routes=routes, max_visits=max_visits,
                    sub=fn.sub if isinstance(fn, SubgraphCall) else None, cache=cache)
        if step.sub is not None:
            step.doc = step.sub.description

        old_steps = dict(self.steps)
        self.steps[step_name] = step
        try:
            self._rebuild()
        except WorkflowError:
            self.steps = old_steps
            self._rebuild()
            raise
        return step

    def _subgraph_call(self, sub: "Workflow", output: str | None) -> SubgraphCall:
        if sub is self:
            raise WorkflowError(f"workflow {self.name!r} cannot be a step of itself")
        sub.validate()
        if output is not None and output not in sub.steps:
            raise WorkflowError(f"subgraph {sub.name!r}: output={output!r} is not one of its steps "
                                f"({', '.join(sub.steps)})")
        if output is None and len(sub.sinks()) != 1:
            raise WorkflowError(f"subgraph {sub.name!r} has {len(sub.sinks())} final steps "
                                f"({', '.join(sub.sinks())}); name its result with output=")
        return SubgraphCall(sub, output)

    @staticmethod
    def _params(step_name: str, fn: Callable[..., Any]) -> list[Param]:
        try:
            sig = inspect.signature(fn)
        except (TypeError, ValueError) as e:
            raise WorkflowError(f"step {step_name!r}: cannot read its signature: {e}") from None
        hints = _resolved_hints(fn)
        params: list[Param] = []
        for p in sig.parameters.values():
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                raise WorkflowError(f"step {step_name!r}: *args/**kwargs parameters are not supported "
                                    f"(parameter {p.name!r}); name each input")
            if p.kind is p.POSITIONAL_ONLY:
                raise WorkflowError(f"step {step_name!r}: positional-only parameter {p.name!r} is not supported")
            ann = hints.get(p.name, p.annotation)
            params.append(Param(p.name, ann, p.default, match_resource(p.name, ann)))
        return params

    @staticmethod
    def _check_map(step_name: str, params: list[Param], map: str | None) -> None:
        if step_name in {p.name for p in params}:
            raise WorkflowError(f"step {step_name!r} depends on itself (it has a parameter of its own name)")
        if map is not None:
            mp = next((p for p in params if p.name == map), None)
            if mp is None:
                raise WorkflowError(f"step {step_name!r}: map={map!r} is not one of its parameters "
                                    f"({', '.join(p.name for p in params) or 'none'})")
            if mp.resource:
                raise WorkflowError(f"step {step_name!r}: map={map!r} names an injected resource")

    @staticmethod
    def _check_routes(step_name: str, routes: Iterable[str], map: str | None, max_visits: int) -> tuple[str, ...]:
        if isinstance(routes, str):
            routes = [routes]
        routes = tuple(routes)
        for r in routes:
            if not isinstance(r, str) or not r.isidentifier():
                raise WorkflowError(f"step {step_name!r}: route {r!r} is not a step name")
        if len(set(routes)) != len(routes):
            raise WorkflowError(f"step {step_name!r}: duplicate route in {list(routes)}")
        if routes and map is not None:
            raise WorkflowError(f"step {step_name!r}: a mapped step cannot route (map= and routes= together)")
        if isinstance(max_visits, bool) or not isinstance(max_visits, int) or max_visits < 1:
            raise WorkflowError(f"step {step_name!r}: max_visits must be an int >= 1, got {max_visits!r}")
        return routes

    # ------------------------------------------------------------------ graph
    def _route_sources(self, target: str) -> set[str]:
        return {s.name for s in self.steps.values() if target in s.routes}

    def _rebuild(self) -> None:
        g = nx.DiGraph()
        for s in self.steps.values():
            g.add_node(s.name, kind="step")
        declared = set(self.declared_inputs or ())
        for inp in declared:
            g.add_node(inp, kind="input")
        routed_params: dict[str, set[str]] = {}   # step -> its parameters that name a step routing to it
        for s in self.steps.values():
            deps: list[str] = []
            sources = self._route_sources(s.name)
            for p in s.params:
                if p.resource:
                    continue
                if p.name in self.steps:
                    if p.name in sources:   # the value of a route (forward or loop), wired below
                        routed_params.setdefault(s.name, set()).add(p.name)
                        continue
                    deps.append(p.name)
                    g.add_edge(p.name, s.name)
                else:
                    if self.declared_inputs is not None and p.name not in declared and not p.has_default:
                        raise WorkflowError(
                            f"step {s.name!r}: unknown name {p.name!r}: it is not a step, a declared input "
                            f"({', '.join(sorted(declared)) or 'none'}) or a resource "
                            f"({', '.join(resource_kinds())})")
                    if not g.has_node(p.name):
                        g.add_node(p.name, kind="input")
                    g.add_edge(p.name, s.name)
            for a in s.after:
                if a not in self.steps:
                    # may be defined later; checked in validate()
                    continue
                if a not in deps:
                    deps.append(a)
                g.add_edge(a, s.name, order_only=True)
            s.deps = tuple(deps)
        if not nx.is_directed_acyclic_graph(g):
            cycle = nx.find_cycle(g)
            path = " -> ".join([cycle[0][0]] + [v for _, v in cycle])
            raise WorkflowError(f"workflow {self.name!r}: cycle between steps: {path}")
        # Routes: forward where they keep the graph acyclic (routes to later-defined steps first), loops
        # (back edges) otherwise; a loop route's target runs again when chosen.
        index = {n: i for i, n in enumerate(self.steps)}
        edges = [(s.name, t) for s in self.steps.values() for t in s.routes if t in self.steps]
        edges.sort(key=lambda e: (index[e[1]] <= index[e[0]], index[e[0]]))
        back: list[tuple[str, str]] = []
        gates: dict[str, list[str]] = {}
        for u, v in edges:
            if u == v or nx.has_path(g, v, u):
                back.append((u, v))
            else:
                g.add_edge(u, v, route=True)
                gates.setdefault(v, []).append(u)
        loops: dict[str, list[str]] = {}
        for u, v in back:
            loops.setdefault(v, []).append(u)
        for s in self.steps.values():
            s.gates = tuple(gates.get(s.name, ()))
            s.loop_sources = tuple(loops.get(s.name, ()))
            for p in s.params:
                if p.name in s.loop_sources and not p.has_default:
                    raise WorkflowError(
                        f"step {s.name!r}: parameter {p.name!r} receives the value of the loop route from step "
                        f"{p.name!r} back to {s.name!r}; give it a default (its value on the first visit)")
        self._back_edges = back
        self._graph = g

    @property
    def graph(self) -> nx.DiGraph:
        """The DAG: nodes are steps (kind="step") and inputs (kind="input")."""
        return self._graph.copy()

    def validate(self) -> None:
        """Checks that need the whole workflow (raised by ``run`` before anything starts)."""
        if not self.steps:
            raise WorkflowError(f"workflow {self.name!r} has no steps")
        for s in self.steps.values():
            for a in s.after:
                if a not in self.steps:
                    raise WorkflowError(f"step {s.name!r}: after={a!r} is not a step of workflow {self.name!r}")
            for r in s.routes:
                if r not in self.steps:
                    raise WorkflowError(f"step {s.name!r}: route {r!r} is not a step of workflow {self.name!r} "
                                        f"(its steps: {', '.join(self.steps)})")
        self._rebuild()

    @property
    def has_routes(self) -> bool:
        return any(s.routes for s in self.steps.values())

    @property
    def loop_edges(self) -> list[tuple[str, str]]:
        """Routes back to an earlier step (or the step itself): (routing step, target)."""
        return list(getattr(self, "_back_edges", []))

    def route_edges(self) -> list[tuple[str, str, bool]]:
        """Every route (routing step, target, is_loop), in definition order."""
        back = set(self.loop_edges)
        return [(s.name, t, (s.name, t) in back) for s in self.steps.values() for t in s.routes if t in self.steps]

    @property
    def inputs(self) -> dict[str, InputSpec]:
        """Workflow inputs, with whether each is required (no step gives it a default)."""
        found: dict[str, list[tuple[str, Param]]] = {}
        for s in self.steps.values():
            for p in s.params:
                if not p.resource and p.name not in self.steps:
                    found.setdefault(p.name, []).append((s.name, p))
        for name in self.declared_inputs or ():
            found.setdefault(name, [])
        out = {}
        for name, uses in found.items():
            required = bool(uses) and any(not p.has_default for _, p in uses)
            if not uses and self.declared_inputs is not None:
                required = True
            ann = next((p.annotation for _, p in uses if p.annotation is not _MISSING), _MISSING)
            out[name] = InputSpec(name, required, ann, tuple(s for s, _ in uses))
        return out

    @property
    def resources(self) -> list[str]:
        """Resource names some step needs (e.g. ``["llm"]``)."""
        seen: list[str] = []
        for s in self.steps.values():
            for r in s.resources:
                if r not in seen:
                    seen.append(r)
        return seen

    def order(self) -> list[str]:
        """Steps in a topological order (ties broken by definition order)."""
        order_index = {n: i for i, n in enumerate(self.steps)}
        g = self._graph.subgraph(self.steps)
        return list(nx.lexicographical_topological_sort(g, key=lambda n: order_index[n]))

    def sinks(self) -> list[str]:
        """Steps no other step depends on (the workflow's final results)."""
        return [n for n in self.order() if not self.steps[n].routes
                and not any(v in self.steps for v in self._graph.successors(n))]

    def check_inputs(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """The inputs, validated (none unknown or missing) and converted to the steps' annotations
        (flowrt.graph.inputs); a ``WorkflowError`` naming the culprit otherwise."""
        specs = self.inputs
        unknown = [k for k in inputs if k not in specs]
        if unknown:
            raise WorkflowError(f"workflow {self.name!r}: unknown input(s) {', '.join(map(repr, unknown))}; "
                                f"its inputs are: {', '.join(specs) or 'none'}")
        missing = [n for n, spec in specs.items() if spec.required and n not in inputs]
        if missing:
            raise WorkflowError(
                f"workflow {self.name!r}: missing input(s) {', '.join(map(repr, missing))} "
                f"(needed by step(s) {', '.join(s for m in missing for s in specs[m].steps) or '-'}); "
                f"pass them as keyword arguments or `--input NAME=VALUE`")
        return coerce_inputs(self, inputs)

    # ------------------------------------------------------------------ running
    def run(self, inputs: dict[str, Any] | None = None, /, *, runtime: Any = None, **kw_inputs: Any) -> Any:
        """Run synchronously (for scripts): ``result = wf.run(question="...")``.

        Starts a fresh ``fr.Runtime`` (default model, loaded only if a step needs it) unless ``runtime``
        is given; returns a ``RunResult``. Inside a running event loop (Jupyter, async code) use
        ``await wf.arun(...)`` instead.
        """
        import asyncio

        import anyio

        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:
            raise RuntimeError(
                f"workflow {self.name!r}: wf.run() cannot be called from a running event loop (Jupyter, async "
                f"code); use `await wf.arun(...)` or `async with fr.Runtime() as rt: await rt.run(wf, ...)`")
        all_inputs = {**(inputs or {}), **kw_inputs}
        return anyio.run(lambda: self.arun(all_inputs, runtime=runtime))

    async def arun(self, inputs: dict[str, Any] | None = None, /, *, runtime: Any = None,
                   **kw_inputs: Any) -> Any:
        """``wf.run`` for async code: ``result = await wf.arun(question="...")`` (on ``runtime``, or a
        fresh ``fr.Runtime`` that is closed afterwards)."""
        from ..runner.runtime import Runtime

        all_inputs = {**(inputs or {}), **kw_inputs}
        if runtime is not None:
            return await runtime.run(self, all_inputs)
        async with Runtime() as rt:
            return await rt.run(self, all_inputs)

    # ------------------------------------------------------------------ rendering
    def render(self, fmt: str = "text") -> str:
        """The graph as text, mermaid or dot (flowrt.graph.drawing; subgraphs are clusters)."""
        from .drawing import render

        return render(self, fmt)
