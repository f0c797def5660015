"""ElasWave's DVFS step (§4.3): per-rank clocks of a planned layout.

The residual straggler stage is up-clocked just enough to meet the next slowest stage
(`planners.dvfs.plan_straggler_frequency`), never above the device maximum. A stage holding a
fail-slow rank that cannot be fully compensated runs its slow ranks at the maximum (Alg. 2's
UNACHIEVABLE answer); a healthy stage is not up-clocked for a target it cannot reach (the paper's
minimum uplift: clocks age devices). The layout's clocks are kept (an operator may have pinned
them) except where DVFS plans a new one, and when a fail-slow rank recovers: its stage's
up-clocked ranks are then pinned back at the nominal clock (not unpinned: the Core sends
SetFrequency only for pinned ranks). A clock within `hysteresis_mhz` of the current one is kept.
"""

from __future__ import annotations

import math
from collections.abc import Set
from dataclasses import replace

from planners.dvfs import plan_straggler_frequency
from planners.elaswave_model import JobModel, costing
from planners.elaswave_reasons import Outcome, Reason, Step
from planners.layout import Layout


def plan_clocks(
    graph: Layout,
    factors: dict[int, float],
    model: JobModel,
    old: Layout,
    recovered: Set[int],
    hysteresis_mhz: int,
) -> tuple[tuple[tuple[int, int], ...], list[Reason]]:
    """Per-rank clocks of the new layout and the reasons for them."""
    wanted, reasons = straggler_clocks(graph, factors, model)
    ranks = set(graph.ranks())
    clocks = {r: mhz for r, mhz in old.frequencies_mhz if r in ranks}
    kept = sorted(
        r for r, mhz in wanted.items() if abs(mhz - clocks.get(r, model.nominal_mhz)) <= hysteresis_mhz
    )
    clocks.update({r: mhz for r, mhz in wanted.items() if r not in kept})
    if kept:
        text = f"ranks {kept} keep their clock: within {hysteresis_mhz} MHz of the planned one (hysteresis)"
        if len(kept) == len(wanted):  # the planned up-clock changes nothing
            reasons = [replace(r, outcome=Outcome.KEPT, headline="") for r in reasons]
        reasons.append(Reason(Step.CLOCK, Outcome.KEPT, text, text))
    calm = {graph.stage_of_rank(r) for r in recovered if r in ranks}
    restored = sorted(
        r
        for r, mhz in clocks.items()
        if mhz > model.nominal_mhz and r not in wanted and graph.stage_of_rank(r) in calm
    )
    clocks.update(dict.fromkeys(restored, model.nominal_mhz))
    if restored:
        headline = f"ranks {restored} back to the nominal {model.nominal_mhz} MHz"
        reasons.append(
            Reason(
                Step.CLOCK,
                Outcome.CHANGED,
                f"{headline} (their stage's fail-slow worker recovered, so the up-clock is no longer needed)",
                headline,
            )
        )
    return tuple(sorted(clocks.items())), reasons


def straggler_clocks(
    graph: Layout, factors: dict[int, float], model: JobModel
) -> tuple[dict[int, int], list[Reason]]:
    """Algorithm 2's model-based answer for the slowest stage (`plan_straggler_frequency`), turned
    from effective clocks into the device clock of each of its ranks."""
    base = costing(graph, factors, model.nominal_mhz, current_clocks=False)
    plan = plan_straggler_frequency(base, model.cost, f_max=10 * model.max_mhz)  # bounded per rank below
    if plan.mhz is None or plan.layout == base:
        return {}, [Reason(Step.CLOCK, Outcome.KEPT, f"no up-clock: {plan.reason}")]
    stage = graph.stages[plan.stage]
    need = {r: math.ceil(plan.mhz * factors.get(r, 1.0) - 1e-6) for r in stage.ranks}
    slow = [r for r in stage.ranks if r in factors]
    target: float = plan.mhz
    if max(need.values()) > model.max_mhz:
        if not slow:
            return {}, [
                Reason(
                    Step.CLOCK,
                    Outcome.DECLINED,
                    f"no up-clock: stage {plan.stage} would need {max(need.values())} MHz > the maximum "
                    f"{model.max_mhz} MHz (unachievable, §4.3 Alg. 2)",
                )
            ]
        target = min(model.max_mhz / factors.get(r, 1.0) for r in stage.ranks)
        need = {r: min(model.max_mhz, math.ceil(target * factors.get(r, 1.0) - 1e-6)) for r in stage.ranks}
    up = {r: mhz for r, mhz in need.items() if mhz > model.nominal_mhz}
    if not up:
        return {}, [
            Reason(Step.CLOCK, Outcome.KEPT, f"no up-clock: stage {plan.stage} already meets its target")
        ]
    how = "" if target == plan.mhz else f" (capped at the maximum {model.max_mhz} MHz: gap not fully closed)"
    said = ", ".join(f"rank {r} at {mhz} MHz" for r, mhz in sorted(up.items()))
    text = f"DVFS (§4.3): up-clock stage {plan.stage}: {said}{how}"
    return up, [Reason(Step.CLOCK, Outcome.CHANGED, text, text)]
