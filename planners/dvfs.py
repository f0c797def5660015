"""DVFS planner: up-clock only the residual straggler stage, by the least amount (ElasWave §4.3).

Algorithm 2 (minimum bisection frequency scaling) is written as a pure generator: it yields the
frequency to apply next and receives the stage's observed mini-step time for a window, so the
planner never touches a device or a clock. `run_bisection` drives it against any
`FrequencyController` (NVML, npu-smi, or the simulated controller of the executor). A model-based
first guess (compute time ~ 1/f, the rest fixed) narrows the bracket so the bisection starts next
to the answer. Observed times are assumed non-increasing in frequency, as the bisection requires.
"""

from __future__ import annotations

import math
from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Literal, Protocol

from planners.costmodel import CostModel
from planners.layout import Layout

Status = Literal["ACHIEVABLE", "UNACHIEVABLE"]


class FrequencyController(Protocol):
    def apply(self, rank: int, mhz: int) -> None: ...

    def observe(self, window: int) -> Mapping[int, float]:
        """Mean mini-step time per stage over the next `window` steps."""
        ...


@dataclass(frozen=True)
class DvfsResult:
    mhz: int
    status: Status
    probes: tuple[tuple[int, float], ...]  # (MHz applied, observed seconds) in order
    reason: str


def bisection_search(
    f_cur: int, f_max: int, target_s: float, eps_s: float, df_min: int, guess: int | None = None
) -> Generator[int, float, DvfsResult]:
    """Algorithm 2. Yields a frequency to apply (the first yield is `f_cur`, just observed) and
    expects the observed stage time back via `send`; returns the DvfsResult.

    A stage already within `eps_s` of the target, or faster, keeps `f_cur` (Alg. 2 only
    up-clocks). `guess` (e.g. `model_frequency_guess`) is probed first; a feasible guess becomes
    the upper end of the bracket, an infeasible one the lower end, so the result is still the
    lowest feasible frequency on the `df_min` grid above `f_cur`.
    """
    if not (0 < f_cur <= f_max) or df_min < 1 or eps_s < 0 or target_s <= 0:
        raise ValueError(
            f"need 0 < f_cur <= f_max, df_min >= 1, eps >= 0, target > 0; got f_cur={f_cur}, "
            f"f_max={f_max}, df_min={df_min}, eps={eps_s}, target={target_s}"
        )
    probes: list[tuple[int, float]] = []

    def probe(mhz: int) -> Generator[int, float, float]:
        t = yield mhz
        probes.append((mhz, t))
        return t

    t_cur = yield from probe(f_cur)
    if t_cur <= target_s + eps_s:  # line 2, extended: already at or below target
        return DvfsResult(
            f_cur,
            "ACHIEVABLE",
            tuple(probes),
            f"stage at {f_cur} MHz takes {t_cur:.6g} s, within {eps_s:g} s of target {target_s:.6g} s",
        )
    t_max = yield from probe(f_max)
    if t_max > target_s + eps_s:  # line 5: not compute-bound
        return DvfsResult(
            f_max,
            "UNACHIEVABLE",
            tuple(probes),
            f"even at f_max={f_max} MHz the stage takes {t_max:.6g} s > target {target_s:.6g} s "
            f"+ {eps_s:g} s: the gap is not compute-bound",
        )
    lo, hi = f_cur, f_max  # invariant: lo infeasible, hi feasible
    if guess is not None and lo + df_min < guess < hi:
        ok = (yield from probe(guess)) <= target_s + eps_s
        lo, hi = (lo, guess) if ok else (guess, hi)
        # Probe one grid step on the other side of the guess: a good guess closes the bracket.
        side = guess - df_min if ok else guess + df_min
        if lo < side < hi:
            side_ok = (yield from probe(side)) <= target_s + eps_s
            lo, hi = (lo, side) if side_ok else (side, hi)
    while hi - lo > df_min:  # line 8: BISECT_MIN_FEASIBLE
        mid = (lo + hi) // 2
        if (yield from probe(mid)) <= target_s + eps_s:
            hi = mid
        else:
            lo = mid
    return DvfsResult(
        hi,
        "ACHIEVABLE",
        tuple(probes),
        f"lowest frequency meeting {target_s:.6g} s (+{eps_s:g}) is {hi} MHz "
        f"(up from {f_cur} MHz, {len(probes)} observations)",
    )


