"""Chameleon's step-time estimators (eq. 9-13) against a direct event simulation."""

from __future__ import annotations

import heapq

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planners.chameleon.estimators import (
    asymmetric_pipeline_time,
    multi_pipeline_step_time,
    one_f_one_b_order,
    rerouting_step_time,
    rerouting_step_time_single,
    symmetric_step_time,
)


def simulate_1f1b(fwd: list[float], bwd: list[float], n_m: int, p2p: float = 0.0) -> float:
    """Reference: global-time discrete-event simulation with a completion-event heap."""
    p = len(fwd)
    orders = [one_f_one_b_order(i, p, n_m) for i in range(p)]
    done: dict[tuple[str, int, int], float] = {}
    nxt, busy = [0] * p, [False] * p
    events: list[tuple[float, int, str, int]] = []

    def ready_at(kind: str, i: int, j: int) -> float | None:
        if kind == "F":
            key = ("F", i - 1, j)
            return 0.0 if i == 0 else (done[key] + p2p if key in done else None)
        key = ("F", i, j) if i == p - 1 else ("B", i + 1, j)
        if key not in done:
            return None
        return done[key] + (0.0 if i == p - 1 else p2p)

    def try_start(i: int, now: float) -> None:
        if busy[i] or nxt[i] >= len(orders[i]):
            return
        kind, j = orders[i][nxt[i]]
        ready = ready_at(kind, i, j)
        if ready is None:
            return
        start = max(now, ready)
        busy[i] = True
        heapq.heappush(events, (start + (fwd[i] if kind == "F" else bwd[i]), i, kind, j))

    for i in range(p):
        try_start(i, 0.0)
    end = 0.0
    while events:
        t, i, kind, j = heapq.heappop(events)
        done[(kind, i, j)] = t
        busy[i], nxt[i], end = False, nxt[i] + 1, max(end, t)
        for k in (i - 1, i, i + 1):
            if 0 <= k < p:
                try_start(k, t)
    assert all(nxt[i] == len(orders[i]) for i in range(p)), "reference simulation deadlocked"
    return end


@pytest.mark.parametrize("p,m", [(1, 1), (2, 3), (4, 4), (4, 9), (8, 3)])
def test_eq9_equals_event_simulation_for_balanced_stages(p: int, m: int) -> None:
    est = symmetric_step_time(p, m, 0.3, 0.7)
    assert est.feasible
    assert est.step_time_s == pytest.approx(simulate_1f1b([0.3] * p, [0.7] * p, m))
    assert est.step_time_s == pytest.approx(asymmetric_pipeline_time([0.3] * p, [0.7] * p, m))


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.floats(0.01, 2.0), st.floats(0.01, 2.0)), min_size=1, max_size=6),
    st.integers(1, 12),
    st.floats(0.0, 0.5),
)
def test_eq11_matches_direct_event_simulation(stages: list[tuple[float, float]], m: int, p2p: float) -> None:
    fwd, bwd = [f for f, _ in stages], [b for _, b in stages]
    assert asymmetric_pipeline_time(fwd, bwd, m, p2p) == pytest.approx(simulate_1f1b(fwd, bwd, m, p2p))


def test_one_f_one_b_order_runs_every_micro_batch_once() -> None:
    for p, m in [(4, 2), (4, 8), (1, 3)]:
        for i in range(p):
            order = one_f_one_b_order(i, p, m)
            assert sorted(order) == sorted([("F", j) for j in range(m)] + [("B", j) for j in range(m)])
            assert order.index(("F", 0)) < order.index(("B", 0))


def test_eq12_is_eq13_with_a_single_failure_and_eq9_without() -> None:
    single = rerouting_step_time_single(4, 8, 4, 0.2, 0.4)
    assert single.step_time_s == pytest.approx((4 + 8 - 1 + 8 / 3) * 0.6)
    assert rerouting_step_time(4, 8, 4, [0, 1, 0, 0], 0.2, 0.4).step_time_s == pytest.approx(
        single.step_time_s
    )
    assert rerouting_step_time(4, 8, 4, [0, 0, 0, 0], 0.2, 0.4).step_time_s == pytest.approx(
        symmetric_step_time(4, 8, 0.2, 0.4).step_time_s
    )


def test_eq12_equals_simulating_the_peer_pipeline_with_the_extra_micro_batches() -> None:
    # The rerouted micro-batches travel a peer's whole pipeline: N_m + N_m/(N_dp-1) micro-batches.
    n_pp, n_m, n_dp = 4, 6, 4
    est = rerouting_step_time_single(n_pp, n_m, n_dp, 0.25, 0.5)
    assert est.step_time_s == pytest.approx(
        simulate_1f1b([0.25] * n_pp, [0.5] * n_pp, n_m + n_m // (n_dp - 1))
    )


def test_eq13_sums_affected_stages_and_bottleneck_form_takes_the_worst() -> None:
    summed = rerouting_step_time(4, 12, 4, [1, 2, 0, 0], 1.0, 2.0)
    assert summed.step_time_s == pytest.approx((4 + 12 - 1 + 12 * 1 / 3 + 12 * 2 / 2) * 3.0)
    worst = rerouting_step_time(4, 12, 4, [1, 2, 0, 0], 1.0, 2.0, bottleneck=True)
    assert worst.step_time_s == pytest.approx((4 + 12 - 1 + 12) * 3.0)


def test_eq13_refuses_a_stage_that_lost_every_dp_rank() -> None:
    est = rerouting_step_time(3, 6, 2, [0, 2, 0], 1.0, 1.0)
    assert not est.feasible and "stage 1" in est.reason and est.step_time_s == float("inf")
    with pytest.raises(ValueError, match="failed_per_stage has 2 entries"):
        rerouting_step_time(3, 6, 2, [0, 1], 1.0, 1.0)


def test_eq10_is_the_slowest_pipeline() -> None:
    pipes = [([0.1, 0.1], [0.2, 0.2], 5), ([0.1, 0.3, 0.1], [0.2, 0.2, 0.2], 4)]
    est = multi_pipeline_step_time(pipes)
    assert est.step_time_s == pytest.approx(max(simulate_1f1b(list(f), list(b), m) for f, b, m in pipes))
    assert not multi_pipeline_step_time([]).feasible


def test_bad_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="N_m must be >= 1"):
        symmetric_step_time(2, 0, 1.0, 1.0)
    with pytest.raises(ValueError, match="bwd_s has 1"):
        asymmetric_pipeline_time([1.0, 1.0], [1.0], 2)
