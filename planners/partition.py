"""Graph planner: minimax contiguous layer partition under memory caps (ElasWave §4.2, Alg. 1).

f[p, l] = min_{k in [p-1, l-1]} max(f[p-1, k], t_p([k+1..l]))  s.t. Mem_p[k+1..l] <= cap_p   (eq. 3)

Stages are heterogeneous (different DP sizes, micro-batch sizes, frequencies), so segment costs
depend on the stage: `t_p` and `Mem_p` come as (L+1) x (L+1) matrices indexed by 0-based
half-open layer ranges [k, l). The recurrence is evaluated exactly (no monotonicity assumption),
vectorised over (k, l) with numpy: O(P L^2) arithmetic but only O(P) numpy calls, a few ms for
L=128, P=32. The device count never enters: devices only change the per-stage micro-batch sizes
already folded into t_p and Mem_p.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from planners.costmodel import CostModel
from planners.layout import Layout

SegmentMatrix = Callable[[int], np.ndarray]  # stage p -> (L+1, L+1) matrix over [k, l)


@dataclass(frozen=True)
class PartitionResult:
    """`boundaries` are Algorithm 1's b_1..b_{P-1}: stage p (1-based) holds layers b_{p-1}+1..b_p."""

    feasible: bool
    boundaries: tuple[int, ...]
    worst_stage_time: float
    stage_times: tuple[float, ...]
    stage_mem: tuple[float, ...]
    reason: str


def minimax_partition(
    num_layers: int,
    num_stages: int,
    seg_time: SegmentMatrix,
    seg_mem: SegmentMatrix,
    mem_cap: Sequence[float],
) -> PartitionResult:
    """Algorithm 1: optimal worst-stage time over all feasible P-way contiguous partitions."""
    L, P = num_layers, num_stages
    if P < 1 or L < 1:
        raise ValueError(f"need at least one layer and one stage, got L={L}, P={P}")
    if P > L:
        return _infeasible(f"{P} stages cannot each hold a layer of a {L}-layer model")
    valid = np.triu(np.ones((L + 1, L + 1), dtype=bool), k=1)  # k < l: non-empty segments
    choices: list[np.ndarray] = []
    times_of = [seg_time(p) for p in range(P)]  # each matrix is built once
    mems_of = [seg_mem(p) for p in range(P)]
    f = np.where(valid[0] & (mems_of[0][0] <= mem_cap[0]), times_of[0][0], np.inf)
    for p in range(1, P):
        fits = valid & (mems_of[p] <= mem_cap[p])
        cand = np.where(fits, np.maximum(f[:, None], times_of[p]), np.inf)
        choices.append(np.argmin(cand, axis=0))
        f = cand[choices[-1], np.arange(L + 1)]
    if not math.isfinite(f[L]):
        return _infeasible(_why_infeasible(L, P, mems_of, mem_cap))
    bounds = [L]
    for p in range(P - 1, 0, -1):  # Alg. 1 line 8: b_{p-1} = k*(p, b_p)
        bounds.append(int(choices[p - 1][bounds[-1]]))
    edges = [0, *reversed(bounds)]
    times = tuple(float(times_of[p][edges[p], edges[p + 1]]) for p in range(P))
    mems = tuple(float(mems_of[p][edges[p], edges[p + 1]]) for p in range(P))
    worst = int(np.argmax(times))
    return PartitionResult(
        True,
        tuple(edges[1:-1]),
        float(f[L]),
        times,
        mems,
        f"minimax partition of {L} layers over {P} stages: worst mini-step "
        f"{f[L]:.6g} s on stage {worst} (layers {edges[worst] + 1}..{edges[worst + 1]})",
    )


def _infeasible(reason: str) -> PartitionResult:
    return PartitionResult(False, (), math.inf, (), (), "infeasible: " + reason)


def _why_infeasible(L: int, P: int, mems_of: list[np.ndarray], cap: Sequence[float]) -> str:
    no_layer_fits = [p for p in range(P) if not np.any(np.diagonal(mems_of[p], offset=1) <= cap[p])]
    if no_layer_fits:
        return f"stage(s) {no_layer_fits} cannot hold even one layer within their memory caps"
    return (
        f"no split of {L} layers into {P} contiguous non-empty blocks keeps every stage within its memory cap"
    )


