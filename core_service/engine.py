"""The schedule engine: one explicit state machine per job (docs/architecture.md ("The Core's decisions"); ElasWave §3.3, §4).

    RUNNING --(membership change)--> PLANNING --(plan published)--> APPLYING --(all resumed)--> RUNNING
                                         |  (nothing to do) -> RUNNING          | (new change) -> PLANNING
                                                                                | (a phase failed) -> PLANNING
                                                                                | (deadline) -> RUNNING

Policies only return decisions; the engine acts on them (publishes plans, records events). Every
call of `tick` makes at most one transition, so tests can step the machine one tick at a time.

Failures stay with their job: a policy that raises leaves the job in PLANNING with its changes
kept, records `plan_failed` and retries with exponential backoff (a standby would run the same
planner on the same state, so this is no reason to give up leadership). A failed publish keeps
the changes too and is reported by `tick_all`, so the Core can count registry failures and step
down when they persist. A new leader `restore`s each job from the registry (layout of the newest
plan, pending changes, an interrupted apply).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Literal, Protocol

from core_service.jobs import Job, JobTable
from core_service.metrics import CoreMetrics
from core_service.model import Event, JobPhase, MemberRecord, WorkerState

log = logging.getLogger("elaswave.core.engine")

RESUMED_PHASES = frozenset({"RESUMED"})
# Workers whose rank leaves the layout at the next plan (the states LayoutPolicy re-plans for).
LEAVING_STATES = frozenset({WorkerState.LOST, WorkerState.LEFT, WorkerState.PREEMPTING, WorkerState.DRAINING})
# Executor acknowledgements as recorded in the event log ("plan_<phase>", see ExecutorService).
ACK_EVENT_KINDS = frozenset({"plan_received", "plan_paused", "plan_applied", "plan_resumed", "plan_failed"})
PLAN_RETRY_FIRST_S = 0.5
PLAN_RETRY_MAX_S = 30.0


@dataclass(frozen=True)
class WorkerView:
    worker_id: str
    host: str
    stage: int
    dp_rank: int
    rank: int
    state: str
    # Last reported step time: the ElasWave policy sizes a fail-slow straggler's slowdown from it.
    step_time_s: float | None = None


@dataclass(frozen=True)
class JobSnapshot:
    """What a policy may look at: plain data, no handles."""

    job: str
    plan_epoch: int
    layout_json: str | None
    live: tuple[WorkerView, ...]
    gone: tuple[WorkerView, ...]
    changes: tuple[str, ...]  # "kind:worker" of every change since the last plan
    model_json: str | None = None  # the job's registered model (`elaswave plan` state.json), if any


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


PublishPlan = Callable[[str, bytes, int], Awaitable[int]]  # (job, plan body, expected epoch) -> new epoch


def snapshot_of(job: Job) -> JobSnapshot:
    def view(m: MemberRecord) -> WorkerView:
        step_time = m.last_step.step_time_s if m.last_step is not None else None
        return WorkerView(m.worker_id, m.host, m.stage, m.dp_rank, m.rank, m.state.value, step_time)

    members = sorted(job.members.values(), key=lambda m: m.worker_id)
    return JobSnapshot(
        job=job.name,
        plan_epoch=job.plan_epoch,
        layout_json=job.layout_json,
        live=tuple(view(m) for m in members if not m.state.is_gone),
        gone=tuple(view(m) for m in members if m.state.is_gone),
        changes=tuple(f"{e.kind}:{e.worker_id}" for e in job.pending_changes),
        model_json=job.model_json,
    )


@dataclass
class _Applying:
    epoch: int
    started: float
    deadline: float


@dataclass
class _Retry:
    failures: int
    not_before: float


@dataclass(frozen=True)
class TickFailure:
    """A job whose tick raised (e.g. its plan could not be stored); its changes are kept."""

    job: str
    error: Exception


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
        self._retry: dict[str, _Retry] = {}

    async def tick_all(self, now: float) -> list[TickFailure]:
        """Ticks every job; one job's failure is logged with its name and never stops the others."""
        failures = []
        for job in list(self.table.jobs.values()):
            try:
                await self.tick(job, now)
            except Exception as exc:
                log.exception("job=%s engine tick failed in phase %s", job.name, job.phase.value)
                failures.append(TickFailure(job.name, exc))
        return failures

    async def tick(self, job: Job, now: float) -> JobPhase:
        """Makes at most one transition of `job`'s state machine and returns the new phase."""
        if job.phase == JobPhase.RUNNING and job.pending_changes:
            self._enter(job, JobPhase.PLANNING, now, f"{len(job.pending_changes)} change(s) to plan for")
        elif job.phase == JobPhase.PLANNING:
            await self._plan(job, now)
        elif job.phase == JobPhase.APPLYING:
            self._watch_apply(job, now)
        return job.phase

    def _enter(self, job: Job, phase: JobPhase, now: float, detail: str) -> None:
        job.phase = phase
        self.table.record(job, f"phase_{phase.value.lower()}", detail=detail, now=now)

    async def _plan(self, job: Job, now: float) -> None:
        retry = self._retry.get(job.name)
        if retry is not None and now < retry.not_before:
            return
        snapshot = snapshot_of(job)
        taken = list(job.pending_changes)
        job.pending_changes.clear()
        started = time.perf_counter()
        try:
            decision = self.policy.decide(snapshot)
        except Exception as exc:
            job.pending_changes[:0] = taken  # nothing was planned: the changes are still to plan for
            self._back_off(job, now, f"policy {getattr(self.policy, 'name', '?')} failed: {exc!r}")
            return
        self.metrics.plan_seconds.observe(time.perf_counter() - started)
        data = {
            "policy": decision.policy,
            "changes": list(snapshot.changes),
            "alternatives": list(decision.alternatives),
        }
        if decision.action != "publish" or decision.layout_json is None:
            self._retry.pop(job.name, None)
            self.table.record(job, f"decision_{decision.action}", detail=decision.reason, now=now, data=data)
            self._enter(job, JobPhase.RUNNING, now, decision.reason)
            return
        body = json.dumps(
            {
                "job": job.name,
                "layout_json": decision.layout_json,
                "reasons": list(decision.reasons),
                "predicted_step_time_s": decision.predicted_step_time_s,
                "created_unix": now,
                "policy": decision.policy,
            },
            sort_keys=True,
        ).encode()
        try:
            epoch = await self.publish(job.name, body, job.plan_epoch)
        except BaseException:
            job.pending_changes[:0] = taken  # not published: plan again on the next tick
            raise
        self._retry.pop(job.name, None)
        job.plan_epoch = epoch
        job.layout_json = decision.layout_json
        self.metrics.plans_published.labels(policy=decision.policy).inc()
        data["epoch"] = epoch
        self.table.record(job, "plan_published", detail=decision.reason, now=now, data=data)
        self._applying[job.name] = _Applying(epoch, now, now + self.apply_timeout_s)
        self._enter(job, JobPhase.APPLYING, now, f"waiting for executors to apply epoch {epoch}")

    def _back_off(self, job: Job, now: float, reason: str) -> None:
        """The job stays in PLANNING and is planned again after an exponentially growing pause."""
        previous = self._retry.get(job.name)
        failures = 1 if previous is None else previous.failures + 1
        delay = min(PLAN_RETRY_FIRST_S * 2 ** (failures - 1), PLAN_RETRY_MAX_S)
        self._retry[job.name] = _Retry(failures, now + delay)
        log.exception("job=%s planning failed (%d in a row); retrying in %.1fs", job.name, failures, delay)
        self.table.record(
            job,
            "planner_failed",
            detail=f"{reason}; retrying in {delay:.1f}s",
            now=now,
            data={"failures": failures, "retry_in_s": delay},
        )

    def _watch_apply(self, job: Job, now: float) -> None:
        applying = self._applying[job.name]
        acks = job.acks.get(applying.epoch, {})
        if job.pending_changes:
            self._enter(
                job,
                JobPhase.PLANNING,
                now,
                "new change while applying: re-planning from the cumulative state",
            )
            return
        failed = {w: p for w, p in acks.items() if p.startswith("FAILED")}
        if failed:
            self._enter(job, JobPhase.PLANNING, now, f"apply failed on {sorted(failed)}: re-planning")
            return
        # Members the plan removed (a preempted rank on its way out) never resume: not waited for.
        live = {
            m.worker_id for m in job.live_members() if m.state != WorkerState.JOINING and job.in_layout(m)
        }
        if live and all(acks.get(w) in RESUMED_PHASES for w in live):
            self.metrics.apply_seconds.observe(now - applying.started)
            self._enter(job, JobPhase.RUNNING, now, f"epoch {applying.epoch} applied by {len(live)} workers")
        elif now >= applying.deadline:
            self._enter(
                job, JobPhase.RUNNING, now, f"epoch {applying.epoch} not confirmed by every worker in time"
            )

    # ---- takeover --------------------------------------------------------------------------------
    def reset(self) -> None:
        """Forgets what a previous leadership term was watching."""
        self._applying.clear()
        self._retry.clear()

    def restore(self, job: Job, epoch: int, latest_plan: tuple[int, bytes] | None, now: float) -> None:
        """Resumes `job` where the previous leader left it, from what the registry holds.

        The layout is the newest stored plan's (the job spec keeps the layout the job was created
        with); ranks of that layout whose worker is leaving are planned again (the previous leader
        may have died between storing the loss and publishing its plan); and a plan whose apply
        had not finished is watched again, with the acknowledgements found in the event log.
        """
        job.plan_epoch = epoch
        job.phase = JobPhase.RUNNING
        job.pending_changes.clear()
        if latest_plan is not None:
            job.layout_json = json.loads(latest_plan[1])["layout_json"]
        for member, rank in leaving_ranks(job):
            self.table.record(
                job,
                "replan_after_takeover",
                worker_id=member.worker_id,
                now=now,
                membership_change=True,
                detail=f"rank {rank} is in the layout of epoch {epoch} but its worker is {member.state.value}",
            )
        if latest_plan is not None and latest_plan[0] == epoch and _apply_unfinished(job, epoch):
            job.acks[epoch] = acks_from_events(job.events, epoch)
            self._applying[job.name] = _Applying(epoch, now, now + self.apply_timeout_s)
            self._enter(
                job, JobPhase.APPLYING, now, f"watching the apply of epoch {epoch} again after a takeover"
            )


