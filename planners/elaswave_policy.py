"""ElasWave's policy as one pure function: resize, re-partition, up-clock (ElasWave §4.1-4.3).

The Core (`core_service.elaswave_policy`), `elaswave plan` (`planners.cli`) and the simulator
(`simulator.policies`) all call `plan_elaswave`; each turns its own view of the job (a snapshot
of workers, a state.json, a trace) into an `ElasWaveInput`. One decision per membership change,
in the paper's order:

1. dataflow (§4.1): going ranks leave, their stage's survivors take their samples
   (`resize_for_going`, shared with the resize-only baseline); a stage that loses every rank
   hands its layers to a neighbour;
   spares join where they are needed most (`planners.elaswave_policy_join`, §4.1 in reverse):
   back to the fault-free layout after a loss, beyond it only where it pays;
2. graph (§4.2): Algorithm 1 under the executor's adjacency rule (`planners.elaswave_graph`);
3. DVFS (§4.3): the residual straggler stage is up-clocked (`planners.elaswave_clocks`).

Every reason is a typed `Reason` (which step, whether it changes the layout); the event-log line
is built from their headlines, never by parsing sentences. The plan is validated; whether the
executor can reach it in place is `planners.applicability.judge`, which the caller asks.
"""

from __future__ import annotations

from collections.abc import Sequence, Set
from dataclasses import dataclass, field, replace
from typing import Literal

from planners.dataflow import drop_stage, micro_batch_sizes, resize_after_loss
from planners.elaswave_clocks import plan_clocks
from planners.elaswave_graph import repartition
from planners.elaswave_model import DEFAULT_SLOWDOWN, JobModel, RankReport, Slowdown, costing, slowdowns
from planners.elaswave_payback import PaybackSettings, judge_optional
from planners.elaswave_policy_join import Joins, add_spares
from planners.elaswave_reasons import Outcome, Reason, Step, headlines
from planners.elaswave_replicas import shape_replicas
from planners.layout import Layout
from planners.redundancy import RedundancyInput, choose_copies, headroom_from_model
from planners.validation import validate

Action = Literal["publish", "none", "refuse"]


@dataclass(frozen=True)
class ElasWaveSettings:
    min_gain: float = 0.02  # relative step-time gain a layer migration must buy
    clock_hysteresis_mhz: int = 20
    default_slowdown: float = DEFAULT_SLOWDOWN
    migrate: bool = True  # False: the resize-only ablation (no re-partition, no DVFS)
    dvfs: bool = True
    # Optional plans (for slow or recovered ranks only) must pay back and respect the cool-down
    # (`planners.elaswave_payback`); None: every plan is adopted (the simulator's ablations).
    payback: PaybackSettings | None = PaybackSettings()
    # After a loss or a join: re-slot or drop a replica where the cost model predicts a faster
    # step than thinning every stage (`planners.elaswave_replicas`; needs `migrate`).
    replicas: bool = True
    # Whether dropping a whole DP replica is one of those shapes: its ranks hand their live state
    # over (`Plan.standby`, set by the Core for ranks a plan drops while their workers run). Off
    # by default, as in the Core (`CoreSettings.drop_replicas`): it sends healthy workers away.
    drop_replicas: bool = False


@dataclass(frozen=True)
class ElasWaveInput:
    """What the policy decides from: the layout in force, the ranks that go, every worker's last
    report, the ranks whose fail-slow flag cleared since the last plan, the cost model, and the
    spares that may join (None: no growth)."""

    layout: Layout
    going: tuple[int, ...]
    model: JobModel
    reports: tuple[RankReport, ...] = ()
    recovered: frozenset[int] = frozenset()
    joins: Joins | None = None
    cooling: frozenset[int] = frozenset()  # units that moved within the cool-down
    # Going ranks that leave on purpose (preempted, drained, left): "departed", never "lost".
    departed: frozenset[int] = frozenset()
    # Backup redundancy k (`planners.redundancy`): None leaves the layout's k as it is.
    redundancy: RedundancyInput | None = None


@dataclass(frozen=True)
class ElasWavePlan:
    action: Action
    layout: Layout | None
    reasons: tuple[Reason, ...]
    summary: str  # one line for the event log
    predicted_step_time_s: float = 0.0
    joiners: tuple[tuple[int, str], ...] = ()  # (rank, worker_id) of each spare `layout` takes in


@dataclass(frozen=True)
class Resized:
    """The dataflow step (§4.1) for the ranks that go: the layout, or why there is none."""

    layout: Layout | None
    reasons: tuple[Reason, ...]
    refusal: str = ""
    dropped_stages: tuple[int, ...] = field(default_factory=tuple)


