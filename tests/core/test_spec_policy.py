"""The adaptive speculation policy's parts, with exact numbers."""
from __future__ import annotations

import pytest

from pagellm.core.spec_policy import AcceptanceEstimate, StepCostModel, plan_drafts


def costs(points: dict[int, float]) -> StepCostModel:
    model = StepCostModel()
    for n, s in points.items():
        model.observe(n, s)
    return model


def test_cost_model_interpolates_and_refuses_to_guess_past_the_data():
    model = costs({1: 10.0, 5: 10.0, 9: 14.0, 33: 30.0})
    assert model.cost(5) == 10.0
    assert model.cost(7) == pytest.approx(12.0)
    assert model.cost(21) == pytest.approx(22.0)
    assert model.cost(34) is None
    assert costs({8: 4.0}).cost(2) is None  # below the only width seen
    assert costs({4: 4.0, 8: 8.0}).cost(2) == pytest.approx(2.0)  # along the first segment
    assert costs({4: 4.0, 8: 8.0}).cost(1) == pytest.approx(2.0)  # never under half the narrowest
    model.observe(5, 20.0)
    assert model.cost(5) == pytest.approx(0.8 * 10.0 + 0.2 * 20.0)


def test_acceptance_estimate_counts_only_drafts_tried():
    est = AcceptanceEstimate()
    assert est.rate == 0.5
    est.observe(num_drafts=4, num_accepted=4)  # all four tried and accepted
    assert (est.accepted, est.tried) == pytest.approx((0.8 + 4, 1.6 + 4))
    est.observe(num_drafts=4, num_accepted=1)  # the second failed; the last two were never tried
    assert (est.accepted, est.tried) == pytest.approx((0.8 * 4.8 + 1, 0.8 * 5.6 + 2))


def test_plan_drafts_while_cheap_rows_pay_and_none_when_they_cost_a_step_each():
    flat = costs({1: 10.0, 9: 10.0, 64: 80.0})  # rows nearly free up to 9 tokens
    assert plan_drafts({"a": (8, 0.9)}, 1, 1, flat) == {"a": 8}
    assert plan_drafts({"a": (8, 0.0)}, 1, 1, flat) == {}
    linear = costs({1: 1.0, 100: 100.0})  # every row costs what a step costs
    assert plan_drafts({"a": (4, 0.9), "b": (4, 0.8)}, 2, 2, linear) == {}
    # The best drafts first: a's are likelier to be accepted than b's.
    knee = costs({2: 10.0, 4: 10.0, 10: 20.0})
    assert plan_drafts({"a": (4, 0.9), "b": (4, 0.3)}, 2, 2, knee) == {"a": 4}
    # Nothing known about the base width yet: a plain step first, to measure it.
    assert plan_drafts({"a": (4, 0.9)}, 3, 1, costs({40: 5.0})) == {}
    # Known base, unknown wider steps: try once, which prices them.
    assert plan_drafts({"a": (4, 0.9)}, 1, 1, costs({1: 5.0})) == {"a": 4}


def test_a_draft_models_passes_count_against_its_drafts():
    target = costs({1: 36.0, 5: 45.0, 32: 143.0, 160: 400.0})
    passes = costs({1: 8.0, 32: 75.0})  # seconds per draft position, by requests drafting
    # One stream: four passes of 8 beside a 45-wide step still beat plain decoding.
    assert plan_drafts({"a": (4, 0.9)}, 1, 1, target, passes) == {"a": 4}
    # 32 streams: each position's pass over all of them costs half a step; nothing pays.
    wide = {f"r{i}": (4, 0.9) for i in range(32)}
    assert plan_drafts(wide, 32, 32, target, passes) == {}
    assert len(plan_drafts(wide, 32, 32, target)) == 32  # without the passes it would draft
