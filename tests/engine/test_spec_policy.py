"""The adaptive rule of speculative decoding (engine/decoding/spec_policy.py): drafts where a row is cheap next to the
step,
none where it is not, a cost fit from measured steps, acceptance per sequence; and the default is on, with an off."""

import argparse

from flowrt.engine import EngineArgs
from flowrt.engine.decoding.spec_policy import Acceptance, DraftBudget, StepCost


def _fitted(fixed: float, per_row: float) -> StepCost:
    cost = StepCost()
    for i in range(200):
        rows = 1 + i % 40
        cost.observe(rows, fixed + per_row * rows)
    return cost


def test_cost_fit_recovers_fixed_and_per_row_cost():
    assert abs(_fitted(0.010, 0.0005).ratio() - 0.05) < 1e-6
    assert StepCost().ratio() == StepCost().prior_ratio  # no data: the prior
    flat = StepCost()
    for _ in range(50):
        flat.observe(16, 0.02)  # rows never varied: nothing to fit
    assert flat.ratio() == flat.prior_ratio


def test_cheap_rows_take_likely_drafts_wide_costly_steps_take_none():
    cheap = DraftBudget(cost=_fitted(0.020, 0.00002))  # a row: 1/1000 of the step
    assert cheap.plan([(4, 0.8)], base_rows=1, base_tokens=1) == [4]
    assert cheap.plan([(4, 0.8), (4, 0.002)], base_rows=2, base_tokens=2) == [4, 0]  # unlikely drafts still cost
    costly = DraftBudget(cost=_fitted(0.010, 0.002))  # a row: 1/5 of the step's fixed part
    assert costly.plan([(4, 0.5)] * 16, base_rows=16, base_tokens=16) == [0] * 16
    mid = DraftBudget(cost=_fitted(0.010, 0.0005))
    take = mid.plan([(4, 0.9)] * 16, base_rows=16, base_tokens=16)
    assert 0 < sum(take) < 64 and max(take) - min(take) <= 1  # the first drafts of each first


def test_a_dry_spell_explores_once():
    budget = DraftBudget(cost=_fitted(0.010, 0.002), explore_every=3)
    plans = [budget.plan([(2, 0.5)] * 8, base_rows=8, base_tokens=8) for _ in range(5)]
    assert plans == [[0] * 8] * 3 + [[2] * 8] + [[0] * 8]


def test_acceptance_per_sequence_with_the_engine_wide_prior():
    acc = Acceptance()
    for _ in range(20):
        acc.record(1, 4, 4)  # always all accepted
        acc.record(2, 4, 0)  # always rejected at once
    assert acc.rate(1) > 0.9 and acc.rate(2) < 0.2
    assert 0.4 < acc.rate(3) < 0.95  # unseen: the engine-wide rate
    acc.keep_only({1})
    assert 2 in acc._seq  # small tables are kept
    acc._seq.update({i: [0, 0] for i in range(100, 200)})
    acc.keep_only({1})
    assert set(acc._seq) == {1}


def test_on_by_default_and_an_explicit_off():
    from flowrt.runner.options import add_engine_arguments, engine_kwargs_from_args

    assert EngineArgs().speculative_config["adaptive"] is True
    assert EngineArgs(speculative_config={"method": "ngram"}).speculative_config["adaptive"] is True
    assert EngineArgs(speculative_config=None).speculative_config is None
    p = argparse.ArgumentParser()
    add_engine_arguments(p)
    kw = engine_kwargs_from_args(p.parse_args(["--speculative-config", "off"]))
    assert EngineArgs(**kw).speculative_config is None


def test_prefill_steps_take_no_drafts_and_stalls_do_not_teach_the_fit():
    budget = DraftBudget(cost=_fitted(0.020, 0.00002))
    assert budget.plan([(4, 0.9)], base_rows=300, base_tokens=2) == [0]  # a prompt chunk is in the step
    cost = _fitted(0.010, 0.0005)
    cost.observe(4, 5.0)  # a stall
    assert abs(cost.ratio() - 0.05) < 1e-6


def test_seeded_samples_do_not_depend_on_the_measured_cost(stories_path, monkeypatch):
    """The adaptive rule reads wall times; a request with its own seed drafts the same whatever they say."""
    from flowrt.engine import LLM, SamplingParams
    from flowrt.engine.decoding.spec_policy import StepCost

    params = SamplingParams(max_tokens=60, temperature=0.8, seed=123)
    prompts = ["Once upon a time", "Lily and Tom"]
    outs = []
    for ratio in (0.0, 100.0):  # rows free / rows dearer than whole steps
        monkeypatch.setattr(StepCost, "ratio", lambda self, r=ratio: r)
        llm = LLM(stories_path, dtype="float32", speculative_config={"method": "ngram"})
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
        assert llm.stats()["spec_draft_tokens"] > 0
    assert outs[0] == outs[1]