def plan_elaswave(inp: ElasWaveInput, settings: ElasWaveSettings = ElasWaveSettings()) -> ElasWavePlan:
    """The ElasWave plan for `inp` (no I/O: the same answer for the same input)."""
    layout, model = inp.layout, inp.model
    in_layout = set(layout.ranks())
    going = sorted(set(inp.going) & in_layout)
    recovered = frozenset(inp.recovered) & in_layout
    slow = slowdowns(layout, inp.reports, going, model.nominal_mhz, settings.default_slowdown)
    spares = inp.joins is not None and bool(inp.joins.spares)
    if not going and not slow and not recovered and not spares:
        text = "no rank of the current layout is leaving, slow or recovered, and no spare waits"
        return ElasWavePlan("none", None, (), text)
    resized = resize_for_going(layout, going, inp.departed) if going else Resized(layout, ())
    if resized.layout is None:
        return ElasWavePlan("refuse", None, resized.reasons, resized.refusal)
    grown, reasons = resized.layout, resized.reasons
    joiners: tuple[tuple[int, str], ...] = ()
    if inp.joins is not None:
        factors = {r: s.factor for r, s in slow.items()}
        added = add_spares(resized.layout, inp.joins, model, factors, settings.min_gain)
        grown, joiners, reasons = added.layout, added.joiners, (*reasons, *added.reasons)
    optional = not going and not spares  # only slow or recovered ranks: the plan may wait
    # Only a layout the change thinned is reshaped: a loss whose ranks spares took over leaves the
    # shape as it was (the user's configuration is not second-guessed).
    thinned = grown.dp_sizes != layout.dp_sizes
    if going and thinned and settings.migrate and settings.replicas:
        factors = {r: s.factor for r, s in slow.items()}
        sizes = micro_batch_sizes(layout)
        grown, shape_reasons = shape_replicas(
            grown, factors, model, settings.min_gain, (min(sizes), max(sizes)), drop=settings.drop_replicas
        )
        reasons = (*reasons, *shape_reasons)
    plan = _plan(layout, grown, reasons, model, slow, recovered, settings, inp.cooling if optional else None)
    if optional and settings.migrate and _declined_by_payback(plan):
        # Moving units does not pay (or a unit cools down): the clocks alone may (DVFS, §4.3),
        # and giving an up-clock back always does.
        clocks_only = replace(settings, migrate=False)
        fallback = _plan(layout, grown, reasons, model, slow, recovered, clocks_only, inp.cooling)
        if fallback.action == "publish":
            return replace(fallback, reasons=(*fallback.reasons, plan.reasons[-1]))
    plan = with_copies(plan, inp.redundancy, model)
    if plan.action != "publish" or not joiners:
        return plan
    kept = set(plan.layout.ranks()) if plan.layout is not None else set()
    return replace(plan, joiners=tuple((r, w) for r, w in joiners if r in kept))


def with_copies(plan: ElasWavePlan, redundancy: RedundancyInput | None, model: JobModel) -> ElasWavePlan:
    """The published layout with the backup redundancy k `planners.redundancy` chooses for it
    (headroom: the memory cap minus the cost model's stage estimate), and the reason why."""
    if redundancy is None or plan.action != "publish" or plan.layout is None:
        return plan
    layout = plan.layout
    headroom = None
    if redundancy.mem_cap_bytes is not None:
        mems = [model.cost.stage_memory_bytes(layout, p) for p in range(layout.num_stages)]
        headroom = headroom_from_model(layout, mems, redundancy.mem_cap_bytes)
    choice = choose_copies(layout, redundancy.history, redundancy.now_s, headroom, redundancy.settings)
    changed = choice.copies != layout.backup_copies
    reason = Reason(
        Step.REDUNDANCY,
        Outcome.CHANGED if changed else Outcome.KEPT,
        choice.reason,
        f"backup copies {layout.backup_copies}->{choice.copies}" if changed else "",
    )
    summary = f"{plan.summary}; {reason.headline}" if changed else plan.summary
    new = replace(layout, backup_copies=choice.copies)
    return replace(plan, layout=new, reasons=(*plan.reasons, reason), summary=summary)


