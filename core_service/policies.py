"""Policies the schedule engine consults. They return decisions; the engine acts on them.

The default is `core_service.elaswave_policy.ElasWavePolicy` (resize + re-partition + DVFS);
`LayoutPolicy` here is its resize-only ablation baseline (config `policy = "elaswave-resize"`),
and the dataflow step both share. For jobs registered with a layout (planners.Layout JSON): lost
and preempted ranks leave their stages and the survivors take their samples (micro-batch
resizing, ElasWave §4.1 / planners.dataflow); a stage that loses every rank hands its layers
to a neighbour; the result is validated (planners.validation) before it is published. Only a
change that leaves no rank at all is refused. Jobs registered without a layout are
membership-only: changes are recorded and nothing is re-planned.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from core_service.job_snapshot import Decision, JobSnapshot
from core_service.jobs import Job
from planners.chameleon.schema import state_from_dict
from planners.chameleon.state import ClusterState
from planners.elaswave_policy import resize_for_going as planned_resize
from planners.elaswave_reasons import texts
from planners.flextrain import build_scale_table, choose_scale_up, predict_configs
from planners.layout import Layout

GOING_STATES = frozenset({"LOST", "LEFT", "PREEMPTING", "DRAINING"})
DEPARTED_STATES = frozenset({"LEFT", "PREEMPTING", "DRAINING"})  # leaving on purpose, not failed


@dataclass(frozen=True)
class Resized:
    """The dataflow step (§4.1) for the ranks that go: the layout, or why there is none."""

    layout: Layout | None
    reasons: tuple[str, ...]
    refusal: str = ""


@dataclass(frozen=True)
class LayoutPolicy:
    """Resize only (§4.1): the ablation baseline of `ElasWavePolicy` (config `policy = "elaswave-resize"`)."""

    name: str = "elaswave-resize"

    def decide(self, snapshot: JobSnapshot) -> Decision:
        layout = snapshot.layout
        if layout is None:
            return Decision("none", NO_LAYOUT, self.name)
        going = going_ranks(snapshot, layout)
        if not going:
            return Decision("none", "no rank of the current layout is leaving", self.name)
        resized = resize_for_going(layout, going)
        if resized.layout is None:
            return Decision("refuse", resized.refusal, self.name)
        return Decision(
            "publish",
            resized.reasons[-2],
            self.name,
            layout=resized.layout,
            reasons=resized.reasons,
        )


NO_LAYOUT = "job has no layout: membership change recorded, nothing to re-plan"


def going_ranks(snapshot: JobSnapshot, layout: Layout) -> list[int]:
    """Ranks of `layout` whose worker is lost, left, preempted or draining."""
    in_layout = set(layout.ranks())
    return sorted(
        {w.rank for w in snapshot.gone + snapshot.live if w.state in GOING_STATES and w.rank in in_layout}
    )


def departed_ranks(snapshot: JobSnapshot, layout: Layout) -> frozenset[int]:
    """Ranks of `layout` whose worker leaves on purpose (preempted, draining, left): departures,
    never failures, in a plan's headline."""
    in_layout = set(layout.ranks())
    return frozenset(
        w.rank for w in snapshot.gone + snapshot.live if w.state in DEPARTED_STATES and w.rank in in_layout
    )


def resize_for_going(layout: Layout, going: list[int]) -> Resized:
    """The pure dataflow step (`planners.elaswave_policy.resize_for_going`, ElasWave §4.1) with its
    reasons as the sentences a plan records. The last two are the resize's own and the
    micro-batch sizes."""
    result = planned_resize(layout, going)
    return Resized(result.layout, texts(result.reasons), result.refusal)


# Devices of an offer are expected to stay until reclaimed; FlexTrain models reclaims as a
# Poisson process (FlexTrain §5, eq. 15-16), so 1 / expected duration is its rate.
RECONFIGURATION_OVERHEAD_S = 30.0
DEFAULT_RECLAIM_RATE_PER_S = 1.0 / (8 * 3600.0)  # FlexTrain's 8-hour window when nothing is known


def _model_state(job: Job) -> tuple[ClusterState, dict[str, Any]]:
    if job.model_json is None:
        raise ValueError(
            f"job {job.name!r} was registered without a model (the `elaswave plan` state.json), "
            "so it has no scale table"
        )
    request = json.loads(job.model_json)
    return state_from_dict(request)[0], request


def scale_table(job: Job) -> list[dict[str, Any]]:
    """FlexTrain's scale table (FlexTrain §4.4): the best (DP, PP) per device count, filtered."""
    state, request = _model_state(job)
    max_devices = int(request.get("max_devices", state.shape.num_devices))
    predictions = predict_configs(state, max_devices // state.shape.tp)
    table = build_scale_table(predictions)
    step_of = {(p.gpus, p.dp, p.pp): p.profiled_step_s for p in predictions}
    rows = []
    for entry in table.entries:
        step = step_of[(entry.gpus, entry.dp, entry.pp)]
        rows.append(
            {
                "devices": entry.gpus,
                "dp": entry.dp,
                "pp": entry.pp,
                "tp": state.shape.tp,
                "step_time_s": step,
                "throughput_samples_per_s": state.shape.global_batch / step,
            }
        )
    return rows


def judge_offer(job: Job, devices: int, expected_duration_s: float) -> tuple[bool, str, int]:
    """(accepted, reason, devices it can use): accept a scale-up offer when the faster
    configuration pays for its reconfiguration before the devices are likely reclaimed
    (FlexTrain eq. 16); it uses only the devices that configuration adds, however many were
    offered. A job registered without a model has no scale table: it accepts, and may use every
    device (bounded by the caller: max_workers, outstanding offers per host)."""
    if job.model_json is None:
        return True, "membership-only job: offered workers join as they register", devices
    state, request = _model_state(job)
    max_devices = int(request.get("max_devices", state.shape.num_devices + devices))
    table = build_scale_table(predict_configs(state, max_devices // state.shape.tp))
    rate = 1.0 / expected_duration_s if expected_duration_s > 0 else DEFAULT_RECLAIM_RATE_PER_S
    # Scale-table entries count devices (TP included), like `devices` and `max_devices`.
    target, decision = choose_scale_up(
        table, state.shape.num_devices, devices, max_devices, RECONFIGURATION_OVERHEAD_S, rate
    )
    if target is None:
        return False, decision.reason, 0
    used = min(devices, target.gpus - state.shape.num_devices)
    reason = f"scale to {target.gpus} devices (DP={target.dp}, PP={target.pp}): {decision.reason}"
    return True, reason, used
