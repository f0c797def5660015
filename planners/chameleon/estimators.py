"""Chameleon's step-time estimators (Chameleon §IV-C, eq. 9-13).

Symmetric 1F1B pipelines use the closed forms of eq. (9), (12) and (13); asymmetric pipelines
(stages with different forward/backward times, pipelines with different micro-batch counts) use
the event-driven recurrence of eq. (11): an operation starts when the previous operation on its
stage and the operation it depends on in the neighbouring stage have both finished. The step
time of several pipelines that update synchronously is the slowest one, eq. (10).

Pure functions: times are seconds, nothing here reads a clock.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StepEstimate:
    """A predicted step time, whether the configuration can run at all, and why."""

    step_time_s: float
    feasible: bool
    reason: str


def symmetric_step_time(n_pp: int, n_m: int, t_f: float, t_b: float) -> StepEstimate:
    """Eq. (9): `(N_pp + N_m - 1) (T_f + T_b)` for a balanced 1F1B pipeline."""
    _check_shape(n_pp, n_m)
    t = (n_pp + n_m - 1) * (t_f + t_b)
    return StepEstimate(t, True, f"eq. 9: ({n_pp} + {n_m} - 1) x {t_f + t_b:.6g} s")


def rerouting_step_time_single(n_pp: int, n_m: int, n_dp: int, t_f: float, t_b: float) -> StepEstimate:
    """Eq. (12): one failed node whose micro-batches are spread over its `N_dp - 1` DP peers."""
    _check_shape(n_pp, n_m)
    if n_dp < 2:
        return StepEstimate(float("inf"), False, "eq. 12: rerouting needs at least one DP peer (N_dp >= 2)")
    t = (n_pp + n_m - 1 + n_m / (n_dp - 1)) * (t_f + t_b)
    return StepEstimate(t, True, f"eq. 12: one failure rerouted to {n_dp - 1} peers")


def rerouting_step_time(
    n_pp: int,
    n_m: int,
    n_dp: int,
    failed_per_stage: Sequence[int],
    t_f: float,
    t_b: float,
    *,
    bottleneck: bool = False,
) -> StepEstimate:
    """Eq. (13): `N_f` failures spread as `F_i` per stage, rerouted to the stage's live DP peers.

    The paper sums the extra work of every affected stage. With `bottleneck=True` only the most
    affected stage counts: in 1F1B the extra work of different stages runs on different devices
    and overlaps, so the sum over-estimates; the simulator's ReCycle model uses this form.
    """
    _check_shape(n_pp, n_m)
    if len(failed_per_stage) != n_pp:
        raise ValueError(f"failed_per_stage has {len(failed_per_stage)} entries, expected N_pp={n_pp}")
    if any(f < 0 for f in failed_per_stage):
        raise ValueError(f"failed_per_stage must be non-negative, got {tuple(failed_per_stage)}")
    worst = max(failed_per_stage, default=0)
    if worst >= n_dp:
        stage = list(failed_per_stage).index(worst)
        return StepEstimate(
            float("inf"),
            False,
            f"eq. 13: stage {stage} lost {worst} of {n_dp} DP ranks; rerouting cannot "
            "recover, dynamic parallelism is required",
        )
    extras = [n_m * f / (n_dp - f) for f in failed_per_stage if f > 0]
    extra = (max(extras) if bottleneck else sum(extras)) if extras else 0.0
    t = (n_pp + n_m - 1 + extra) * (t_f + t_b)
    form = "bottleneck stage" if bottleneck else "sum over stages"
    return StepEstimate(
        t, True, f"eq. 13 ({form}): {sum(failed_per_stage)} failures add {extra:.4g} mini-steps"
    )


def one_f_one_b_order(stage: int, n_pp: int, n_m: int) -> list[tuple[str, int]]:
    """The 1F1B execution order of one stage: warm-up forwards, steady F/B pairs, cool-down backwards."""
    warmup = min(n_pp - stage - 1, n_m)
    order: list[tuple[str, int]] = [("F", j) for j in range(warmup)]
    next_f, next_b = warmup, 0
    while next_b < n_m:
        if next_f < n_m:
            order.append(("F", next_f))
            next_f += 1
        order.append(("B", next_b))
        next_b += 1
    return order


def asymmetric_pipeline_time(
    fwd_s: Sequence[float], bwd_s: Sequence[float], n_m: int, p2p_s: float = 0.0
) -> float:
    """Eq. (11): makespan of one 1F1B pipeline whose stages have their own F/B times.

    `t_start(i, j) = max(t_end(i, j-1), t_end(f1(i), f2(j)) + p2p)`: the dependency of a forward is
    the same micro-batch's forward on stage i-1, of a backward the same micro-batch's backward on
    stage i+1 (the last stage's backward depends on its own forward, already earlier in its order).
    """
    n_pp = len(fwd_s)
    _check_shape(n_pp, n_m)
    if len(bwd_s) != n_pp:
        raise ValueError(f"fwd_s has {n_pp} stages but bwd_s has {len(bwd_s)}")
    orders = [one_f_one_b_order(i, n_pp, n_m) for i in range(n_pp)]
    f_end = [[-1.0] * n_m for _ in range(n_pp)]
    b_end = [[-1.0] * n_m for _ in range(n_pp)]
    pos = [0] * n_pp
    stage_clock = [0.0] * n_pp
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for i in range(n_pp):
            while pos[i] < len(orders[i]):
                kind, j = orders[i][pos[i]]
                dep = _dependency_end(kind, i, j, n_pp, f_end, b_end, p2p_s)
                if dep is None:
                    break
                start = max(stage_clock[i], dep)
                end = start + (fwd_s[i] if kind == "F" else bwd_s[i])
                (f_end if kind == "F" else b_end)[i][j] = end
                stage_clock[i] = end
                pos[i] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError("1F1B schedule deadlocked; the order generator is inconsistent")
    return max(stage_clock)


def _dependency_end(
    kind: str, i: int, j: int, n_pp: int, f_end: list[list[float]], b_end: list[list[float]], p2p_s: float
) -> float | None:
    """End time (plus transfer) of the operation `(kind, i, j)` waits for; None if not done yet."""
    if kind == "F":
        if i == 0:
            return 0.0
        end = f_end[i - 1][j]
        return None if end < 0 else end + p2p_s
    if i == n_pp - 1:
        end = f_end[i][j]
        return None if end < 0 else end
    end = b_end[i + 1][j]
    return None if end < 0 else end + p2p_s


def multi_pipeline_step_time(
    pipelines: Sequence[tuple[Sequence[float], Sequence[float], int]], p2p_s: float = 0.0
) -> StepEstimate:
    """Eq. (10): synchronous update, so the step takes as long as the slowest pipeline."""
    if not pipelines:
        return StepEstimate(float("inf"), False, "eq. 10: no pipeline left")
    times = [asymmetric_pipeline_time(f, b, m, p2p_s) for f, b, m in pipelines]
    slowest = max(range(len(times)), key=times.__getitem__)
    return StepEstimate(times[slowest], True, f"eq. 10/11: slowest of {len(times)} pipelines is #{slowest}")


def _check_shape(n_pp: int, n_m: int) -> None:
    if n_pp < 1:
        raise ValueError(f"N_pp must be >= 1, got {n_pp}")
    if n_m < 1:
        raise ValueError(f"N_m must be >= 1, got {n_m}")