def _plan(
    old: Layout,
    resized: Layout,
    resize_reasons: tuple[Reason, ...],
    model: JobModel,
    slow: dict[int, Slowdown],
    recovered: Set[int],
    settings: ElasWaveSettings,
    cooling: frozenset[int] | None = None,
) -> ElasWavePlan:
    """`cooling`: None for a plan that is needed (a loss, a join); else the plan is optional and the
    payback rule and cool-down apply (the units still cooling down)."""
    factors = {r: s.factor for r, s in slow.items()}
    before = costing(old, factors, model.nominal_mhz, current_clocks=True)
    graph, graph_reasons = resized, []
    clocks: tuple[tuple[int, int], ...] = resized.frequencies_mhz
    clock_reasons: list[Reason] = []
    if settings.migrate:
        graph, graph_reason = repartition(resized, factors, model, settings.min_gain)
        graph_reasons = [graph_reason]
    if settings.dvfs:
        clocks, clock_reasons = plan_clocks(
            graph, factors, model, old, recovered, settings.clock_hysteresis_mhz
        )
    new = replace(graph, frequencies_mhz=clocks)
    report = validate(new)
    if not report.ok:
        why = "planned layout does not validate: " + report.reason
        return ElasWavePlan("refuse", None, (*resize_reasons, Reason(Step.GRAPH, Outcome.DECLINED, why)), why)
    t_before = model.cost.step_time(before)
    t_after = model.cost.step_time(costing(new, factors, model.nominal_mhz, current_clocks=True))
    predicted = Reason(
        Step.PREDICTION,
        Outcome.INFO,
        f"predicted step time {t_after:.4g} {model.unit} ({t_before:.4g} before this change)",
    )
    reasons = (
        Reason(Step.MODEL, Outcome.INFO, model.reason),
        *resize_reasons,
        *(Reason(Step.SLOW, Outcome.INFO, s.reason) for s in slow.values()),
        *graph_reasons,
        *clock_reasons,
        predicted,
    )
    if new == old:
        summary = "nothing to change: " + "; ".join(r.text for r in reasons[1:])
        return ElasWavePlan("none", None, reasons, summary, t_after)
    if cooling is not None and settings.payback is not None:
        declined = judge_optional(old, new, t_before, t_after, model.unit, cooling, settings.payback)
        if declined is not None:
            reasons = (*reasons, declined)
            return ElasWavePlan("none", None, reasons, declined.text, t_before)
    summary = "; ".join([*headlines(reasons), predicted.text])
    return ElasWavePlan("publish", new, reasons, summary, t_after)


def _declined_by_payback(plan: ElasWavePlan) -> bool:
    return plan.action == "none" and bool(plan.reasons) and plan.reasons[-1].step is Step.PAYBACK


def resize_for_going(layout: Layout, going: Sequence[int], departed: Set[int] = frozenset()) -> Resized:
    """Stages that lose every rank hand their layers to a neighbour; the survivors of the others
    take the going ranks' samples (micro-batch resizing, ElasWave §4.1); the result validates.
    The last two reasons are the resize's own and the micro-batch sizes. `departed`: going ranks
    that leave on purpose (a preemption, a drain), named "departed" in the headline, not "lost"."""
    remaining, dropped, emptied = _drop_emptied_stages(layout, set(going))
    if remaining is None:
        return Resized(None, dropped, "every stage would lose all of its ranks", emptied)
    left = [r for r in going if r in set(remaining.ranks())]
    result = resize_after_loss(remaining, left)
    headline = going_headline(left, departed)
    text = result.reason.replace(f"lost ranks {sorted(left)}", headline, 1)
    if not left:  # every going rank went with a dropped stage: no survivor's share changes
        headline = text = f"{going_headline(going, departed)} (with their stages)"
    report = validate(result.layout)
    if not report.ok:
        return Resized(
            None, dropped, "resized layout does not validate: " + "; ".join(report.problems), emptied
        )
    sizes = micro_batch_sizes(result.layout)
    return Resized(
        result.layout,
        (
            *dropped,
            Reason(Step.RESIZE, Outcome.CHANGED, text, headline),
            Reason(Step.RESIZE, Outcome.INFO, f"micro-batch sizes per stage {list(sizes)}"),
        ),
        dropped_stages=emptied,
    )


def _drop_emptied_stages(
    layout: Layout, going: set[int]
) -> tuple[Layout | None, tuple[Reason, ...], tuple[int, ...]]:
    """Stages that lose every rank hand their layers to a neighbour (planners.dataflow.drop_stage);
    the layers then migrate to that neighbour's ranks (ElasWave §4.2, §6.2)."""
    reasons: list[Reason] = []
    emptied_ids: list[int] = []
    while True:
        emptied = [s for s in layout.stages if all(r in going for r in s.ranks)]
        if not emptied:
            return layout, tuple(reasons), tuple(emptied_ids)
        if layout.num_stages == 1:
            return None, tuple(reasons), tuple(emptied_ids)
        stage = emptied[0]
        text = (
            f"stage {stage.stage} lost every rank: layers {stage.layer_start}..{stage.layer_stop - 1} "
            "move to a neighbouring stage"
        )
        reasons.append(Reason(Step.RESIZE, Outcome.CHANGED, text))
        emptied_ids.append(stage.stage)
        layout = drop_stage(layout, stage.stage)


def going_headline(going: Sequence[int], departed: Set[int]) -> str:
    """ "lost ranks [..]" for failures, "departed ranks [..]" for ranks that leave on purpose."""
    lost = sorted(r for r in going if r not in departed)
    left = sorted(r for r in going if r in departed)
    parts = ([f"lost ranks {lost}"] if lost else []) + ([f"departed ranks {left}"] if left else [])
    return "; ".join(parts) or "lost ranks []"