def leaving_ranks(job: Job) -> list[tuple[MemberRecord, int]]:
    """Members in a leaving state whose rank is still in the job's current layout."""
    try:
        parsed = job.parsed_layout()
    except (ValueError, KeyError, TypeError) as exc:
        log.error("job=%s has a layout that cannot be read (%s); nothing re-planned", job.name, exc)
        return []
    if parsed is None:
        return []
    members = sorted(job.members.values(), key=lambda m: m.worker_id)
    return [(m, m.rank) for m in members if m.state in LEAVING_STATES and m.rank in parsed.ranks]


def _apply_unfinished(job: Job, epoch: int) -> bool:
    """Was the previous leader still applying `epoch`? Publishing always records `plan_published`
    then `phase_applying`, and a finished apply a later phase event; writes are ordered, so a
    stored plan whose events are missing (the leader died in between) was still being applied."""
    events = list(job.events)
    published = [e.seq for e in events if e.kind == "plan_published" and e.data.get("epoch") == epoch]
    if not published:
        pruned = bool(events) and events[0].seq > 1
        return not pruned  # pruned: the plan is older than the whole kept event log
    later = [e.kind for e in events if e.kind.startswith("phase_") and e.seq > published[-1]]
    return not later or later[-1] == "phase_applying"


def acks_from_events(events: Iterable[Event], epoch: int) -> dict[str, str]:
    """Each worker's last acknowledged phase of `epoch`, as ExecutorService recorded it."""
    acks: dict[str, str] = {}
    for event in events:
        if event.kind in ACK_EVENT_KINDS and event.worker_id and event.data.get("epoch") == epoch:
            phase = event.kind.removeprefix("plan_").upper()
            acks[event.worker_id] = f"FAILED: {event.detail}" if phase == "FAILED" else phase
    return acks
