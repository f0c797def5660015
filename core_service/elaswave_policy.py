"""The Core's ElasWave policy: a snapshot of the job in, the pure planner's decision out.

The algorithms (resize, Algorithm 1 under the executor's adjacency rule, DVFS; ElasWave §4.1-4.3)
live in `planners.elaswave_policy`, which `elaswave plan` and the simulator run too; this module
only turns a `JobSnapshot` into its input (going, slow and recovered ranks, the job's cost model,
the spares that may join with the nodes of their hosts) and its typed result into the engine's
`Decision` (with `joiners`: the spares taken in and their fresh ranks). Hysteresis: the fail-slow detector flags and
clears only after consecutive steps; the planner keeps a clock within `clock_hysteresis_mhz` of
the current one, and an unchanged layout publishes nothing. A straggler the up-clock fully hides
is cleared by the detector and so loses its clock; if it is still slow it is flagged again after
`trigger_steps` (a cycle the detector's streaks bound, not removed).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from core_service.config import PolicyName
from core_service.job_snapshot import Decision, JobSnapshot, Policy
from core_service.policies import NO_LAYOUT, LayoutPolicy, departed_ranks, going_ranks
from planners.chameleon.schema import state_from_dict
from planners.chameleon.state import JobProfile
from planners.elaswave_model import DEFAULT_SLOWDOWN, JobModel, RankReport, job_model
from planners.elaswave_payback import PaybackSettings
from planners.elaswave_policy import ElasWaveInput, ElasWaveSettings, plan_elaswave
from planners.elaswave_policy_join import Joins, Spare
from planners.elaswave_reasons import texts
from planners.layout import Layout
from planners.redundancy import NodeLoss, RedundancyInput, RedundancySettings


@dataclass(frozen=True)
class ElasWavePolicy:
    name: str = "elaswave"
    min_gain: float = 0.02  # relative step-time gain a layer migration must buy
    clock_hysteresis_mhz: int = 20
    default_slowdown: float = DEFAULT_SLOWDOWN
    # Optional plans (slow or recovered ranks only) settle (planners.elaswave_payback): each must
    # pay back its pause and moved state within `payback_steps`, and a unit that moved stays put
    # for `cooldown_steps`. The pause is the job's last measured one, `default_pause_s` before any.
    payback_steps: int = 100
    cooldown_steps: int = 200
    default_pause_s: float = 0.2
    # Backup redundancy k (planners.redundancy): sized from the bursts of node losses this Core
    # saw (`losses`, per job, on `clock`) and the registered model's memory cap.
    redundancy: RedundancySettings = RedundancySettings()
    # After a loss or a join, re-slot, regroup stages or drop a replica where the cost model
    # predicts a faster step than thinning every stage (planners.elaswave_replicas).
    replicas: bool = True
    # Whether one of those shapes may drop a whole replica (`CoreSettings.drop_replicas`).
    drop_replicas: bool = False
    clock: Callable[[], float] = time.monotonic
    losses: LossLog = field(default_factory=lambda: LossLog())

    def decide(self, snapshot: JobSnapshot) -> Decision:
        layout = snapshot.layout
        if layout is None:
            return Decision("none", NO_LAYOUT, self.name)
        going = going_ranks(snapshot, layout)
        recovered = recovered_ranks(snapshot, layout)
        joins = spare_joins(snapshot, layout)
        if not going and not recovered and not joins and not any(w.state == "SLOW" for w in snapshot.live):
            return Decision(
                "none",
                "no rank of the current layout is leaving, slow or recovered, and no spare waits",
                self.name,
            )
        reports = rank_reports(snapshot, layout)
        payback = PaybackSettings(
            self.payback_steps,
            self.cooldown_steps,
            self.default_pause_s if snapshot.plan_pause_s is None else snapshot.plan_pause_s,
        )
        cooling = frozenset(
            unit for unit, at in snapshot.unit_moved_at if snapshot.step - at < self.cooldown_steps
        )
        now = self.clock()
        self.losses.record(snapshot, layout, now)
        profile, _ = registered_profile(snapshot)
        redundancy = RedundancyInput(
            self.losses.history(snapshot.job),
            now,
            None if profile is None else profile.mem_cap_bytes,
            self.redundancy,
        )
        plan = plan_elaswave(
            ElasWaveInput(
                layout,
                tuple(going),
                snapshot_model(snapshot, layout, reports),
                reports,
                recovered,
                joins,
                cooling,
                departed_ranks(snapshot, layout),
                redundancy,
            ),
            ElasWaveSettings(
                self.min_gain,
                self.clock_hysteresis_mhz,
                self.default_slowdown,
                payback=payback,
                replicas=self.replicas,
                drop_replicas=self.drop_replicas,
            ),
        )
        return Decision(
            plan.action,
            plan.summary,
            self.name,
            layout=plan.layout,
            predicted_step_time_s=plan.predicted_step_time_s,
            reasons=texts(plan.reasons),
            joiners=plan.joiners,
            optional=not going and joins is None,
        )


def make_policy(name: PolicyName = "elaswave", drop_replicas: bool = False) -> Policy:
    """The Core's policy by its configured name (`CoreSettings.policy`, `.drop_replicas`)."""
    if name == "elaswave-resize":
        return LayoutPolicy()
    if name == "elaswave":
        return ElasWavePolicy(drop_replicas=drop_replicas)
    raise ValueError(f"policy {name!r} is unknown: choose 'elaswave' or 'elaswave-resize'")


