"""Tracing: every step and every LLM call of a run becomes a span; spans export to Chrome trace JSON
(the format chrome://tracing and https://ui.perfetto.dev open).

Layout of the exported trace: process 1 holds the workflow steps, process 2 the LLM calls. Spans that
overlap in time are put on different rows ("lanes"), so a step that fans out eight generations shows
eight parallel rows. Each LLM span carries its step, kind (gen / stream / select / prefill),
``prompt_tokens``, ``tokens_computed`` (prefill work actually done), ``cached_tokens`` (prompt tokens whose
KV was reused), of which ``prefix_cache_hit_tokens`` came from the prefix cache (the rest were already in
the thread's own sequence), and ``generated_tokens``; its ``thread_id``, ``output`` text (long ones shortened,
flowrt.render.clip) and prompt text (``Span.prompt_text``, decoded when asked) are what the run viewer shows
(flowrt.ui). Process 3 holds the lookups of ``fr.Cache`` steps (``result``: hit or miss;
flowrt.runner.step_cache). Counter tracks record the engine's KV blocks in use after each LLM call. ``forks``
lists the thread forks of the run (parent, children, the tokens they share), for the viewer's fork tree; they
are not part of the Chrome trace.
"""

from __future__ import annotations

import json
import os
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

__all__ = ["Tracer", "Span", "Fork", "LLM_TOTAL_KEYS"]


_PIDS = {"step": 1, "llm": 2, "cache": 3}
_PROCESS_NAMES = {1: "workflow steps", 2: "LLM calls", 3: "step cache"}
LLM_TOTAL_KEYS = ("prompt_tokens", "tokens_computed", "cached_tokens", "prefix_cache_hit_tokens", "generated_tokens")



@dataclass
class Span:
    name: str
    cat: str
    start_ns: int
    end_ns: int | None = None
    args: dict[str, Any] = field(default_factory=dict)
    lane: int = 0
    # an LLM call's prompt text, decoded when asked (the run viewer's record; not in the Chrome trace)
    prompt_text: Callable[[], str] | None = field(default=None, repr=False)

    @property
    def duration_s(self) -> float:
        return ((self.end_ns or time.perf_counter_ns()) - self.start_ns) / 1e9


@dataclass
class Fork:
    """``parent`` thread forked into ``children`` sharing its first ``tokens`` tokens (copy-on-write KV)."""

    step: str | None
    parent: int
    children: list[int]
    tokens: int
    time_s: float


class Tracer:
    """Collects spans of one run (thread-safe: sync steps run in worker threads)."""

    def __init__(self, stats_fn: Callable[[], dict[str, Any]] | None = None) -> None:
        self._t0 = time.perf_counter_ns()
        self._wall0 = time.time()
        self._lock = threading.Lock()
        self.spans: list[Span] = []
        self._counters: list[tuple[int, str, dict[str, Any]]] = []
        self._busy_lanes: dict[str, set[int]] = {"step": set(), "llm": set()}
        self.stats_fn = stats_fn
        self.llm_totals: dict[str, int] = {"llm_calls": 0, **{k: 0 for k in LLM_TOTAL_KEYS}}
        self.forks: list[Fork] = []

    # ------------------------------------------------------------------ recording
    def _take_lane(self, cat: str) -> int:
        busy = self._busy_lanes.setdefault(cat, set())
        lane = 0
        while lane in busy:
            lane += 1
        busy.add(lane)
        return lane

    def start(self, name: str, cat: str, **args: Any) -> Span:
        with self._lock:
            span = Span(name, cat, time.perf_counter_ns(), args=dict(args), lane=self._take_lane(cat))
            self.spans.append(span)
        return span

    def end(self, span: Span, **args: Any) -> None:
        with self._lock:
            if span.end_ns is not None:
                return
            span.end_ns = time.perf_counter_ns()
            span.args.update(args)
            self._busy_lanes.get(span.cat, set()).discard(span.lane)
            if span.cat == "llm" and span.args.get("kind") != "failed":
                self.llm_totals["llm_calls"] += 1
                for k in LLM_TOTAL_KEYS:
                    v = span.args.get(k)
                    if isinstance(v, int):
                        self.llm_totals[k] += v
        if span.cat == "llm" and self.stats_fn is not None:
            try:
                st = self.stats_fn()
            except Exception:  # noqa: BLE001 - stats are best-effort
                st = None
            if st:
                with self._lock:
                    self._counters.append((span.end_ns, "KV blocks", {
                        "used": st.get("kv_blocks_used", 0), "shared": st.get("kv_blocks_shared", 0)}))

    def fork(self, step: str | None, parent: int, children: list[int], tokens: int) -> None:
        """Record a thread fork (``Thread.fork``)."""
        with self._lock:
            self.forks.append(Fork(step, parent, list(children), tokens,
                                   (time.perf_counter_ns() - self._t0) / 1e9))

    @contextmanager
    def span(self, name: str, cat: str = "step", **args: Any) -> Iterator[Span]:
        s = self.start(name, cat, **args)
        try:
            yield s
        except BaseException as e:
            s.args.setdefault("error", f"{type(e).__name__}: {e}")
            raise
        finally:
            self.end(s)

    # ------------------------------------------------------------------ export
    def to_chrome(self) -> dict[str, Any]:
        """The trace as a Chrome trace-format object ({"traceEvents": [...]}); times in microseconds."""
        pid_os = os.getpid()
        events: list[dict[str, Any]] = []
        lanes: dict[int, set[int]] = {}
        with self._lock:
            spans = list(self.spans)
            counters = list(self._counters)
        now = time.perf_counter_ns()
        for s in spans:
            pid = _PIDS.get(s.cat, 4)
            lanes.setdefault(pid, set()).add(s.lane)
            end = s.end_ns if s.end_ns is not None else now
            args = {k: _jsonable(v) for k, v in s.args.items()}
            if s.end_ns is None:
                args["unfinished"] = True
            events.append({"name": s.name, "cat": s.cat, "ph": "X", "pid": pid, "tid": s.lane,
                           "ts": (s.start_ns - self._t0) / 1000.0, "dur": max(0.0, (end - s.start_ns) / 1000.0),
                           "args": args})
        for ts, name, values in counters:
            events.append({"name": name, "ph": "C", "pid": _PIDS["llm"], "tid": 0,
                           "ts": (ts - self._t0) / 1000.0, "args": values})
        meta: list[dict[str, Any]] = []
        for pid, tids in sorted(lanes.items()):
            meta.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0,
                         "args": {"name": _PROCESS_NAMES.get(pid, "other")}})
            meta.append({"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
            for tid in sorted(tids):
                meta.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                             "args": {"name": f"lane {tid}"}})
        events.sort(key=lambda e: e["ts"])
        return {"traceEvents": meta + events, "displayTimeUnit": "ms",
                "otherData": {"generator": "flowrt", "os_pid": pid_os, "start_unix_time": self._wall0}}

    def save(self, path: str | os.PathLike[str]) -> None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_chrome(), f)

    def step_spans(self) -> list[Span]:
        return [s for s in self.spans if s.cat == "step"]

    def llm_spans(self) -> list[Span]:
        return [s for s in self.spans if s.cat == "llm"]


def _jsonable(v: Any) -> Any:
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    return repr(v)