def run_bisection(
    controller: FrequencyController,
    ranks: Sequence[int],
    stage: int,
    window: int,
    f_cur: int,
    f_max: int,
    target_s: float,
    eps_s: float,
    df_min: int,
    guess: int | None = None,
) -> DvfsResult:
    """Drive `bisection_search` on a real or simulated controller; leaves the stage's ranks at the
    chosen frequency."""
    search = bisection_search(f_cur, f_max, target_s, eps_s, df_min, guess)
    mhz = next(search)
    while True:
        for r in ranks:
            controller.apply(r, mhz)
        observed = controller.observe(window)[stage]
        try:
            mhz = search.send(observed)
        except StopIteration as done:
            result: DvfsResult = done.value
            break
    for r in ranks:
        controller.apply(r, result.mhz)
    return result


def model_frequency_guess(compute_s: float, other_s: float, f_cur: int, target_s: float) -> int | None:
    """Frequency at which `compute_s * f_cur / f + other_s == target_s` (compute ~ 1/f, exposed
    communication fixed); None when no frequency can reach the target."""
    if compute_s <= 0 or target_s <= other_s:
        return None
    exact = compute_s * f_cur / (target_s - other_s)
    return math.ceil(exact * (1 - 1e-9))  # ignore float noise: 2000.0000001 MHz means 2000


def stage_time_split(cost: CostModel, layout: Layout, stage: int) -> tuple[float, float]:
    """(compute, the rest: exposed communication and the fixed overhead) seconds of `stage`'s
    mini-step under eq. (1); an up-clock shortens only the first."""
    cond = cost.conditions(layout)[stage]
    s = layout.stages[stage]
    fwd, bwd = cost.stage_compute(cond)
    tf, tb = float(fwd[s.layer_start : s.layer_stop].sum()), float(bwd[s.layer_start : s.layer_stop].sum())
    total = float(cost.ministep(tf, tb, cond.p2p_f_s, cond.p2p_b_s))
    return tf + tb, total - tf - tb


@dataclass(frozen=True)
class FrequencyPlan:
    layout: Layout
    stage: int
    mhz: int | None
    reason: str


def plan_straggler_frequency(layout: Layout, cost: CostModel, f_max: int) -> FrequencyPlan:
    """Model-only plan: up-clock the slowest stage just enough to match the next slowest one.

    The result (frequencies in the new Layout) is the starting point that `run_bisection` then
    confirms against observed times.
    """
    times = cost.stage_times(layout)
    if len(times) < 2:
        return FrequencyPlan(layout, 0, None, "single stage: no straggler to align")
    slow = max(range(len(times)), key=times.__getitem__)
    target = max(t for p, t in enumerate(times) if p != slow)
    compute, other = stage_time_split(cost, layout, slow)
    freqs = dict(layout.frequencies_mhz)
    ranks = layout.stages[slow].ranks
    f_cur = slowest_clock(freqs, ranks, cost.profile.ref_mhz)
    guess = model_frequency_guess(compute, other, f_cur, target)
    if guess is None or guess > f_max:
        return FrequencyPlan(
            layout,
            slow,
            None,
            f"stage {slow} ({times[slow]:.6g} s) cannot reach {target:.6g} s by f_max={f_max} MHz",
        )
    if guess <= f_cur:
        return FrequencyPlan(layout, slow, f_cur, f"stage {slow} already balanced at {f_cur} MHz")
    freqs.update(dict.fromkeys(ranks, guess))  # built in C: a stage may have 25,000 ranks
    ordered = sorted(freqs)  # sorting ints, not (rank, MHz) tuples: ~10x cheaper at 25,000 ranks
    new = replace(layout, frequencies_mhz=tuple(zip(ordered, map(freqs.__getitem__, ordered), strict=True)))
    return FrequencyPlan(
        new,
        slow,
        guess,
        f"up-clock stage {slow} {f_cur}->{guess} MHz: "
        f"{times[slow]:.6g} s -> {target:.6g} s (model, compute ~ 1/f)",
    )


def slowest_clock(freqs: Mapping[int, int], ranks: Sequence[int], default: int) -> int:
    """min over `ranks` of `freqs.get(rank, default)`, with the membership tests done in C."""
    locked = freqs.keys() & ranks
    slowest = min(map(freqs.__getitem__, locked), default=default)
    if len(locked) < len(ranks) and len(locked) < len(set(ranks)):  # some rank runs at the default
        slowest = min(slowest, default)
    return slowest