def spare_joins(snapshot: JobSnapshot, layout: Layout) -> Joins | None:
    """The spares that may join (None: none waits), in worker-id order, each with the node of its
    host: the node of a rank on the same host when the layout places ranks on nodes, else a new
    node per host (so `planners.backup` keeps a newcomer's backups off its own node)."""
    spares = snapshot.spares
    if not spares:
        return None
    node_of_rank = dict(layout.rank_nodes)
    node_of_host: dict[str, int] = {}
    for w in snapshot.live + snapshot.gone:
        if w.rank in node_of_rank:
            node_of_host.setdefault(w.host, node_of_rank[w.rank])
    fresh = max(node_of_rank.values(), default=-1) + 1
    placed = []
    for w in spares:
        if node_of_rank and w.host not in node_of_host:
            node_of_host[w.host], fresh = fresh, fresh + 1
        placed.append(Spare(w.worker_id, node_of_host.get(w.host)))
    return Joins(tuple(placed), snapshot.original, snapshot.next_rank, snapshot.max_ranks)


def rank_reports(snapshot: JobSnapshot, layout: Layout) -> tuple[RankReport, ...]:
    """The live workers of the layout as the planner sees them."""
    in_layout = set(layout.ranks())
    return tuple(
        RankReport(w.rank, w.step_time_s, w.state == "SLOW", w.wall_step_s)
        for w in snapshot.live
        if w.rank in in_layout
    )


class LossLog:
    """The node losses the Core saw, per job: each lost worker once, at the time its loss was
    first seen, with its host (the failure domain). Departures on purpose are not failures."""

    def __init__(self) -> None:
        self._seen: dict[str, dict[str, tuple[float, str]]] = {}

    def record(self, snapshot: JobSnapshot, layout: Layout, now_s: float) -> None:
        departed = departed_ranks(snapshot, layout)
        lost = set(going_ranks(snapshot, layout)) - departed
        seen = self._seen.setdefault(snapshot.job, {})
        for w in snapshot.gone + snapshot.live:
            if w.rank in lost and w.worker_id not in seen:
                seen[w.worker_id] = (now_s, w.host)

    def history(self, job: str) -> tuple[NodeLoss, ...]:
        by_time: dict[float, set[str]] = {}
        for t, host in self._seen.get(job, {}).values():
            by_time.setdefault(t, set()).add(host)
        return tuple(NodeLoss(t, frozenset(hosts)) for t, hosts in sorted(by_time.items()))


def registered_profile(snapshot: JobSnapshot) -> tuple[JobProfile | None, str]:
    """The job's registered profile, or None and why not."""
    if snapshot.model_json is None:
        return None, "the job registered no model"
    try:
        return state_from_dict(json.loads(snapshot.model_json))[0].profile, ""
    except (ValueError, TypeError, KeyError) as exc:
        return None, f"its registered model does not parse ({exc})"


def snapshot_model(snapshot: JobSnapshot, layout: Layout, reports: tuple[RankReport, ...]) -> JobModel:
    """The job's registered profile when it parses, else the uniform model calibrated by reports."""
    profile, why = registered_profile(snapshot)
    return job_model(layout, profile, why, reports)


def recovered_ranks(snapshot: JobSnapshot, layout: Layout) -> frozenset[int]:
    """Ranks of the layout whose worker recovered from fail-slow since the last plan."""
    recovered = {c.partition(":")[2] for c in snapshot.changes if c.startswith("worker_recovered:")}
    if not recovered:
        return frozenset()
    in_layout = set(layout.ranks())
    return frozenset(
        w.rank
        for w in snapshot.live
        if w.worker_id in recovered and w.state != "SLOW" and w.rank in in_layout
    )
