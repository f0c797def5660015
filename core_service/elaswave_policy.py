"""ElasWave's schedule-engine policy: resize, re-partition, up-clock (ElasWave §4.1-4.3).

One pure decision per membership change, in the paper's order:

1. dataflow (§4.1): going ranks (LOST/LEFT/PREEMPTING/DRAINING) leave, their stage's survivors
   take their samples (`policies.resize_for_going`, shared with the resize-only baseline);
2. graph (§4.2): Algorithm 1 (`planners.partition.rebalance_layers`) over the eq. (1) cost model,
   under the layout's memory caps. Algorithm 1 minimises the worst mini-step only, and many
   partitions often share that optimum; among those in which every block moves at most one stage
   (what the executor migrates in place, executor/fabric/relayout.py, §6.2) we take the least
   summed stage time (the 1F1B warm-up and cool-down of `CostModel.step_time`), then the fewest
   moved blocks. When no optimal partition qualifies, or the move lowers the predicted step time
   by no more than `min_gain`, the plan stays resize-only and says why;
3. DVFS (§4.3): the residual straggler stage is up-clocked just enough to meet the next slowest
   stage (`planners.dvfs.plan_straggler_frequency`), never above the device maximum. A stage
   holding a fail-slow worker (WorkerState.SLOW, core_service/failslow.py) that cannot be fully
   compensated runs its slow ranks at the maximum (Alg. 2's UNACHIEVABLE answer); a healthy stage
   is not up-clocked for a target it cannot reach (the paper's minimum uplift: clocks age devices).

Fail-slow workers are costed by their slowdown (step time over the median of their stage peers,
measured at their current clock), modelled as a lower effective clock (compute ~ 1/f, as
planners.costmodel does for DVFS). The layout's clocks are kept (an operator may have pinned them)
except where DVFS plans a new one and when a fail-slow worker recovers: its stage's up-clocked
ranks are then pinned back at the nominal clock (not unpinned: the Core sends SetFrequency only
for pinned ranks, membership._send_frequencies). Hysteresis: the detector flags and clears only
after consecutive steps; here a clock within `clock_hysteresis_mhz` of the current one is kept,
and an unchanged layout publishes nothing. A straggler the up-clock fully hides is cleared by the
detector and so loses its clock; if it is still slow it is flagged again after `trigger_steps`
(a cycle the detector's streaks bound, not removed).

Cost model: from the job's registered model (`elaswave plan` state.json) when it has one for this
many layers; otherwise a uniform model in which every block costs the same per sample (backward
twice forward), so a stage's mini-step is proportional to blocks x micro-batch size. The uniform
model is scaled to seconds by the median step time the workers last reported under the current
layout; without reports its times are in model units and the reasons say so.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, replace

import numpy as np

from core_service.config import PolicyName
from core_service.engine import Decision, JobSnapshot, Policy
from core_service.policies import NO_LAYOUT, LayoutPolicy, Resized, going_ranks, resize_for_going
from planners.chameleon.schema import state_from_dict
from planners.chameleon.state import JobProfile
from planners.costmodel import CostModel, LayerProfile, LinkModel, MemoryProfile, ministep_time
from planners.dvfs import plan_straggler_frequency
from planners.layout import Layout
from planners.partition import apply_boundaries, rebalance_layers
from planners.validation import validate

# The simulated controller's default range (agent/frequency.py): the 910B's 1,400 MHz nominal and
# 1,650 MHz maximum (ElasWave §5), used when the job registered no model.
DEFAULT_NOMINAL_MHZ = 1400
DEFAULT_MAX_MHZ = 1650
# FailSlowSettings.ratio's default: the least slowdown that gets a worker flagged, assumed when
# no step times were reported.
DEFAULT_SLOWDOWN = 1.5


@dataclass(frozen=True)
class JobModel:
    cost: CostModel
    nominal_mhz: int
    max_mhz: int
    unit: str  # "s", or "model units" for an uncalibrated uniform model
    reason: str


@dataclass(frozen=True)
class ElasWavePolicy:
    name: str = "elaswave"
    min_gain: float = 0.02  # relative step-time gain a layer migration must buy
    clock_hysteresis_mhz: int = 20
    default_slowdown: float = DEFAULT_SLOWDOWN

    def decide(self, snapshot: JobSnapshot) -> Decision:
        layout = snapshot.layout
        if layout is None:
            return Decision("none", NO_LAYOUT, self.name)
        going = going_ranks(snapshot, layout)
        recovered = recovered_ranks(snapshot, layout)
        if not going and not recovered and not any(w.state == "SLOW" for w in snapshot.live):
            return Decision("none", "no rank of the current layout is leaving, slow or recovered", self.name)
        model = job_model(snapshot, layout)
        slow = slowdowns(snapshot, layout, going, model.nominal_mhz, self.default_slowdown)
        if not going and not slow and not recovered:
            return Decision("none", "no rank of the current layout is leaving, slow or recovered", self.name)
        resized = resize_for_going(layout, going) if going else Resized(layout, ())
        if resized.layout is None:
            return Decision("refuse", resized.refusal, self.name)
        return self._plan(layout, resized, model, slow, recovered)

    def _plan(
        self, old: Layout, resized: Resized, model: JobModel, slow: dict[int, Slowdown], recovered: set[int]
    ) -> Decision:
        assert resized.layout is not None
        factors = {r: s.factor for r, s in slow.items()}
        before = costing(old, factors, model.nominal_mhz, current_clocks=True)
        graph, graph_reasons = repartition(resized.layout, factors, model, self.min_gain)
        clocks, clock_reasons = plan_clocks(graph, factors, model, old, recovered, self.clock_hysteresis_mhz)
        new = replace(graph, frequencies_mhz=clocks)
        report = validate(new)
        if not report.ok:
            return Decision("refuse", "planned layout does not validate: " + report.reason, self.name)
        t_before = model.cost.step_time(before)
        t_after = model.cost.step_time(costing(new, factors, model.nominal_mhz, current_clocks=True))
        predicted = f"predicted step time {t_after:.4g} {model.unit} ({t_before:.4g} before this change)"
        reasons = (
            model.reason,
            *resized.reasons,
            *(s.reason for s in slow.values()),
            *graph_reasons,
            *clock_reasons,
            predicted,
        )
        if new == old:
            return Decision(
                "none",
                "nothing to change: " + "; ".join(reasons[1:]),
                self.name,
                predicted_step_time_s=t_after,
                reasons=reasons,
            )
        return Decision(
            "publish",
            summary(resized, graph_reasons, clock_reasons, reasons[-1]),
            self.name,
            layout=new,
            predicted_step_time_s=t_after,
            reasons=reasons,
        )


def make_policy(name: PolicyName = "elaswave") -> Policy:
    """The Core's policy by its configured name (`CoreSettings.policy`)."""
    if name == "elaswave-resize":
        return LayoutPolicy()
    if name == "elaswave":
        return ElasWavePolicy()
    raise ValueError(f"policy {name!r} is unknown: choose 'elaswave' or 'elaswave-resize'")


