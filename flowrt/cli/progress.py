"""The live progress display of ``flowrt run`` (rich, on stderr, only on a terminal)."""

from __future__ import annotations

import time
from typing import Any, Callable

from ..runner.executor import RunObserver
from ..runner.state import StepStatus as S

__all__ = ["ProgressDisplay", "summary_line", "steps_done"]

_STYLE = {S.PENDING: "dim", S.RUNNING: "yellow", S.DONE: "green", S.FAILED: "bold red", S.SKIPPED: "magenta",
          S.INTERRUPTED: "cyan"}
_ICON = {S.PENDING: "·", S.RUNNING: "▶", S.DONE: "✓", S.FAILED: "✗", S.SKIPPED: "-", S.INTERRUPTED: "?"}


def _rates(stats: dict[str, Any], elapsed: float, gen0: int) -> dict[str, str]:
    out: dict[str, str] = {}
    if not stats:
        return out
    gen = stats.get("generated_tokens", 0) - gen0
    out["tokens/s"] = f"{gen / elapsed:.1f}" if elapsed > 0 else "-"
    nb = stats.get("num_kv_blocks") or 0
    if nb:
        out["KV"] = f"{stats.get('kv_blocks_used', 0)}/{nb} blocks ({100 * stats.get('kv_blocks_used', 0) / nb:.0f}%)"
    q = stats.get("prefix_cache_query_tokens") or stats.get("prompt_tokens") or 0
    if q:
        out["prefix-cache hits"] = f"{100 * stats.get('prefix_cache_hit_tokens', 0) / q:.0f}%"
    return out


class ProgressDisplay:
    """Context manager showing steps done / running / pending, tokens/s, KV use and prefix-cache hits."""

    def __init__(self, observer: RunObserver, stats_fn: Callable[[], dict[str, Any]], console: Any = None) -> None:
        from rich.console import Console

        self.observer = observer
        self.stats_fn = stats_fn
        self.console = console or Console(stderr=True)
        self._live: Any = None
        self._gen0: int | None = None

    def _stats(self) -> dict[str, Any]:
        try:
            return self.stats_fn() or {}
        except Exception:  # noqa: BLE001 - stats are best-effort display
            return {}

    def render(self) -> Any:
        from rich.console import Group
        from rich.table import Table
        from rich.text import Text

        ob = self.observer
        now = time.perf_counter()
        table = Table(box=None, show_header=False, pad_edge=False, padding=(0, 1))
        for name, status in ob.status.items():
            t0 = ob.started.get(name)
            t1 = ob.finished.get(name, now)
            elapsed = f"{t1 - t0:.1f}s" if t0 is not None else ""
            extra = []
            if name in ob.items:
                d, n = ob.items[name]
                extra.append(f"{d}/{n} items")
            if ob.attempts.get(name, 1) > 1:
                extra.append(f"attempt {ob.attempts[name]}")
            if name in ob.cache:   # an fr.Cache step: its result taken from the cache, or computed (and kept)
                extra.append("cached" if ob.cache[name] == "hit" else "cache miss")
            table.add_row(Text(_ICON[status], style=_STYLE[status]), Text(name, style=_STYLE[status]),
                          Text(status, style=_STYLE[status]), elapsed, ", ".join(extra))
        c = ob.counts()
        head = Text(f"{ob.workflow.name}: {c['done']} done, {c['running']} running, {c['pending']} pending"
                    + (f", {c['failed']} failed" if c["failed"] else "")
                    + (f", {c['skipped']} skipped" if c["skipped"] else "")
                    + (f", {hits} cached" if (hits := sum(v == "hit" for v in ob.cache.values())) else "")
                    + (f"  [{ob.phase}]" if getattr(ob, "phase", "") else ""), style="bold")
        stats = self._stats()
        if stats and self._gen0 is None:
            self._gen0 = stats.get("generated_tokens", 0)
        rates = _rates(stats, now - ob.t0, self._gen0 or 0)
        foot = Text("  ".join(f"{k}: {v}" for k, v in rates.items()), style="cyan") if rates else Text("")
        return Group(head, table, foot)

    def __enter__(self) -> "ProgressDisplay":
        from rich.live import Live

        self._live = Live(console=self.console, get_renderable=self.render, refresh_per_second=4,
                          transient=False, redirect_stdout=False, redirect_stderr=False)
        self._live.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._live is not None:
            self._live.refresh()
            self._live.__exit__(*exc)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def steps_done(run: dict[str, Any]) -> str:
    """"2 steps done", or with a loop (or a step that failed after running) both counts: "5 step runs, 2 steps
    done" (``stats.run.step_runs`` and ``steps_completed``)."""
    done = run.get("steps_completed", 0)
    runs = run.get("step_runs", done)
    head = f"{_count(runs, 'step run')}, " if runs != done else ""
    return f"{head}{_count(done, 'step')} done"


def summary_line(result: Any) -> str:
    """The line ``flowrt run`` ends with: steps, time, and the run's LLM calls and tokens."""
    st = result.stats
    parts = [steps_done(st)]
    if st.get("steps_failed"):
        parts.append(f"{st['steps_failed']} failed")
    if st.get("steps_skipped"):
        parts.append(f"{st['steps_skipped']} skipped")
    if "run_cache_hits" in st:
        parts.append(f"{st['run_cache_hits']} from the step cache, {st['run_cache_misses']} missed")
    line = ", ".join(parts) + f" in {st.get('elapsed_s', 0):.2f}s"
    if st.get("run_llm_calls"):
        el = st.get("elapsed_s") or 0
        gen = st.get("run_generated_tokens", 0)
        line += (f"; {st['run_llm_calls']} LLM calls, {gen} tokens generated"
                 + (f" ({gen / el:.1f} tok/s)" if el else "")
                 + f", {st.get('run_tokens_computed', 0)} prompt tokens computed, "
                 f"{st.get('run_cached_tokens', 0)} reused")
    return line
