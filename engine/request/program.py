"""Program context: which workflow run, step and thread a request belongs to (engine/API.md).

The engine works the same without it. With ``EngineArgs(scheduling_policy="program")`` it uses it:

* ranking waiting work by the service its run already received (least-attained-service over coarse,
  exponentially growing levels, as in Autellix), the run's age, then how much of the request's prefix is
  already computed (cache-aware admission, as SGLang's longest-prefix-match), with a starvation bound;
* keeping the KV of idle sequences whose thread will be used again (``waiting``) and evicting in order of
  expected next use (KVFlow): finished threads first, then waiting ones whose return is farthest away.

This module holds the plain data (contexts, per-run records, the wait estimator); the policy itself lives
in core/sched_policy.py and core/scheduler.py, the only users of it besides the engine's entry points.
"""

from __future__ import annotations

import bisect
import enum
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

__all__ = ["ProgramContext", "ProgramState", "ProgramTracker", "RunRecord", "as_program_context"]


class ProgramState(str, enum.Enum):
    GENERATING = "generating"  # the thread's step is running model calls on it
    WAITING = "waiting"  # idle between calls: on a tool, a sibling, a gather; it will be used again
    FINISHED = "finished"  # its step is done; its KV is only worth what the prefix cache makes of it


@dataclass(frozen=True)
class ProgramContext:
    """What a request (or an open sequence) is part of. All fields are optional hints."""

    run_id: str | None = None
    step: str | None = None
    thread_id: str | int | None = None
    state: ProgramState = ProgramState.GENERATING

    def __post_init__(self) -> None:
        object.__setattr__(self, "state", _state(self.state))
        if self.run_id is not None and not isinstance(self.run_id, str):
            object.__setattr__(self, "run_id", str(self.run_id))

    def with_state(self, state: "ProgramState | str") -> "ProgramContext":
        return replace(self, state=_state(state))


def _state(state: Any) -> ProgramState:
    if isinstance(state, ProgramState):
        return state
    try:
        return ProgramState(state)
    except ValueError:
        raise ValueError(f"program state must be one of {[s.value for s in ProgramState]}, got {state!r}") from None


def as_program_context(program: Any) -> ProgramContext | None:
    """None, a ProgramContext, a mapping of its fields, or a plain run id (str)."""
    if program is None or isinstance(program, ProgramContext):
        return program
    if isinstance(program, str):
        return ProgramContext(run_id=program) if program else None
    if isinstance(program, Mapping):
        unknown = set(program) - {"run_id", "step", "thread_id", "state"}
        if unknown:
            raise ValueError(f"unknown program context field(s): {sorted(unknown)}")
        return ProgramContext(**program)
    raise ValueError(f"program must be a ProgramContext, a dict or a run id, got {type(program).__name__}")


@dataclass
class RunRecord:
    """What the engine gave one run (``stats()["runs"][run_id]``)."""

    run_id: str
    service_tokens: int = 0  # tokens computed for the run (prefill, decode and recomputation)
    queue_time_s: float = 0.0  # time its requests spent queued before (re)admission
    requests: int = 0
    prefill_tokens_recomputed: int = 0
    preemptions: int = 0
    first_seen: float = field(default_factory=time.monotonic)

    def as_dict(self) -> dict[str, Any]:
        return {"service_tokens": self.service_tokens, "queue_time_s": round(self.queue_time_s, 6),
                "requests": self.requests,
                "prefill_tokens_recomputed": self.prefill_tokens_recomputed, "preemptions": self.preemptions}


class ProgramTracker:
    """Per-run records (the newest ``max_runs`` runs are kept) and the observed idle gaps of threads.

    A gap is the time from a thread's last request ending to its next request (a tool call, a sibling, a
    gather). The recent gaps give the expected time to a waiting thread's next use, given how long it has
    waited so far: what 'expected next use' is measured against.
    """

    def __init__(self, max_runs: int = 1024, max_samples: int = 256):
        self.max_runs = max_runs
        self.runs: OrderedDict[str, RunRecord] = OrderedDict()
        self._gaps: deque[float] = deque(maxlen=max_samples)
        self._sorted: list[float] | None = None
        self._suffix: list[float] = []
        self.final_tokens: dict[str | None, float] = {}  # step name (None: all) -> EMA of closed threads' lengths

    def run(self, run_id: str) -> RunRecord:
        rec = self.runs.get(run_id)
        if rec is None:
            rec = self.runs[run_id] = RunRecord(run_id)
            while len(self.runs) > self.max_runs:
                self.runs.popitem(last=False)
        else:
            self.runs.move_to_end(run_id)
        return rec

    def stats(self, run_id: str | None = None) -> dict | None:
        """A run's record as a dict (None if unknown); without run_id, {run_id: that dict} for every run kept."""
        if run_id is None:
            return {k: r.as_dict() for k, r in self.runs.items()}
        rec = self.runs.get(str(run_id))
        return rec.as_dict() if rec is not None else None

    def observe_final(self, step: str | None, num_tokens: int) -> None:
        """A thread with a context closed at `num_tokens` tokens (its KV footprint at the end)."""
        for key in (step, None):
            est = self.final_tokens.get(key)
            self.final_tokens[key] = float(num_tokens) if est is None else 0.8 * est + 0.2 * num_tokens

    def expected_final(self, step: str | None) -> float | None:
        """Typical final length of a thread of this step (any step's when this one has none yet)."""
        est = self.final_tokens.get(step)
        return est if est is not None else self.final_tokens.get(None)

    def observe_gap(self, seconds: float) -> None:
        if seconds >= 0:
            self._gaps.append(seconds)
            self._sorted = None

    def _ensure_sorted(self) -> list[float]:
        if self._sorted is None:
            self._sorted = sorted(self._gaps)
            acc, suffix = 0.0, [0.0] * (len(self._sorted) + 1)
            for i in range(len(self._sorted) - 1, -1, -1):
                acc += self._sorted[i]
                suffix[i] = acc
            self._suffix = suffix
        return self._sorted

    def overdue(self, waited_s: float) -> bool:
        """Waited twice as long as any recent gap (or 2 s before any was seen): a long tool, or a thread
        nobody will use again; its KV no longer outranks new work."""
        gaps = self._ensure_sorted()
        return waited_s > 2 * (gaps[-1] if gaps else 1.0)

    def expected_return_s(self, waited_s: float) -> float:
        """Expected time until an idle thread is used again, having waited ``waited_s``: the mean of
        (gap - waited) over recent gaps longer than waited. Past every gap seen (a long tool, a forgotten
        thread), at least as long again as it has waited, so the longest waiting go first."""
        gaps = self._ensure_sorted()
        if not gaps:
            return 1.0 + waited_s
        i = bisect.bisect_right(gaps, waited_s)
        longer = len(gaps) - i
        if longer == 0:
            return gaps[-1] + waited_s
        return self._suffix[i] / longer - waited_s
