"""What the ElasWave policy prices a plan with: the job's cost model and its fail-slow ranks.

Cost model: from the job's registered profile (`elaswave plan` state.json, a `JobProfile`) when
it has one for this many layers; otherwise a uniform model in which every block costs the same
per sample (backward twice forward), so a stage's mini-step is proportional to blocks x
micro-batch size. The uniform model is scaled to seconds by the median step time the workers
last reported under the current layout; without reports its times are in model units.

Fail-slow ranks are costed by their slowdown (step time over the median of their stage peers,
measured at their current clock), modelled as a lower effective clock (compute ~ 1/f, as
planners.costmodel does for DVFS).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace

from planners.chameleon.state import JobProfile
from planners.costmodel import CostModel, LayerProfile, LinkModel, MemoryProfile
from planners.layout import Layout

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
    # The share of the measured wall step (median over the ranks) that the model's own terms
    # predict for the layout it was measured on; the rest is `cost.ministep_overhead_s`. None:
    # no wall step measured. A model that explains little of the step cannot be trusted with a
    # shape whose stage count differs (planners.elaswave_replicas).
    explained_share: float | None = None


@dataclass(frozen=True)
class RankReport:
    """One worker of the layout as the policy sees it: its last step time and whether the
    fail-slow detector flags it."""

    rank: int
    step_time_s: float | None = None  # the rank's own compute (its wall step where not reported)
    slow: bool = False
    wall_step_s: float | None = None  # the whole step as the rank saw it, waits on peers included


@dataclass(frozen=True)
class Slowdown:
    factor: float  # compute time at the nominal clock over a healthy peer's
    reason: str


def job_model(
    layout: Layout, profile: JobProfile | None, why_none: str, reports: Sequence[RankReport]
) -> JobModel:
    """The registered profile's model when it fits this layout, else the calibrated uniform one.
    `why_none` says why there is no profile when `profile` is None."""
    if profile is not None:
        if profile.num_layers == layout.num_layers:
            return reconciled(registered_model(profile, layout), layout, reports)
        why_none = f"its registered model has {profile.num_layers} layers, the layout {layout.num_layers}"
    measured = [r.step_time_s for r in reports if r.step_time_s and not r.slow]
    return reconciled(uniform_model(layout, measured, why_none), layout, reports)


def reconciled(model: JobModel, layout: Layout, reports: Sequence[RankReport]) -> JobModel:
    """`model` with what the median wall step its healthy ranks reported for `layout` has beyond
    the model's own prediction for it (fail-slow ranks costed) charged per mini-step
    (`CostModel.ministep_overhead_s`: hops, launches, waits that no term of eq. (1) names), and
    the share it explains. Unchanged without wall steps or in model units. A shape with more
    mini-steps then pays for each, and the current layout is predicted at its measured step
    (docs/benchmarks.md, "The mini-step overhead")."""
    walls = [r.wall_step_s for r in reports if r.wall_step_s and not r.slow]
    if not walls or model.unit != "s":
        return model
    factors = {
        r: s.factor for r, s in slowdowns(layout, reports, (), model.nominal_mhz, DEFAULT_SLOWDOWN).items()
    }
    predicted = model.cost.step_time(costing(layout, factors, model.nominal_mhz, current_clocks=True))
    wall = statistics.median(walls)
    if predicted <= 0 or wall <= 0:
        return model
    slots = layout.num_micro_batches + layout.num_stages - 1  # the 1F1B schedule's mini-steps
    overhead = max(0.0, wall - predicted) / slots
    share = min(1.0, predicted / wall)
    return replace(
        model,
        cost=replace(model.cost, ministep_overhead_s=model.cost.ministep_overhead_s + overhead),
        reason=model.reason
        + f"; it predicts {share:.0%} of the median wall step {wall:.4g} s, the rest charged as "
        f"{overhead:.4g} s per mini-step ({slots} in this layout: hops, launches, waits)",
        explained_share=share,
    )


def registered_model(profile: JobProfile, layout: Layout) -> JobModel:
    """eq. (1) from the state.json profile: per-sample layer times at the nominal clock, P2P per
    sample, the DP exchange at the profile's all-reduce bandwidth, memory per byte of the
    layout's element counts."""
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
    link = LinkModel(
        boundary_bytes_per_sample=profile.p2p_s_per_sample,
        bandwidth_bytes_per_s=1.0,
        dp_bytes_per_s=profile.allreduce_bytes_per_s,
    )
    return JobModel(
        CostModel(layers, memory, link),
        profile.freq_nominal_mhz,
        profile.freq_max_mhz,
        "s",
        "cost model: the job's registered profile (eq. 1 and the DP exchange)",
    )


def uniform_model(layout: Layout, measured_step_s: Sequence[float], why: str) -> JobModel:
    """Every block costs the same per sample (backward = 2 x forward), no exposed P2P and no DP
    exchange priced (the reports do not say what it costs: see docs/benchmarks.md, "The DP
    exchange in the plan's step"); memory from the layout's element counts with MemoryProfile's
    defaults. Scaled so the current layout's predicted step time equals the median of
    `measured_step_s` (the ranks' own compute); `job_model` then reconciles it with their wall
    step."""
    base = f"cost model: uniform blocks ({why}): a stage's mini-step ~ blocks x micro-batch size"
    cost = _uniform_cost(layout.num_layers, 1.0)
    predicted = cost.step_time(layout)
    if not measured_step_s or predicted <= 0:
        return JobModel(
            cost, DEFAULT_NOMINAL_MHZ, DEFAULT_MAX_MHZ, "model units", base + "; times in model units"
        )
    median = statistics.median(measured_step_s)
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


def slowdowns(
    layout: Layout, reports: Sequence[RankReport], going: Sequence[int], nominal_mhz: int, default: float
) -> dict[int, Slowdown]:
    """Slowdown of every slow rank that stays, from its step time over its stage peers' median,
    measured at its current clock and referred to the nominal one (compute ~ 1/f)."""
    if not any(r.slow for r in reports):
        return {}  # the common case: no per-rank table to build
    stage_of = {r: s.stage for s in layout.stages for r in s.ranks}
    clocks = dict(layout.frequencies_mhz)
    healthy: dict[int, list[float]] = {}
    for r in reports:
        if not r.slow and r.step_time_s and r.rank in stage_of:
            healthy.setdefault(stage_of[r.rank], []).append(r.step_time_s)
    out: dict[int, Slowdown] = {}
    for r in reports:
        if not r.slow or r.rank not in stage_of or r.rank in going:
            continue
        peers = healthy.get(stage_of[r.rank], [])
        clock = clocks.get(r.rank, nominal_mhz)
        if r.step_time_s and peers:
            median = statistics.median(peers)
            observed = r.step_time_s / median
            how = f"step time {r.step_time_s:.4g} s vs stage median {median:.4g} s at {clock} MHz"
        else:
            observed, how = default, f"no step times: assumed the detector's ratio {default:g}"
        factor = max(1.0, observed * clock / nominal_mhz)
        out[r.rank] = Slowdown(
            factor,
            f"rank {r.rank} (stage {stage_of[r.rank]}) is fail-slow: "
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
