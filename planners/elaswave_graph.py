"""ElasWave's graph step (§4.2): Algorithm 1 under the executor's adjacency rule.

Algorithm 1 (`planners.partition.rebalance_layers`) minimises the worst mini-step only, and many
partitions often share that optimum; among those in which every block moves at most one stage
(what the executor migrates between neighbours, §6.2) we take the least summed stage time (the
1F1B warm-up and cool-down of `CostModel.step_time`), then the fewest moved blocks. When no
optimal partition moves every block at most one stage, Algorithm 1's own is taken (the executor
applies longer moves by one rebuild from live shards, executor/fabric/rebuild.py). When the move
lowers the predicted step time by no more than `min_gain`, the plan stays resize-only and says
why. The (P, L+1, L+1) segment tables are built once per plan
(`planners.partition.segment_tables`) and serve both searches.
"""

from __future__ import annotations

import math

import numpy as np

from planners.elaswave_model import JobModel, costing
from planners.elaswave_reasons import Outcome, Reason, Step
from planners.layout import Layout
from planners.partition import (
    SegmentTables,
    apply_boundaries,
    rebalance_layers,
    segment_tables,
)


def repartition(
    resized: Layout, factors: dict[int, float], model: JobModel, min_gain: float
) -> tuple[Layout, Reason]:
    """Algorithm 1 on the resized layout; adopted only when it pays and the executor can apply it."""
    base = costing(resized, factors, model.nominal_mhz, current_clocks=False)
    tables = segment_tables(base, model.cost)
    plan = rebalance_layers(base, model.cost, tables)
    if not plan.partition.feasible:
        return resized, _declined(f"re-partition not possible ({plan.reason}): resize only")
    t0 = model.cost.step_time(base)
    # Prefer an equally good partition that moves every block at most one stage (a migration
    # between neighbours); else Algorithm 1's own, whose longer moves the executor applies by
    # one rebuild (executor/fabric/rebuild.py).
    bounds = adjacent_optimum(base, tables, plan.partition.worst_stage_time) or plan.partition.boundaries
    candidate = apply_boundaries(base, bounds)
    moves, t1 = block_moves(resized, candidate), model.cost.step_time(candidate)
    if not moves:
        return resized, Reason(
            Step.GRAPH,
            Outcome.KEPT,
            f"no unit moves: the current boundaries {list(resized.boundaries)} are optimal (Algorithm 1)",
        )
    if t1 >= t0 * (1 - min_gain):
        return resized, _declined(
            f"re-partition not adopted: moving {describe(moves)} would change the predicted step only "
            f"{t0:.4g} -> {t1:.4g} {model.unit} (needs > {min_gain:.0%} gain): resize only"
        )
    headline = f"re-partition (Algorithm 1, §4.2): {describe(moves)}"
    return apply_boundaries(resized, bounds), Reason(
        Step.GRAPH,
        Outcome.CHANGED,
        f"{headline}; boundaries {list(resized.boundaries)} -> {list(bounds)}; "
        f"predicted step {t0:.4g} -> {t1:.4g} {model.unit}",
        headline,
    )


def _declined(text: str) -> Reason:
    return Reason(Step.GRAPH, Outcome.DECLINED, text)


def block_moves(old: Layout, new: Layout) -> list[tuple[int, int, int]]:
    """(block, from stage, to stage) of every block whose stage changes."""
    edges_old, edges_new = [0, *old.boundaries], [0, *new.boundaries]
    stage_old = np.searchsorted(edges_old, np.arange(old.num_layers), side="right") - 1
    stage_new = np.searchsorted(edges_new, np.arange(new.num_layers), side="right") - 1
    return [(int(b), int(stage_old[b]), int(stage_new[b])) for b in np.flatnonzero(stage_old != stage_new)]


def describe(moves: list[tuple[int, int, int]], most: int = 8) -> str:
    said = ", ".join(f"unit {b} stage {a}->{c}" for b, a, c in moves[:most])
    return said if len(moves) <= most else f"{said}, ... ({len(moves)} units)"


def adjacent_optimum(layout: Layout, tables: SegmentTables, worst: float) -> tuple[int, ...] | None:
    """A partition with Algorithm 1's optimal worst mini-step `worst`, within the memory caps, in
    which every block moves at most one stage; among those the least summed stage time (the 1F1B
    warm-up and cool-down), then the fewest moved blocks. The same DP as eq. (3) with a sum in
    place of the max over segments allowed for each stage: stage p may start no earlier than old
    stage p-1 and end no later than old stage p+1. None when no optimal partition qualifies."""
    times, mems = tables.times, tables.mems
    P, L = layout.num_stages, layout.num_layers
    edges = np.array([0, *layout.boundaries, L])
    k, ell = np.arange(L + 1)[:, None], np.arange(L + 1)[None, :]
    caps = np.asarray(layout.stage_mem_cap_bytes or (math.inf,) * P)[:, None, None]
    ok = (k < ell) & (times <= worst * (1 + 1e-9)) & (mems <= caps)
    penalty = 1e-6 * worst / max(1, L)  # per moved block: breaks ties only
    seg = []
    for p in range(P):
        lo, hi = edges[max(p - 1, 0)], edges[min(p + 2, P)]
        stays = np.clip(np.minimum(ell, edges[p + 1]) - np.maximum(k, edges[p]), 0, None)
        allowed = ok[p] & (k >= lo) & (ell <= hi)
        seg.append(np.where(allowed, times[p] + penalty * ((ell - k) - stays), np.inf))
    g, choices = seg[0][0], []
    for p in range(1, P):
        cand = g[:, None] + seg[p]
        choices.append(np.argmin(cand, axis=0))
        g = cand[choices[-1], np.arange(L + 1)]
    if not math.isfinite(g[L]):
        return None
    bounds = [L]
    for p in range(P - 1, 0, -1):
        bounds.append(int(choices[p - 1][bounds[-1]]))
    return tuple(reversed(bounds[1:]))