def _segment_sums(per_layer: np.ndarray) -> np.ndarray:
    """(..., L+1, L+1) sums over layers [k, l) from prefix sums of (..., L) per-layer values
    (the lower triangle, k > l, is meaningless and masked by the solver)."""
    prefix = np.concatenate((np.zeros(per_layer.shape[:-1] + (1,)), np.cumsum(per_layer, axis=-1)), axis=-1)
    return prefix[..., None, :] - prefix[..., :, None]


@dataclass(frozen=True)
class AdditiveCosts:
    """t_p([a..b]) = overhead_p + sum of layer_cost[p]; Mem likewise; the CLI's JSON model."""

    layer_cost: np.ndarray  # (P, L)
    stage_overhead: np.ndarray  # (P,)
    layer_mem: np.ndarray  # (P, L)
    stage_mem_base: np.ndarray  # (P,)
    mem_cap: np.ndarray  # (P,)

    def solve(self) -> PartitionResult:
        P, L = self.layer_cost.shape
        # Every stage's (L+1, L+1) table in one numpy call each, as rebalance_layers does.
        times = np.asarray(self.stage_overhead)[:, None, None] + _segment_sums(np.asarray(self.layer_cost))
        mems = np.asarray(self.stage_mem_base)[:, None, None] + _segment_sums(np.asarray(self.layer_mem))
        return minimax_partition(L, P, times.__getitem__, mems.__getitem__, [float(c) for c in self.mem_cap])


def solve_partition_request(req: Any) -> dict[str, Any]:
    """JSON entry point of `elaswave plan partition --input FILE`.

    Input: {"layer_cost": P x L, "stage_overhead": P, "layer_mem": P x L, "stage_mem_base": P,
    "mem_cap": P}. Output: {"feasible", "boundaries" (1-based b_1..b_{P-1}), "worst_stage_time",
    "stage_times", "stage_mem", "reason"}; when infeasible the numbers are null and lists empty.
    Malformed input raises ValueError naming the field.
    """
    result = parse_partition_request(req).solve()
    return {
        "feasible": result.feasible,
        "boundaries": list(result.boundaries),
        "worst_stage_time": result.worst_stage_time if result.feasible else None,
        "stage_times": list(result.stage_times),
        "stage_mem": list(result.stage_mem),
        "reason": result.reason,
    }


def parse_partition_request(req: Any) -> AdditiveCosts:
    if not isinstance(req, dict):
        raise ValueError(f"request must be a JSON object, got {type(req).__name__}")
    unknown = set(req) - {"layer_cost", "stage_overhead", "layer_mem", "stage_mem_base", "mem_cap"}
    if unknown:
        raise ValueError(f"unknown field(s) {sorted(unknown)}")
    layer_cost = _matrix(req, "layer_cost")
    P, L = layer_cost.shape
    layer_mem = _matrix(req, "layer_mem")
    if layer_mem.shape != (P, L):
        raise ValueError(
            f"layer_mem must be {P} lists of {L} numbers like layer_cost, got shape "
            f"{layer_mem.shape[0]} x {layer_mem.shape[1]}"
        )
    return AdditiveCosts(
        layer_cost,
        _vector(req, "stage_overhead", P),
        layer_mem,
        _vector(req, "stage_mem_base", P),
        _vector(req, "mem_cap", P),
    )


def _numbers(values: Any, field: str) -> np.ndarray:
    if not isinstance(values, list) or not values:
        raise ValueError(f"{field} must be a non-empty list of numbers")
    if any(isinstance(v, bool) or not isinstance(v, int | float) for v in values):
        raise ValueError(f"{field} must contain only numbers")
    arr = np.asarray(values, dtype=float)
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{field} must contain only finite numbers")
    return arr


def _matrix(req: dict[str, Any], field: str) -> np.ndarray:
    if field not in req:
        raise ValueError(f"{field} is missing")
    rows = req[field]
    if not isinstance(rows, list) or not rows:
        raise ValueError(f"{field} must be a non-empty list (one list of per-layer numbers per stage)")
    arrs = [_numbers(r, f"{field}[{p}]") for p, r in enumerate(rows)]
    if len({len(a) for a in arrs}) != 1:
        raise ValueError(
            f"{field} rows must all have the same number of layers, got {[len(a) for a in arrs]}"
        )
    return np.stack(arrs)


