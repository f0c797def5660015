"""The schedule engine: one explicit state machine per job (DESIGN.md §5; elaswave.txt §3.3, §4).

    RUNNING --(membership change)--> PLANNING --(plan published)--> APPLYING --(all resumed)--> RUNNING
                                         |  (nothing to do) -> RUNNING          | (new change) -> PLANNING
                                                                                | (a phase failed) -> PLANNING
                                                                                | (deadline) -> RUNNING

Policies only return decisions; the engine acts on them (publishes plans, records events). Every
call of `tick` makes at most one transition, so tests can step the machine one tick at a time.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, Protocol

from core_service.jobs import Job, JobTable
from core_service.metrics import CoreMetrics
from core_service.model import JobPhase, MemberRecord, WorkerState

log = logging.getLogger("elaswave.core.engine")

RESUMED_PHASES = frozenset({"RESUMED"})


@dataclass(frozen=True)
class WorkerView:
    worker_id: str
    host: str
    stage: int
    dp_rank: int
    rank: int
    state: str


@dataclass(frozen=True)
class JobSnapshot:
    """What a policy may look at: plain data, no handles."""

    job: str
    plan_epoch: int
    layout_json: str | None
    live: tuple[WorkerView, ...]
    gone: tuple[WorkerView, ...]
    changes: tuple[str, ...]  # "kind:worker" of every change since the last plan


@dataclass(frozen=True)
class Decision:
    action: Literal["publish", "none", "refuse"]
    reason: str
    policy: str
    layout_json: str | None = None
    predicted_step_time_s: float = 0.0
    reasons: tuple[str, ...] = ()
    alternatives: tuple[dict, ...] = field(default_factory=tuple)


class Policy(Protocol):
    name: str

    def decide(self, snapshot: JobSnapshot) -> Decision: ...


PublishPlan = Callable[[str, bytes, int], int]  # (job, plan body, expected epoch) -> new epoch


def snapshot_of(job: Job) -> JobSnapshot:
    def view(m: MemberRecord) -> WorkerView:
        return WorkerView(m.worker_id, m.host, m.stage, m.dp_rank, m.rank, m.state.value)

    members = sorted(job.members.values(), key=lambda m: m.worker_id)
    return JobSnapshot(
        job=job.name,
        plan_epoch=job.plan_epoch,
        layout_json=job.layout_json,
        live=tuple(view(m) for m in members if not m.state.is_gone),
        gone=tuple(view(m) for m in members if m.state.is_gone),
        changes=tuple(f"{e.kind}:{e.worker_id}" for e in job.pending_changes),
    )


@dataclass
class _Applying:
    epoch: int
    started: float
    deadline: float


class ScheduleEngine:
    def __init__(
        self,
        table: JobTable,
        metrics: CoreMetrics,
        policy: Policy,
        publish: PublishPlan,
        apply_timeout_s: float,
    ) -> None:
        self.table = table
        self.metrics = metrics
        self.policy = policy
        self.publish = publish
        self.apply_timeout_s = apply_timeout_s
        self._applying: dict[str, _Applying] = {}

    def tick_all(self, now: float) -> None:
        for job in list(self.table.jobs.values()):
            self.tick(job, now)

    def tick(self, job: Job, now: float) -> JobPhase:
        """Makes at most one transition of `job`'s state machine and returns the new phase."""
        if job.phase == JobPhase.RUNNING and job.pending_changes:
            self._enter(job, JobPhase.PLANNING, now, f"{len(job.pending_changes)} change(s) to plan for")
        elif job.phase == JobPhase.PLANNING:
            self._plan(job, now)
        elif job.phase == JobPhase.APPLYING:
            self._watch_apply(job, now)
        return job.phase

    def _enter(self, job: Job, phase: JobPhase, now: float, detail: str) -> None:
        job.phase = phase
        self.table.record(job, f"phase_{phase.value.lower()}", detail=detail, now=now)

    def _plan(self, job: Job, now: float) -> None:
        snapshot = snapshot_of(job)
        job.pending_changes.clear()
        started = time.perf_counter()
        decision = self.policy.decide(snapshot)
        self.metrics.plan_seconds.observe(time.perf_counter() - started)
        data = {"policy": decision.policy, "changes": list(snapshot.changes),
                "alternatives": list(decision.alternatives)}
        if decision.action != "publish" or decision.layout_json is None:
            self.table.record(job, f"decision_{decision.action}", detail=decision.reason, now=now, data=data)
            self._enter(job, JobPhase.RUNNING, now, decision.reason)
            return
        body = json.dumps({
            "job": job.name, "layout_json": decision.layout_json, "reasons": list(decision.reasons),
            "predicted_step_time_s": decision.predicted_step_time_s, "created_unix": now,
            "policy": decision.policy,
        }, sort_keys=True).encode()
        epoch = self.publish(job.name, body, job.plan_epoch)
        job.plan_epoch = epoch
        job.layout_json = decision.layout_json
        self.metrics.plans_published.labels(policy=decision.policy).inc()
        data["epoch"] = epoch
        self.table.record(job, "plan_published", detail=decision.reason, now=now, data=data)
        self._applying[job.name] = _Applying(epoch, now, now + self.apply_timeout_s)
        self._enter(job, JobPhase.APPLYING, now, f"waiting for executors to apply epoch {epoch}")

    def _watch_apply(self, job: Job, now: float) -> None:
        applying = self._applying[job.name]
        acks = job.acks.get(applying.epoch, {})
        if job.pending_changes:
            self._enter(job, JobPhase.PLANNING, now, "new change while applying: re-planning from the cumulative state")
            return
        failed = {w: p for w, p in acks.items() if p.startswith("FAILED")}
        if failed:
            self._enter(job, JobPhase.PLANNING, now, f"apply failed on {sorted(failed)}: re-planning")
            return
        live = {m.worker_id for m in job.live_members() if m.state != WorkerState.JOINING}
        if live and all(acks.get(w) in RESUMED_PHASES for w in live):
            self.metrics.apply_seconds.observe(now - applying.started)
            self._enter(job, JobPhase.RUNNING, now, f"epoch {applying.epoch} applied by {len(live)} workers")
        elif now >= applying.deadline:
            self._enter(job, JobPhase.RUNNING, now, f"epoch {applying.epoch} not confirmed by every worker in time")