def summary(resized: Resized, graph: list[str], clocks: list[str], predicted: str) -> str:
    """One line for the event log: what goes, which blocks move, which clocks change, the prediction."""
    parts = [resized.reasons[-2].split(":")[0]] if resized.reasons else []
    parts += [r.split(";")[0] for r in (*graph, *clocks) if not r.startswith(("no ", "re-partition not"))]
    return "; ".join([*parts, predicted])


# ------------------------------------------------------------------------------------ cost model


def job_model(snapshot: JobSnapshot, layout: Layout) -> JobModel:
    """The registered model's profile when it fits this layout, else the calibrated uniform one."""
    why = "the job registered no model"
    if snapshot.model_json is not None:
        try:
            profile = state_from_dict(json.loads(snapshot.model_json))[0].profile
        except (ValueError, TypeError, KeyError) as exc:
            why = f"its registered model does not parse ({exc})"
        else:
            if profile.num_layers == layout.num_layers:
                return registered_model(profile, layout)
            why = f"its registered model has {profile.num_layers} layers, the layout {layout.num_layers}"
    return uniform_model(layout, snapshot, why)


def registered_model(profile: JobProfile, layout: Layout) -> JobModel:
    """eq. (1) from the state.json profile: per-sample layer times at the nominal clock, P2P per
    sample, memory per byte of the layout's element counts."""
    fwd = tuple((t,) for t in profile.layer_fwd_s)
    bwd = tuple((t,) for t in profile.layer_bwd_s)
    layers = LayerProfile((1,), fwd, bwd, ref_mhz=profile.freq_nominal_mhz)
    per_param = sum(profile.layer_param_bytes) / max(1, sum(layout.layer_numel))
    memory = MemoryProfile(
        tuple(profile.layer_act_bytes),
        per_param,
        per_param,
        per_param * profile.optimizer_bytes_per_param_byte,
    )
    link = LinkModel(boundary_bytes_per_sample=profile.p2p_s_per_sample, bandwidth_bytes_per_s=1.0)
    return JobModel(
        CostModel(layers, memory, link),
        profile.freq_nominal_mhz,
        profile.freq_max_mhz,
        "s",
        "cost model: the job's registered profile (eq. 1)",
    )


