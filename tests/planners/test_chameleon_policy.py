"""Eq. (8) policy choice and the precomputed plan cache."""

from __future__ import annotations

from dataclasses import replace
from itertools import combinations

import pytest

from planners.chameleon.candidates import rerouting_estimate
from planners.chameleon.plan_cache import failure_key, failure_keys, precompute, representative
from planners.chameleon.policy import chameleon_step, choose_policy, decide, eq8_score
from planners.chameleon.reparallel import reparallelise
from planners.chameleon.state import Candidate, ClusterState, JobProfile, JobShape

SHAPE = JobShape(pp=3, dp=3, micro_batch=1, global_batch=24)
PROFILE = JobProfile(
    layer_fwd_s=(0.01,) * 9,
    layer_bwd_s=(0.02,) * 9,
    layer_param_bytes=(2e9,) * 9,
    layer_act_bytes=(1e7,) * 9,
    mem_cap_bytes=64e9,
)
BASE = ClusterState(SHAPE, PROFILE)


def fake(policy: str, step: float, transition: float, feasible: bool = True) -> Candidate:
    return Candidate(policy, feasible, "test", (), step, 100, transition)


def test_eq8_score_is_throughput_times_effective_ratio() -> None:
    s = eq8_score(fake("a", 2.0, 30.0), horizon_s=120.0)
    assert s.effective_ratio == pytest.approx(90 / 120)
    assert s.score == pytest.approx(50.0 * 0.75)
    assert eq8_score(fake("a", 2.0, 500.0), 120.0).score == 0.0


def test_the_horizon_decides_between_fast_recovery_and_fast_steady_state() -> None:
    quick, thorough = fake("quick", 2.0, 1.0), fake("thorough", 1.6, 60.0)
    assert decide([quick, thorough], horizon_s=120.0).chosen.policy == "quick"
    assert decide([quick, thorough], horizon_s=3600.0).chosen.policy == "thorough"
    # Break-even: 50 * (H-1)/H == 62.5 * (H-60)/H  ->  H = 296
    assert decide([quick, thorough], horizon_s=290.0).chosen.policy == "quick"
    assert decide([quick, thorough], horizon_s=300.0).chosen.policy == "thorough"


def test_choose_policy_returns_the_best_scored_candidate() -> None:
    s = replace(BASE, failed=frozenset({SHAPE.rank(0, 1)}), expected_time_to_next_event_s=1e6)
    d = choose_policy(s)
    assert {x.candidate.policy for x in d.scored} == {"elaswave", "reparallelise", "recycle", "torchft"}
    assert d.chosen.policy == d.scored[0].candidate.policy
    assert d.scored[0].score == max(x.score for x in d.scored)
    with pytest.raises(ValueError, match="unknown policies"):
        choose_policy(s, ["nope"])


def test_nothing_feasible_is_reported_with_every_reason() -> None:
    d = decide([fake("a", 1.0, 0.0, feasible=False), fake("b", 1.0, 0.0, feasible=False)], 100.0)
    assert "no policy can run" in d.reason and "a: test" in d.reason


def test_failure_keys_are_invariant_under_replica_permutation() -> None:
    a = frozenset({SHAPE.rank(0, 1), SHAPE.rank(2, 1), SHAPE.rank(2, 2)})
    b = frozenset({SHAPE.rank(1, 1), SHAPE.rank(1, 2), SHAPE.rank(0, 1)})
    assert failure_key(SHAPE, a) == failure_key(SHAPE, b) == ((1,), (1, 2))
    assert failure_key(SHAPE, representative(SHAPE, failure_key(SHAPE, a))) == failure_key(SHAPE, a)


def test_failure_keys_enumerate_every_pattern_once() -> None:
    expected = {
        failure_key(SHAPE, frozenset(c)) for k in (1, 2) for c in combinations(range(SHAPE.num_ranks), k)
    }
    keys = list(failure_keys(SHAPE, 2))
    assert len(keys) == len(set(keys)) and set(keys) == expected


def test_plan_cache_lookup_equals_deciding_at_failure_time() -> None:
    cache = precompute(BASE, 2, policies=("elaswave", "recycle", "torchft"))
    failed = frozenset({SHAPE.rank(2, 0), SHAPE.rank(1, 2)})
    cached = cache.lookup(failed)
    direct = choose_policy(replace(BASE, failed=failed), ("elaswave", "recycle", "torchft"))
    assert cached is not None
    assert cached.chosen.policy == direct.chosen.policy
    assert cached.chosen.throughput == pytest.approx(direct.chosen.throughput)
    assert cache.lookup(frozenset({0, 1, 2})) is None  # three losses were not precomputed
    with pytest.raises(ValueError, match="fault-free"):
        precompute(replace(BASE, failed=frozenset({0})), 1)


def test_chameleon_reroutes_for_a_short_horizon_and_reparallelises_for_a_long_one() -> None:
    failed = frozenset({SHAPE.rank(0, 1)})
    short = replace(BASE, failed=failed, expected_time_to_next_event_s=5.0)
    cand, allowed = chameleon_step(short, rerouting_allowed=True)
    assert cand.reason.startswith("rerouting") and allowed
    # One loss per stage, each in another replica: eq. 13 sums three stages' extra work.
    spread = frozenset({SHAPE.rank(0, 0), SHAPE.rank(1, 1), SHAPE.rank(2, 2)})
    long = replace(BASE, failed=spread, expected_time_to_next_event_s=1e7)
    assert reparallelise(long).step_time_s < rerouting_estimate(long).step_time_s
    cand, allowed = chameleon_step(long, rerouting_allowed=True)
    assert cand.reason.startswith("dynamic parallelism") and not allowed
    # Once re-parallelised, rerouting is not offered until the job is whole again.
    cand, allowed = chameleon_step(short, rerouting_allowed=False)
    assert cand.reason.startswith("dynamic parallelism") and not allowed
    _, allowed = chameleon_step(BASE, rerouting_allowed=False)
    assert allowed


def test_rerouting_estimate_is_eq12_for_one_failure() -> None:
    s = replace(BASE, failed=frozenset({SHAPE.rank(2, 0)}))
    est = rerouting_estimate(s)
    per_slot = 3 * (0.01 + 0.02)  # 3 layers per stage, one sample
    assert est.step_time_s == pytest.approx((3 + 8 - 1 + 8 / 2) * per_slot)
