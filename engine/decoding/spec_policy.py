"""When speculation pays: how many drafts each sequence gets in a step (the adaptive rule of
engine/decoding/spec_decode.py).

A step's wall time is modelled as fixed + per_row * rows, fitted by least squares over recent decode steps (weights
decaying by `decay` per step, so the fit follows the batch and the machine). A sequence's drafts are accepted one
after another with probability a (its own count of accepted drafts and rejections, pulled towards the engine-wide
rate), so its j-th draft adds a**j expected tokens. Drafts are added, highest gain first, while the gain of the next
one per its row's cost exceeds `margin` times the step's expected tokens per unit of cost so far: the step's
expected tokens per second rises by a clear step with each. So a step where rows are cheap (one sequence over
weights streaming from memory) takes every likely draft; a wide batch, or a path where each row costs as much as the
step's fixed part, takes few or none; nor does a step that computes a prefill chunk (its drafts would delay the
prompt). When no draft has been taken for `explore_every` steps although some were proposed, one step takes them
all, so that the fit and the acceptance rates see rows again.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StepCost:
    """Step seconds ~ fixed + per_row * rows over recent decode steps (exponentially forgotten least squares)."""

    decay: float = 0.98
    prior_ratio: float = 1 / 32  # per_row / fixed before rows have varied enough to fit
    min_var: float = 2.0  # rows must vary at least this much (weighted variance) for a fit
    _s: list[float] = field(default_factory=lambda: [0.0] * 5)  # sums of w, w*r, w*r*r, w*t, w*r*t

    def observe(self, rows: int, seconds: float) -> None:
        fit = self._fit()
        if fit is not None and seconds > 3.0 * (fit[0] + fit[1] * rows):
            return  # a stall (another process took the cores): not what a row costs
        s = self._s
        for i, v in enumerate((1.0, rows, rows * rows, seconds, rows * seconds)):
            s[i] = s[i] * self.decay + v

    def _fit(self) -> tuple[float, float] | None:
        """(fixed, per_row) seconds, once at least 8 steps with rows that varied enough were seen."""
        n, sr, srr, st, srt = self._s
        if n < 8:
            return None
        mr, mt = sr / n, st / n
        var = srr / n - mr * mr
        if var < self.min_var:
            return None
        slope = max(0.0, (srt / n - mr * mt) / var)
        return max(mt - slope * mr, 0.05 * mt), slope  # a fit with no fixed part: rows cost everything

    def ratio(self) -> float:
        """per_row / fixed: what one more row costs in steps without it."""
        fit = self._fit()
        return self.prior_ratio if fit is None else fit[1] / fit[0]


@dataclass
class Acceptance:
    """Per-sequence acceptance (drafts accepted one after another with probability a: a geometric run), with the
    engine-wide rate (decayed) as the prior of sequences with little history."""

    prior_weight: float = 2.0
    decay: float = 0.995
    _all: list[float] = field(default_factory=lambda: [0.0, 0.0])  # accepted, rejections (decayed)
    _seq: dict[int, list[int]] = field(default_factory=dict)

    def record(self, seq_id: int, drafted: int, accepted: int) -> None:
        rejected = int(accepted < drafted)
        a = self._all
        a[0] = a[0] * self.decay + accepted
        a[1] = a[1] * self.decay + rejected
        c = self._seq.setdefault(seq_id, [0, 0])
        c[0] += accepted
        c[1] += rejected

    def overall(self) -> float:
        """The engine-wide rate (decayed; 1/2 before any draft): the prior of a sequence's own."""
        acc, rej = self._all
        return (acc + 1.0) / (acc + rej + 2.0)

    def rate(self, seq_id: int) -> float:
        prior = self.overall()
        c = self._seq.get(seq_id)
        if c is None:
            return min(prior, 0.99)
        return min((c[0] + self.prior_weight * prior) / (c[0] + c[1] + self.prior_weight), 0.99)

    def keep_only(self, seq_ids: set[int]) -> None:
        """Forget sequences that no longer run (called with the running ones once the table has grown)."""
        if len(self._seq) > 2 * len(seq_ids) + 64:
            self._seq = {k: v for k, v in self._seq.items() if k in seq_ids}


@dataclass
class DraftBudget:
    """Chooses the drafts of a step (see the module docstring)."""

    explore_every: int = 32
    # a draft must promise this many times the step's average tokens per cost: the linear fit misses part of
    # what rows cost (2-core EPYC, bf16, batch 16: drafts the fit valued at +13% tokens/s gained nothing)
    margin: float = 1.5
    cost: StepCost = field(default_factory=StepCost)
    acceptance: Acceptance = field(default_factory=Acceptance)
    _dry: int = 0  # steps in a row where drafts were proposed and none taken

    def pays(self, gain: float, base_rows: int, base_tokens: int) -> bool:
        """Whether a draft worth `gain` expected tokens pays in a step of base_rows rows and base_tokens sampled
        tokens, by plan()'s rule."""
        r = self.cost.ratio()
        return base_rows == base_tokens and gain * (1.0 + r * base_rows) > self.margin * r * base_tokens

    def plan(self, rates: list[tuple[int, float]], base_rows: int, base_tokens: int) -> list[int]:
        """rates: (drafts available, acceptance rate) per candidate sequence; base_rows/base_tokens: the step's rows
        and sampled tokens without drafts. Returns how many drafts each candidate keeps."""
        take = [0] * len(rates)
        if not rates or base_rows > base_tokens:  # a prefill chunk runs: drafts would only delay it
            return take
        r = 0.0 if self._dry >= self.explore_every else self.cost.ratio()
        gains = sorted(((a ** j, i) for i, (k, a) in enumerate(rates) for j in range(1, k + 1)), reverse=True)
        tokens, rows = float(base_tokens), base_rows
        for g, i in gains:
            # its tokens per cost below the step's so far: no later (smaller) gain pays either
            if g * (1.0 + r * rows) <= self.margin * r * tokens:
                break
            take[i] += 1
            tokens += g
            rows += 1
        self._dry = 0 if any(take) else self._dry + 1
        return take