def uniform_model(layout: Layout, snapshot: JobSnapshot, why: str) -> JobModel:
    """Every block costs the same per sample (backward = 2 x forward), no exposed P2P; memory from
    the layout's element counts with MemoryProfile's defaults. Scaled so the current layout's
    predicted step time equals the median step time the workers last reported."""
    base = f"cost model: uniform blocks ({why}): a stage's mini-step ~ blocks x micro-batch size"
    cost = _uniform_cost(layout.num_layers, 1.0)
    measured = [w.step_time_s for w in snapshot.live if w.step_time_s and w.state != "SLOW"]
    predicted = cost.step_time(layout)
    if not measured or predicted <= 0:
        return JobModel(
            cost, DEFAULT_NOMINAL_MHZ, DEFAULT_MAX_MHZ, "model units", base + "; times in model units"
        )
    median = statistics.median(measured)
    return JobModel(
        _uniform_cost(layout.num_layers, median / predicted),
        DEFAULT_NOMINAL_MHZ,
        DEFAULT_MAX_MHZ,
        "s",
        base + f"; scaled to the reported median step time {median:.4g} s",
    )


def _uniform_cost(num_layers: int, seconds_per_block_sample: float) -> CostModel:
    fwd, bwd = ((seconds_per_block_sample,),) * num_layers, ((2 * seconds_per_block_sample,),) * num_layers
    return CostModel(
        LayerProfile((1,), fwd, bwd, ref_mhz=DEFAULT_NOMINAL_MHZ),
        MemoryProfile((0.0,) * num_layers),
        LinkModel(0.0, 1.0),
    )


# ------------------------------------------------------------------------------- fail-slow ranks


@dataclass(frozen=True)
class Slowdown:
    factor: float  # compute time at the nominal clock over a healthy peer's
    reason: str


def slowdowns(
    snapshot: JobSnapshot, layout: Layout, going: list[int], nominal_mhz: int, default: float
) -> dict[int, Slowdown]:
    """Slowdown of every SLOW rank that stays, from its step time over its stage peers' median,
    measured at its current clock and referred to the nominal one (compute ~ 1/f)."""
    if not any(w.state == "SLOW" for w in snapshot.live):
        return {}  # the common case: no per-rank table to build
    stage_of = {r: s.stage for s in layout.stages for r in s.ranks}
    clocks = dict(layout.frequencies_mhz)
    healthy: dict[int, list[float]] = {}
    for w in snapshot.live:
        if w.state != "SLOW" and w.step_time_s and w.rank in stage_of:
            healthy.setdefault(stage_of[w.rank], []).append(w.step_time_s)
    out: dict[int, Slowdown] = {}
    for w in snapshot.live:
        if w.state != "SLOW" or w.rank not in stage_of or w.rank in going:
            continue
        peers = healthy.get(stage_of[w.rank], [])
        clock = clocks.get(w.rank, nominal_mhz)
        if w.step_time_s and peers:
            observed = w.step_time_s / statistics.median(peers)
            how = f"step time {w.step_time_s:.4g} s vs stage median {statistics.median(peers):.4g} s at {clock} MHz"
        else:
            observed, how = default, f"no step times: assumed the detector's ratio {default:g}"
        factor = max(1.0, observed * clock / nominal_mhz)
        out[w.rank] = Slowdown(
            factor,
            f"rank {w.rank} (stage {stage_of[w.rank]}) is fail-slow: "
            f"{factor:.3g}x slower at {nominal_mhz} MHz ({how})",
        )
    return out


def costing(layout: Layout, factors: dict[int, float], nominal_mhz: int, *, current_clocks: bool) -> Layout:
    """`layout` with every rank at its effective clock (clock / slowdown) for the cost model;
    `current_clocks=False` prices the job with no up-clock at all (the base of a fresh DVFS plan)."""
    clocks = dict(layout.frequencies_mhz) if current_clocks else {}
    ranks = set(layout.ranks())  # only pinned or slow ranks are visited: 100,000 ranks stay cheap
    effective = {
        r: clocks.get(r, nominal_mhz) / factors.get(r, 1.0)
        for r in clocks.keys() | factors.keys()
        if r in ranks
    }
    pins = tuple(sorted((r, max(1, round(mhz))) for r, mhz in effective.items() if round(mhz) != nominal_mhz))
    return replace(layout, frequencies_mhz=pins)


