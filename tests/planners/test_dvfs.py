"""Algorithm 2 (minimum bisection frequency scaling) against an analytic controller (§4.3)."""

from __future__ import annotations

from collections.abc import Mapping

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planners import make_uniform_layout
from planners.costmodel import CostModel, LayerProfile, LinkModel, MemoryProfile
from planners.dataflow import resize_after_loss
from planners.dvfs import (
    bisection_search,
    model_frequency_guess,
    plan_straggler_frequency,
    run_bisection,
)

F_REF = 1000


class AnalyticController:
    """Stage time = compute * F_REF / f + fixed, with f the slowest rank's clock of the stage."""

    def __init__(
        self,
        stage_ranks: dict[int, tuple[int, ...]],
        compute: dict[int, float],
        fixed: dict[int, float],
        f_cur: int,
    ) -> None:
        self.stage_ranks, self.compute, self.fixed = stage_ranks, compute, fixed
        self.freq = {r: f_cur for rs in stage_ranks.values() for r in rs}
        self.observations = 0

    def apply(self, rank: int, mhz: int) -> None:
        self.freq[rank] = mhz

    def observe(self, window: int) -> Mapping[int, float]:
        self.observations += 1
        return {p: self.time(p, min(self.freq[r] for r in rs)) for p, rs in self.stage_ranks.items()}

    def time(self, stage: int, mhz: int) -> float:
        return self.compute[stage] * F_REF / mhz + self.fixed[stage]


def _controller(compute: float, fixed: float, f_cur: int = F_REF) -> AnalyticController:
    return AnalyticController({0: (0, 1), 1: (2, 3)}, {0: compute, 1: 1.0}, {0: fixed, 1: 0.0}, f_cur)


@settings(max_examples=150)
@given(
    compute=st.floats(0.5, 2.0),
    fixed=st.floats(0.0, 0.4),
    target=st.floats(0.6, 1.5),
    df=st.sampled_from([1, 5, 25]),
    use_guess=st.booleans(),
)
def test_bisection_finds_lowest_feasible_frequency(
    compute: float, fixed: float, target: float, df: int, use_guess: bool
) -> None:
    f_cur, f_max, eps = 1000, 1800, 1e-3
    ctl = _controller(compute, fixed, f_cur)
    guess = model_frequency_guess(compute, fixed, f_cur, target) if use_guess else None
    res = run_bisection(ctl, (0, 1), 0, 4, f_cur, f_max, target, eps, df, guess)
    assert ctl.freq[0] == ctl.freq[1] == res.mhz  # left at the chosen frequency
    if ctl.time(0, f_cur) <= target + eps:
        assert (res.mhz, res.status) == (f_cur, "ACHIEVABLE") and len(res.probes) == 1
    elif ctl.time(0, f_max) > target + eps:
        assert (res.mhz, res.status) == (f_max, "UNACHIEVABLE")
    else:
        assert res.status == "ACHIEVABLE"
        assert ctl.time(0, res.mhz) <= target + eps  # meets the target
        assert res.mhz - df < compute * F_REF / (target + eps - fixed) <= res.mhz  # and is minimal to df
        assert f_cur < res.mhz <= f_max


def test_model_guess_saves_observations() -> None:
    compute, fixed, target = 1.3, 0.1, 1.0
    plain = run_bisection(_controller(compute, fixed), (0, 1), 0, 4, 1000, 2000, target, 1e-4, 1)
    guess = model_frequency_guess(compute, fixed, 1000, target)
    assert guess == 1445  # 1.3 * 1000 / (1.0 - 0.1) = 1444.4
    guided = run_bisection(_controller(compute, fixed), (0, 1), 0, 4, 1000, 2000, target, 1e-4, 1, guess)
    assert plain.mhz == guided.mhz == 1445
    assert len(guided.probes) < len(plain.probes)


def test_unachievable_when_gap_is_not_compute_bound() -> None:
    res = run_bisection(_controller(0.2, 1.2), (0, 1), 0, 4, 1000, 2000, 1.0, 1e-3, 10)
    assert res.status == "UNACHIEVABLE" and res.mhz == 2000 and "not compute-bound" in res.reason
    assert model_frequency_guess(0.2, 1.2, 1000, 1.0) is None


def test_generator_protocol_and_bad_arguments() -> None:
    search = bisection_search(1000, 2000, 1.0, 0.0, 100)
    assert next(search) == 1000
    assert search.send(2.0) == 2000  # too slow: probe f_max
    assert search.send(0.5) == 1500  # feasible at f_max: bisect
    with pytest.raises(ValueError, match="need 0 < f_cur <= f_max"):
        next(bisection_search(2000, 1000, 1.0, 0.0, 10))


def test_model_plan_upclocks_only_the_straggler_to_match_peers() -> None:
    L = 4
    profile = LayerProfile(
        (1, 2), tuple((1e-3, 2e-3) for _ in range(L)), tuple((2e-3, 4e-3) for _ in range(L)), ref_mhz=F_REF
    )
    cost = CostModel(profile, MemoryProfile((0.0,) * L), LinkModel(1.0, 1e12))
    lay = make_uniform_layout(L, 2, 3, global_batch=6, num_micro_batches=3)  # micro-batch 1 everywhere
    lay = resize_after_loss(lay, [0, 1]).layout  # stage 0: one rank, micro-batch 2 -> 2x slower
    plan = plan_straggler_frequency(lay, cost, f_max=2500)
    assert plan.stage == 0 and plan.mhz == 2000
    times = cost.stage_times(plan.layout)
    assert times[0] == pytest.approx(times[1])
    assert dict(plan.layout.frequencies_mhz) == {2: 2000}
    capped = plan_straggler_frequency(lay, cost, f_max=1500)
    assert capped.mhz is None and capped.layout == lay and "cannot reach" in capped.reason
