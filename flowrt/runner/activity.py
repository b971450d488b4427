"""What a run did besides its results, saved with its checkpoints for the run viewer (flowrt.ui): every LLM call
by step (prompt and output text, clipped; prompt, cached and generated tokens; seconds) and the thread forks
(parent, children, the tokens and KV blocks they share), taken from the run's tracer (flowrt.runner.trace).

A resumed or forked run starts from what its stored state already holds (the calls of the steps it keeps) and
adds its own. The latest ``MAX_CALLS`` calls and ``MAX_FORKS`` forks are kept (the run's row is rewritten at
every checkpoint, so what it holds must stay bounded); ``llm_totals`` counts them all.
"""

from __future__ import annotations

from typing import Any

from ..render import clip
from .trace import LLM_TOTAL_KEYS, Tracer

__all__ = ["RunActivity", "MAX_CALLS", "MAX_FORKS"]

MAX_CALLS = 500
MAX_FORKS = 200
_CALL_KEYS = ("kind", "thread_id", *LLM_TOTAL_KEYS, "finish_reason", "output", "error")


class RunActivity:
    """The ``llm_calls``, ``forks`` and ``llm_totals`` keys of a run's checkpoint state."""

    def __init__(self, tracer: Tracer, before: dict[str, Any] | None = None) -> None:
        before = before or {}
        self.tracer = tracer
        self.calls_before: list[dict[str, Any]] = [c for calls in (before.get("llm_calls") or {}).values()
                                                   for c in calls]
        self.forks_before: list[dict[str, Any]] = list(before.get("forks") or [])
        self.totals_before: dict[str, int] = dict(before.get("llm_totals") or _sums(self.calls_before))
        self.block_size: int | None = before.get("block_size")
        self._prompts: dict[int, str] = {}   # span id -> its prompt text, clipped (each decoded once)
        # thread ids count up per process: a later execution's are numbered after the earlier ones' (a resume in a
        # fresh process starts again from 1)
        self.id_offset = max([0] + [c.get("thread_id") or 0 for c in self.calls_before]
                             + [i for f in self.forks_before for i in [f["parent"], *f["children"]]])

    def _calls(self) -> list[dict[str, Any]]:
        t = self.tracer
        out = []
        for s in t.llm_spans():
            if s.end_ns is None:
                continue
            call = {k: s.args[k] for k in _CALL_KEYS if s.args.get(k) is not None}
            if "thread_id" in call:
                call["thread_id"] += self.id_offset
            if s.prompt_text is not None:
                if id(s) not in self._prompts:
                    self._prompts[id(s)] = clip(s.prompt_text())
                call["prompt"] = self._prompts[id(s)]
            call.update(step=s.args.get("step"), seconds=round(s.duration_s, 6),
                        started=round(t._wall0 + (s.start_ns - t._t0) / 1e9, 6))
            out.append(call)
        return out

    def _block_size(self) -> int | None:
        if self.block_size is None and self.tracer.stats_fn is not None:
            try:
                self.block_size = int(self.tracer.stats_fn().get("block_size") or 0) or None
            except Exception:  # noqa: BLE001 - informative only
                self.block_size = None
        return self.block_size

    def state(self) -> dict[str, Any]:
        calls = (self.calls_before + self._calls())[-MAX_CALLS:]
        by_step: dict[str, list[dict[str, Any]]] = {}
        for c in calls:
            by_step.setdefault(c.get("step") or "", []).append(c)
        k = self.id_offset
        forks = self.forks_before + [{"step": f.step, "parent": f.parent + k, "children": [c + k for c in f.children],
                                      "tokens": f.tokens} for f in list(self.tracer.forks)]
        totals = {k: int(self.totals_before.get(k, 0)) + int(v) for k, v in self.tracer.llm_totals.items()}
        out: dict[str, Any] = {"llm_calls": by_step, "llm_totals": totals, "forks": forks[-MAX_FORKS:]}
        if forks and self._block_size():
            out["block_size"] = self.block_size
        return out


def _sums(calls: list[dict[str, Any]]) -> dict[str, int]:
    """Totals of a list of calls (a forked run's: the calls of the steps it keeps)."""
    out = {"llm_calls": len(calls)}
    for k in LLM_TOTAL_KEYS:
        out[k] = sum(int(c.get(k) or 0) for c in calls)
    return out
