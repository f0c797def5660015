"""What the dashboard shows of a job, computed from the Core's job table (pure functions).

Sized for jobs of thousands of members: members are aggregated per stage (the page lists one
stage's members on demand, virtualised), the layout grid is one small tuple per rank, and the
plans' MTTR breakdown is derived from the event log the Core already keeps (docs/architecture.md
("The Core's decisions")): no new bookkeeping on the hot path.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable
from typing import Any

from core_service.dashboard_history import JobHistory
from core_service.jobs import Job
from core_service.model import Event, MemberRecord, WorkerState

# Events that start a recovery or a re-plan (the plan that follows answers them).
TRIGGER_KINDS = frozenset(
    {
        "worker_lost",
        "worker_slow",
        "worker_preempting",
        "worker_draining",
        "worker_left",
        "worker_joined",
        "worker_rejoined",
        "worker_recovered",
        "collective_failure",
        "replan_after_takeover",
        "resources_offered",
        "spare_registered",
        "spare_ready",
        "joiner_lost",
    }
)
# Per-worker acknowledgements: many per plan, summarised in the plans table instead of listed.
ACK_KINDS = frozenset({"plan_received", "plan_paused", "plan_applied", "plan_resumed", "plan_failed"})
PLANS_SHOWN = 20
EVENTS_SHOWN = 150


def _health(member: MemberRecord) -> str:
    bad = sorted(name for name, probe in member.probes.items() if not probe.get("healthy", True))
    return "ok" if not bad else "unhealthy: " + ", ".join(bad)


def member_row(member: MemberRecord, now: float) -> dict[str, Any]:
    """One member as the dashboard lists it (a compact subset of the REST member view)."""
    step = member.last_step
    memory = member.memory
    return {
        "worker_id": member.worker_id,
        "host": member.host,
        "stage": member.stage,
        "dp_rank": member.dp_rank,
        "rank": member.rank,
        "state": member.state.value,
        "health": _health(member),
        "reason": member.state_reason,
        "device_used_bytes": sum(memory.get("device_used_bytes", [])) or None,
        "device_total_bytes": sum(memory.get("device_total_bytes", [])) or None,
        "rss_bytes": memory.get("worker_rss_bytes"),
        "last_step": None if step is None else step.step,
        "step_time_s": None if step is None else step.step_time_s,
        "heartbeat_age_s": None
        if not member.last_heartbeat_unix
        else max(0.0, now - member.last_heartbeat_unix),
    }


def _stage_of(member: MemberRecord, stage_of_rank: dict[int, int]) -> int:
    return stage_of_rank.get(member.rank, member.stage)


def stage_of_rank(job: Job) -> dict[int, int]:
    parsed = _layout(job)
    if parsed is None:
        return {}
    return {rank: s.stage for s in parsed.stages for rank in s.ranks}


def stage_rows(job: Job, now: float) -> list[dict[str, Any]]:
    """Members aggregated per stage: counts by state, unhealthy members, memory and step spread."""
    by_stage: dict[int, list[MemberRecord]] = {}
    ranks = stage_of_rank(job)
    for member in job.members.values():
        by_stage.setdefault(_stage_of(member, ranks), []).append(member)
    rows = []
    for stage, members in sorted(by_stage.items()):
        live = [m for m in members if not m.state.is_gone]
        steps = [m.last_step for m in live if m.last_step is not None]
        used = [sum(m.memory.get("device_used_bytes", [])) for m in live if m.memory]
        beats = [now - m.last_heartbeat_unix for m in live if m.last_heartbeat_unix]
        counts: dict[str, int] = {}
        for m in members:
            counts[m.state.value] = counts.get(m.state.value, 0) + 1
        rows.append(
            {
                "stage": stage,
                "members": len(members),
                "by_state": counts,
                "unhealthy": sum(1 for m in live if _health(m) != "ok"),
                "device_used_max_bytes": max(used) if used else None,
                "min_step": min((s.step for s in steps), default=None),
                "max_step": max((s.step for s in steps), default=None),
                "step_time_median_s": statistics.median(s.step_time_s for s in steps) if steps else None,
                "heartbeat_age_max_s": max(beats) if beats else None,
            }
        )
    return rows


def members_of_stage(job: Job, stage: int, now: float) -> list[dict[str, Any]]:
    ranks = stage_of_rank(job)
    members = [m for m in job.members.values() if _stage_of(m, ranks) == stage]
    members.sort(key=lambda m: (m.dp_rank, m.worker_id))
    return [member_row(m, now) for m in members]


def _layout(job: Job) -> Any:
    try:
        parsed = job.parsed_layout()
    except (ValueError, KeyError, TypeError):
        return None
    return None if parsed is None else parsed.layout


def layout_grid(job: Job) -> dict[str, Any] | None:
    """The layout as stage x replica: each stage's layers, and per replica its rank, clock (MHz,
    None when not pinned) and the state of the member holding the rank ("-" for none)."""
    layout = _layout(job)
    if layout is None:
        return None
    holder: dict[int, MemberRecord] = {}
    for member in job.members.values():
        if member.rank >= 0 and (member.rank not in holder or not member.state.is_gone):
            holder[member.rank] = member
    clocks = dict(layout.frequencies_mhz)
    stages = []
    for s in layout.stages:
        cells = []
        for rank in s.ranks:
            m = holder.get(rank)
            cells.append(
                [
                    rank,
                    "-" if m is None else m.state.value,
                    clocks.get(rank),
                    "" if m is None else m.worker_id,
                ]
            )
        clocked = [c for c in (clocks.get(r) for r in s.ranks) if c is not None]
        stages.append(
            {
                "stage": s.stage,
                "layers": [s.layer_start, s.layer_stop],
                "clock_mhz": [min(clocked), max(clocked)] if clocked else None,
                "cells": cells,
            }
        )
    return {
        "num_layers": layout.num_layers,
        "global_batch": layout.global_batch,
        "num_micro_batches": layout.num_micro_batches,
        "stages": stages,
    }


def spares(job: Job) -> list[dict[str, Any]]:
    """Live members the current layout does not use: what the job can grow into or fail over to."""
    layout = _layout(job)
    used = set(layout.ranks()) if layout is not None else None
    out = []
    for m in sorted(job.members.values(), key=lambda m: m.worker_id):
        if m.state.is_gone or m.state in (WorkerState.PREEMPTING, WorkerState.DRAINING):
            continue
        if used is not None and m.rank not in used:
            out.append({"worker_id": m.worker_id, "host": m.host, "state": m.state.value, "rank": m.rank})
    return out


def _plan_phases(published: Event, acks: list[Event], trigger: Event | None) -> dict[str, float]:
    """MTTR breakdown of one plan, seconds, from the Core's clock: detection -> publish (plan),
    -> every executor paused (pause), -> every executor applied (apply), -> the first step
    committed on the new layout (resume)."""
    phases: dict[str, float] = {}
    start = published.time_unix
    if trigger is not None:
        phases["plan"] = published.time_unix - trigger.time_unix
    last = start
    for phase, kind in (("pause", "plan_paused"), ("apply", "plan_applied"), ("resume", "plan_resumed")):
        times = [e.time_unix for e in acks if e.kind == kind]
        if not times:
            break
        # pause and apply wait for the slowest executor; resume ends at the first commit.
        end = min(times) if phase == "resume" else max(times)
        phases[phase] = max(0.0, end - last)
        last = end
    return phases


def plans(
    job: Job,
    history: JobHistory,
    predicted: Callable[[int], float | None],
    events: Iterable[Event] | None = None,
) -> list[dict[str, Any]]:
    """The newest plans: why, predicted vs measured step time, and each recovery's MTTR breakdown.
    `predicted(epoch)` is the plan's predicted step time (None when unknown). One pass over the
    event log (10,000 events by default), so a view costs milliseconds at any job size."""
    published: list[Event] = []
    triggers: list[Event] = []
    acks: dict[int, list[Event]] = {}
    committed: dict[int, float] = {}
    settled: list[int] = []  # seqs of decisions that answered changes without a plan
    for e in job.events if events is None else events:
        if e.kind == "plan_published":
            published.append(e)
        elif e.kind.startswith("decision_"):
            settled.append(e.seq)
        elif e.kind in TRIGGER_KINDS:
            triggers.append(e)
        elif e.kind in ACK_KINDS:
            acks.setdefault(int(e.data.get("epoch", -1)), []).append(e)
        elif e.kind == "layout_committed":
            committed.setdefault(int(e.data.get("epoch", -1)), e.time_unix)
    rows = []
    first = max(0, len(published) - PLANS_SHOWN)
    for index in range(first, len(published)):
        event = published[index]
        epoch = int(event.data.get("epoch", 0))
        # The changes this plan answers: those after the previous plan or decision.
        previous_seq = max(
            published[index - 1].seq if index > 0 else 0,
            max((seq for seq in settled if seq < event.seq), default=0),
        )
        next_publish = published[index + 1].time_unix if index + 1 < len(published) else float("inf")
        mine = [e for e in triggers if previous_seq < e.seq < event.seq]
        cause = event.data.get("cause_seq")
        if cause is not None:  # the engine says which change this plan answered: MTTR counts from it
            mine = [e for e in triggers if int(cause) <= e.seq < event.seq] or mine
        its_acks = acks.get(epoch, [])
        phases = _plan_phases(event, its_acks, mine[0] if mine else None)
        before_start = published[index - 1].time_unix if index > 0 else 0.0
        commit = committed.get(epoch)
        resumed = [e for e in its_acks if e.kind == "plan_resumed"]
        rows.append(
            {
                "epoch": epoch,
                "time_unix": event.time_unix,
                "mode": event.data.get("mode"),
                "policy": event.data.get("policy"),
                "detail": event.detail,
                "reasons": event.data.get("reasons", []),
                "triggers": [f"{e.kind} {e.worker_id}".strip() for e in mine[:5]],
                "trigger_count": len(mine),
                "predicted_step_time_s": predicted(epoch),
                "measured_step_time_s": None
                if commit is None
                else history.median_step_time(job.name, commit, next_publish),
                "step_time_before_s": history.median_step_time(job.name, before_start, event.time_unix),
                "phases_s": phases,
                "mttr_s": sum(phases.values()) if "resume" in phases else None,
                "failed_acks": sum(1 for e in its_acks if e.kind == "plan_failed"),
                "steps_lost": max((int(e.data.get("steps_lost", 0)) for e in resumed), default=0),
            }
        )
    return rows


def recent_events(job: Job, limit: int = EVENTS_SHOWN) -> list[dict[str, Any]]:
    """The newest events, newest first, per-worker plan acknowledgements left out (the plans
    table counts them)."""
    out = []
    for event in reversed(job.events):
        if event.kind in ACK_KINDS:
            continue
        out.append(
            {
                "seq": event.seq,
                "time_unix": event.time_unix,
                "kind": event.kind,
                "worker_id": event.worker_id,
                "detail": event.detail,
            }
        )
        if len(out) >= limit:
            break
    return out