# ------------------------------------------------------------------------- graph planner (§4.2)


def repartition(
    resized: Layout, factors: dict[int, float], model: JobModel, min_gain: float
) -> tuple[Layout, list[str]]:
    """Algorithm 1 on the resized layout; adopted only when it pays and the executor can apply it."""
    base = costing(resized, factors, model.nominal_mhz, current_clocks=False)
    plan = rebalance_layers(base, model.cost)
    if not plan.partition.feasible:
        return resized, [f"re-partition not possible ({plan.reason}): resize only"]
    best = apply_boundaries(base, plan.partition.boundaries)
    t0, t_best = model.cost.step_time(base), model.cost.step_time(best)
    bounds = adjacent_optimum(base, model.cost, plan.partition.worst_stage_time)
    if bounds is None:
        jumps = [m for m in block_moves(resized, best) if abs(m[1] - m[2]) > 1]
        return resized, [
            f"re-partition not adopted: Algorithm 1's best partition (boundaries "
            f"{list(plan.partition.boundaries)}) moves {describe(jumps)} by more than one stage, and "
            "no partition as good moves every unit at most one; the executor migrates units between "
            f"adjacent stages only (§6.2): resize only (predicted {t0:.4g} -> {t_best:.4g} "
            f"{model.unit} forgone)"
        ]
    candidate = apply_boundaries(base, bounds)
    moves, t1 = block_moves(resized, candidate), model.cost.step_time(candidate)
    if not moves:
        return resized, [
            f"no unit moves: the current boundaries {list(resized.boundaries)} are optimal (Algorithm 1)"
        ]
    if t1 >= t0 * (1 - min_gain):
        return resized, [
            f"re-partition not adopted: moving {describe(moves)} would change the predicted step only "
            f"{t0:.4g} -> {t1:.4g} {model.unit} (needs > {min_gain:.0%} gain): resize only"
        ]
    return apply_boundaries(resized, bounds), [
        f"re-partition (Algorithm 1, §4.2): {describe(moves)}; boundaries {list(resized.boundaries)} -> "
        f"{list(bounds)}; predicted step {t0:.4g} -> {t1:.4g} {model.unit}"
    ]


def block_moves(old: Layout, new: Layout) -> list[tuple[int, int, int]]:
    """(block, from stage, to stage) of every block whose stage changes."""
    edges_old, edges_new = [0, *old.boundaries], [0, *new.boundaries]
    stage_old = np.searchsorted(edges_old, np.arange(old.num_layers), side="right") - 1
    stage_new = np.searchsorted(edges_new, np.arange(new.num_layers), side="right") - 1
    return [(int(b), int(stage_old[b]), int(stage_new[b])) for b in np.flatnonzero(stage_old != stage_new)]


def describe(moves: list[tuple[int, int, int]], most: int = 8) -> str:
    said = ", ".join(f"unit {b} stage {a}->{c}" for b, a, c in moves[:most])
    return said if len(moves) <= most else f"{said}, ... ({len(moves)} units)"


def adjacent_optimum(layout: Layout, cost: CostModel, worst: float) -> tuple[int, ...] | None:
    """A partition with Algorithm 1's optimal worst mini-step `worst`, within the memory caps, in
    which every block moves at most one stage; among those the least summed stage time (the 1F1B
    warm-up and cool-down), then the fewest moved blocks. The same DP as eq. (3) with a sum in
    place of the max over segments allowed for each stage: stage p may start no earlier than old
    stage p-1 and end no later than old stage p+1. None when no optimal partition qualifies."""
    times, mems = segment_tables(layout, cost)
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


def segment_tables(layout: Layout, cost: CostModel) -> tuple[np.ndarray, np.ndarray]:
    """(P, L+1, L+1) mini-step times and memory of every layer range [k, l) on every stage, as
    planners.partition.rebalance_layers builds them."""
    conds = cost.conditions(layout)
    compute = [cost.stage_compute(c) for c in conds]
    fwd, bwd = np.stack([f for f, _ in compute]), np.stack([b for _, b in compute])
    p2p_f = np.array([c.p2p_f_s for c in conds])[:, None, None]
    p2p_b = np.array([c.p2p_b_s for c in conds])[:, None, None]
    times = ministep_time(_sums(fwd), _sums(bwd), p2p_f, p2p_b, cost.link.sigma_f, cost.link.sigma_b)
    layer_mem = np.stack([cost.layer_mem_bytes(layout, p, c.micro_batch) for p, c in enumerate(conds)])
    return np.asarray(times), cost.memory.stage_base_bytes + _sums(layer_mem)