def _vector(req: dict[str, Any], field: str, P: int) -> np.ndarray:
    if field not in req:
        raise ValueError(f"{field} is missing")
    arr = _numbers(req[field], field)
    if len(arr) != P:
        raise ValueError(f"{field} must have one number per stage ({P}), got {len(arr)}")
    return arr


# ------------------------------------------------------------------ graph planner over a Layout


@dataclass(frozen=True)
class GraphPlan:
    layout: Layout
    partition: PartitionResult
    reason: str


def apply_boundaries(layout: Layout, boundaries: Sequence[int]) -> Layout:
    """Same ranks and splits, new layer blocks from Algorithm 1's 1-based right boundaries."""
    if len(boundaries) != layout.num_stages - 1:
        raise ValueError(
            f"{layout.num_stages} stages need {layout.num_stages - 1} boundaries, got {len(boundaries)}"
        )
    edges = [0, *boundaries, layout.num_layers]
    if any(a >= b for a, b in zip(edges, edges[1:], strict=False)):
        raise ValueError(
            f"boundaries {list(boundaries)} must increase strictly within (0, {layout.num_layers})"
        )
    stages = tuple(
        replace(s, layer_start=edges[p], layer_stop=edges[p + 1]) for p, s in enumerate(layout.stages)
    )
    return replace(layout, stages=stages)


@dataclass(frozen=True)
class SegmentTables:
    """(P, L+1, L+1) mini-step times and memory of every layer range [k, l) on every stage of a
    layout: eq. (1) and the memory model. Built once per plan and shared by Algorithm 1 and any
    constrained search over the same costs (planners.elaswave_graph)."""

    times: np.ndarray
    mems: np.ndarray


def segment_tables(layout: Layout, cost: CostModel) -> SegmentTables:
    """Every stage's tables in one numpy call each, from (P, L) per-layer costs."""
    conds = cost.conditions(layout)
    compute = [cost.stage_compute(c) for c in conds]
    fwd, bwd = np.stack([f for f, _ in compute]), np.stack([b for _, b in compute])
    p2p_f = np.array([c.p2p_f_s for c in conds])[:, None, None]
    p2p_b = np.array([c.p2p_b_s for c in conds])[:, None, None]
    times = np.asarray(cost.ministep(_segment_sums(fwd), _segment_sums(bwd), p2p_f, p2p_b))
    layer_mem = np.stack([cost.layer_mem_bytes(layout, p, c.micro_batch) for p, c in enumerate(conds)])
    return SegmentTables(times, np.asarray(cost.memory.stage_base_bytes + _segment_sums(layer_mem)))


def rebalance_layers(layout: Layout, cost: CostModel, tables: SegmentTables | None = None) -> GraphPlan:
    """Re-partition layers for the layout's current ranks, micro-batches and frequencies with the
    eq. (1) cost model and the layout's memory caps (none = unbounded). `tables`: the layout's
    `segment_tables`, when the caller already built them."""
    caps = layout.stage_mem_cap_bytes or (math.inf,) * layout.num_stages
    built = tables if tables is not None else segment_tables(layout, cost)
    times, mems = built.times, built.mems

    def seg_time(p: int) -> np.ndarray:
        return np.asarray(times[p])

    def seg_mem(p: int) -> np.ndarray:
        return np.asarray(mems[p])

    result = minimax_partition(layout.num_layers, layout.num_stages, seg_time, seg_mem, caps)
    if not result.feasible:
        return GraphPlan(layout, result, f"layers not moved: {result.reason}")
    new = apply_boundaries(layout, result.boundaries)
    moved = sum(
        1
        for a, b in zip(layout.stages, new.stages, strict=True)
        if (a.layer_start, a.layer_stop) != (b.layer_start, b.layer_stop)
    )
    return GraphPlan(
        new,
        result,
        f"{result.reason}; boundaries {list(layout.boundaries)} -> "
        f"{list(result.boundaries)} ({moved} stages change layers)",
    )
