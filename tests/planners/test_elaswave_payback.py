"""The payback rule and the per-unit cool-down of optional plans (planners.elaswave_payback)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from planners.elaswave_payback import PaybackSettings, judge_optional, moved_bytes
from planners.elaswave_reasons import Outcome
from planners.layout import Layout, make_uniform_layout
from planners.partition import apply_boundaries

OLD = make_uniform_layout(num_layers=4, num_stages=2, dp=2, global_batch=8, num_micro_batches=2)


def _moved() -> Layout:
    return apply_boundaries(OLD, (3,))  # unit 2 moves stage 1 -> 0


def test_a_plan_that_pays_back_within_the_stated_steps_is_adopted_and_one_that_does_not_is_declined() -> None:
    new = _moved()
    settings = PaybackSettings(payback_steps=100, plan_pause_s=0.5, state_bytes_per_s=1e9)
    assert moved_bytes(OLD, new) == OLD.layer_numel[2] * 12
    assert judge_optional(OLD, new, 0.030, 0.020, "s", frozenset(), settings) is None  # 1 s >= 0.5 s
    declined = judge_optional(OLD, new, 0.0102, 0.0100, "s", frozenset(), settings)  # 0.02 s < 0.5 s
    assert declined is not None and declined.outcome is Outcome.DECLINED
    assert "not within 100 steps (payback rule)" in declined.text and "in 2500 steps" in declined.text


def test_a_unit_in_its_cool_down_does_not_move_for_an_optional_plan() -> None:
    new = _moved()
    declined = judge_optional(OLD, new, 1.0, 0.1, "s", frozenset({2}), PaybackSettings(cooldown_steps=200))
    assert declined is not None and "unit 2 stage 1->0" in declined.text and "cool-down" in declined.text
    assert judge_optional(OLD, new, 1.0, 0.1, "s", frozenset({0}), PaybackSettings()) is None


def test_giving_an_up_clock_back_is_always_adopted() -> None:
    up = replace(OLD, frequencies_mhz=((1, 1568),))
    back = replace(OLD, frequencies_mhz=((1, 1400),))
    assert judge_optional(up, back, 0.01, 0.01, "s", frozenset(), PaybackSettings()) is None
    # Raising a clock is no give-back: it must pay like any other optional plan.
    assert judge_optional(back, up, 0.01, 0.01, "s", frozenset(), PaybackSettings()) is not None


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="payback_steps"):
        PaybackSettings(payback_steps=0)
    with pytest.raises(ValueError, match="state_bytes_per_s"):
        PaybackSettings(state_bytes_per_s=0)