def _sums(per_layer: np.ndarray) -> np.ndarray:
    prefix = np.concatenate((np.zeros(per_layer.shape[:-1] + (1,)), np.cumsum(per_layer, axis=-1)), axis=-1)
    return prefix[..., None, :] - prefix[..., :, None]


# ---------------------------------------------------------------------------------- DVFS (§4.3)


def plan_clocks(
    graph: Layout,
    factors: dict[int, float],
    model: JobModel,
    old: Layout,
    recovered: set[int],
    hysteresis_mhz: int,
) -> tuple[tuple[tuple[int, int], ...], list[str]]:
    """Per-rank clocks of the new layout. The layout's clocks are kept (an operator may have pinned
    them), except: the residual straggler stage gets its up-clock (an old clock within hysteresis
    stays), and up-clocked ranks of a stage whose fail-slow worker recovered, now unneeded, go back
    to nominal - pinned at nominal rather than unpinned, since only pinned ranks get SetFrequency."""
    wanted, reasons = straggler_clocks(graph, factors, model)
    ranks = set(graph.ranks())
    clocks = {r: mhz for r, mhz in old.frequencies_mhz if r in ranks}
    kept = sorted(
        r for r, mhz in wanted.items() if abs(mhz - clocks.get(r, model.nominal_mhz)) <= hysteresis_mhz
    )
    clocks.update({r: mhz for r, mhz in wanted.items() if r not in kept})
    if kept:
        reasons.append(
            f"ranks {kept} keep their clock: within {hysteresis_mhz} MHz of the planned one (hysteresis)"
        )
    calm = {graph.stage_of_rank(r) for r in recovered if r in ranks}
    restored = sorted(
        r
        for r, mhz in clocks.items()
        if mhz > model.nominal_mhz and r not in wanted and graph.stage_of_rank(r) in calm
    )
    clocks.update(dict.fromkeys(restored, model.nominal_mhz))
    if restored:
        reasons.append(
            f"ranks {restored} back to the nominal {model.nominal_mhz} MHz (their stage's fail-slow "
            "worker recovered, so the up-clock is no longer needed)"
        )
    return tuple(sorted(clocks.items())), reasons


def recovered_ranks(snapshot: JobSnapshot, layout: Layout) -> set[int]:
    """Ranks of the layout whose worker recovered from fail-slow since the last plan."""
    recovered = {c.partition(":")[2] for c in snapshot.changes if c.startswith("worker_recovered:")}
    if not recovered:
        return set()
    in_layout = set(layout.ranks())
    return {
        w.rank
        for w in snapshot.live
        if w.worker_id in recovered and w.state != "SLOW" and w.rank in in_layout
    }


def straggler_clocks(
    graph: Layout, factors: dict[int, float], model: JobModel
) -> tuple[dict[int, int], list[str]]:
    """Algorithm 2's model-based answer for the slowest stage (`plan_straggler_frequency`), turned
    from effective clocks into the device clock of each of its ranks."""
    base = costing(graph, factors, model.nominal_mhz, current_clocks=False)
    plan = plan_straggler_frequency(base, model.cost, f_max=10 * model.max_mhz)  # bounded per rank below
    if plan.mhz is None or plan.layout == base:
        return {}, [f"no up-clock: {plan.reason}"]
    stage = graph.stages[plan.stage]
    need = {r: math.ceil(plan.mhz * factors.get(r, 1.0) - 1e-6) for r in stage.ranks}
    slow = [r for r in stage.ranks if r in factors]
    target: float = plan.mhz
    if max(need.values()) > model.max_mhz:
        if not slow:
            return {}, [
                f"no up-clock: stage {plan.stage} would need {max(need.values())} MHz > the maximum "
                f"{model.max_mhz} MHz (unachievable, §4.3 Alg. 2)"
            ]
        target = min(model.max_mhz / factors.get(r, 1.0) for r in stage.ranks)
        need = {r: min(model.max_mhz, math.ceil(target * factors.get(r, 1.0) - 1e-6)) for r in stage.ranks}
    up = {r: mhz for r, mhz in need.items() if mhz > model.nominal_mhz}
    if not up:
        return {}, [f"no up-clock: stage {plan.stage} already meets its target"]
    how = "" if target == plan.mhz else f" (capped at the maximum {model.max_mhz} MHz: gap not fully closed)"
    said = ", ".join(f"rank {r} at {mhz} MHz" for r, mhz in sorted(up.items()))
    return up, [f"DVFS (§4.3): up-clock stage {plan.stage}: {said}{how}"]
