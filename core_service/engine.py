"""The schedule engine: one explicit state machine per job (docs/architecture.md ("The Core's decisions"); ElasWave §3.3, §4).

    RUNNING --(membership change, spare, retry request)--> PLANNING --(plan published)--> APPLYING --(all resumed)--> RUNNING
                                                       |  (nothing to do, refused) -> RUNNING  | (new change) -> PLANNING
                                                                                               | (a phase failed) -> PLANNING
                                                                                               | (collective failure) -> PLANNING
                                                                                               | (deadline) -> RUNNING
    any phase --(every worker of the layout finished)--> COMPLETED (terminal)
    PLANNING --(every worker gone, no plan possible)--> FAILED (terminal, with the reason)
    any phase --(ended on request: REST DELETE, SchedulerService.EndJob)--> STOPPED (terminal)

A spare (a worker registered with rank -1, `WorkerState.SPARE`) is a pending change like a loss:
the policy may take it in, and the plan names it in `Plan.joiners` with a fresh rank (the
largest rank the job ever used + 1, ...); the member gets its rank, stage and DP rank when the
plan is published. No plan leaves fewer ranks than the job's `min_workers` or more than its
maximum (`Job.rank_limit`): the engine refuses such a decision, whatever the policy.

Policies only return decisions (`core_service.job_snapshot`); the engine acts on them (checks
them, `core_service.plan_checks`, publishes plans, records events). Every
call of `tick` makes at most one transition, so tests can step the machine one tick at a time.

Recovery is restartable: every plan goes from the job's committed layout (the newest epoch a
step committed on, proven by one RESUMED ack) to the policy's target, and its mode (IN_PLACE or
RESTORE) follows `core_service.recovery`. Executors whose apply was interrupted go back to their
committed state and wait; when re-planning finds nothing new to change, the engine republishes
the target under a new epoch ("retry of epoch N after ..."), a bounded number of times.

Failures stay with their job: a policy that raises leaves the job in PLANNING with its changes
kept, records `planner_failed` and retries with exponential backoff (a standby would run the same
planner on the same state, so this is no reason to give up leadership). A failed publish keeps
the changes too and is reported by `tick_all`, so the Core can count registry failures and step
down when they persist. A new leader `restore`s each job from the registry (layout of the newest
plan, committed layout, pending changes, an interrupted apply).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from core_service.job_snapshot import Policy, snapshot_of
from core_service.job_state import (
    acks_from_events,
    apply_unfinished,
    finished_workers,
    leaving_ranks,
    ready_spares,
)
from core_service.jobs import Job, JobTable
from core_service.metrics import CoreMetrics
from core_service.model import (
    SPARE_READY_EVENT,
    Ack,
    AckPhase,
    Event,
    JobPhase,
    MemberRecord,
    RetryRequest,
    WorkerState,
)
from core_service.plan_checks import (
    joiners_of,
    note_unit_moves,
    outside_bounds,
    request_data,
    standby_ranks,
    target_of,
)
from core_service.recovery import (
    COLLECTIVE_EVENT,
    COMMITTED_EVENT,
    MAX_IN_PLACE_RETRIES,
    MAX_RESTORE_FAILURES,
    RESTORE,
    CollectiveFailure,
    PeerAction,
    PeerOutcome,
    choose_mode,
    judge_collective_failure,
)
from planners.layout import Layout, Plan, PlanMode

log = logging.getLogger("elaswave.core.engine")

PLAN_RETRY_FIRST_S = 0.5
PLAN_RETRY_MAX_S = 30.0


# (job, plan body, expected epoch) -> new epoch. The store allocates `expected + 1` or refuses
# (StaleEpoch), so the body can name its epoch before it is stored.
PublishPlan = Callable[[str, bytes, int], Awaitable[int]]


@dataclass
class _Applying:
    epoch: int
    started: float
    deadline: float
    optional: bool = False  # a plan nobody needed: its pause prices the next one (payback rule)


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
            finally:
                self.table.save_recovery(job)  # a no-op unless the tick changed the retry bounds
        return failures

    async def tick(self, job: Job, now: float) -> JobPhase:
        """Makes at most one transition of `job`'s state machine and returns the new phase."""
        if job.phase.terminal:
            return job.phase
        if job.check_completion:
            job.check_completion = False
            finished = finished_workers(job)
            if finished:
                self._complete(job, finished, now)
                return job.phase
            if job.work_done and (job.phase is not JobPhase.RUNNING or job.pending_changes):
                self._drop_plans_after_the_work(job, now)
                return job.phase
        if job.phase == JobPhase.RUNNING and job.pending_changes:
            self._enter(job, JobPhase.PLANNING, now, f"{len(job.pending_changes)} change(s) to plan for")
        elif job.phase == JobPhase.RUNNING and job.recovery.request is not None:
            self._enter(job, JobPhase.PLANNING, now, f"to answer: {job.recovery.request.summary()}")
        elif job.phase == JobPhase.PLANNING:
            await self._plan(job, now)
        elif job.phase == JobPhase.APPLYING:
            self._watch_apply(job, now)
        return job.phase

    def _drop_plans_after_the_work(self, job: Job, now: float) -> None:
        """A worker finished while a loss was being planned for: the loss came after the job's
        last step committed (a worker finishes only then), so there is nothing to recover. The
        plan in progress is dropped; the job completes once its other workers end."""
        dropped = [e.kind for e in job.pending_changes]
        if job.plan_epoch > job.committed_epoch and job.committed_layout_json is not None:
            # No worker will apply that plan: the layout the job ends on is the committed one,
            # whose ranks the completion counts (`finished_workers`).
            job.layout_json = job.committed_layout_json
        job.pending_changes.clear()
        job.recovery.request = None
        self._applying.pop(job.name, None)
        self._retry.pop(job.name, None)
        self.table.record(
            job,
            "plan_dropped",
            detail=f"the job's work is done (a worker finished); no plan for {dropped or 'the apply'}",
            now=now,
            data={"pending": dropped, "plan_epoch": job.plan_epoch},
        )
        self._enter(job, JobPhase.RUNNING, now, "the job's work is done; waiting for its workers to end")

    def _complete(self, job: Job, finished: list[MemberRecord], now: float) -> None:
        """Every worker of the layout finished: the job is COMPLETED, with the final checkpoint
        most of them reported (persisted in the job's spec: a new leader keeps it)."""
        reported = Counter(m.checkpoint for m in finished if m.checkpoint)
        checkpoint = reported.most_common(1)[0][0] if reported else ""
        # Ended without finishing once the last step had committed (`finished_workers`).
        unfinished = sorted(
            m.worker_id
            for m in job.members.values()
            if m.state.is_gone and not m.finished and m.rank >= 0 and job.in_layout(m)
        )
        job.completed_unix, job.final_checkpoint = now, checkpoint
        job.pending_changes.clear()
        job.recovery.request = None
        self._applying.pop(job.name, None)
        self._retry.pop(job.name, None)
        self.table.save_spec(job)
        where = f"final checkpoint {checkpoint}" if checkpoint else "no checkpoint reported"
        data: dict[str, Any] = {"final_checkpoint": checkpoint, "workers": len(finished)}
        if len(reported) > 1:
            data["checkpoints_reported"] = dict(reported)
        detail = f"all {len(finished)} workers finished; {where}"
        if unfinished:
            data["ended_unfinished"] = unfinished
            detail = (
                f"{len(finished)} workers finished, {unfinished} ended after the last step committed; {where}"
            )
        self.table.record(job, "job_completed", detail=detail, now=now, data=data)
        self._enter(job, JobPhase.COMPLETED, now, f"every worker finished its work; {where}")

    def end(self, job: Job, phase: JobPhase, reason: str, now: float) -> Event:
        """Ends `job` in the terminal `phase` (FAILED or STOPPED) with `reason`; persisted in its
        spec (a new leader keeps it). Returns the event recorded."""
        if phase not in (JobPhase.FAILED, JobPhase.STOPPED):
            raise ValueError(f"a job ends FAILED or STOPPED, not {phase.value}")
        if not job.latest_checkpoint:
            reported = [m.checkpoint for m in job.members.values() if m.checkpoint]
            job.latest_checkpoint = job.final_checkpoint or (reported[-1] if reported else "")
        job.ended_unix, job.end_phase, job.end_reason = now, phase.value, reason
        job.pending_changes.clear()
        job.recovery.request = None
        self._applying.pop(job.name, None)
        self._retry.pop(job.name, None)
        self.table.save_spec(job)
        where = job.latest_checkpoint or "no checkpoint reported"
        event = self.table.record(
            job,
            f"job_{phase.value.lower()}",
            detail=f"{reason}; latest checkpoint: {where}",
            now=now,
            data={"reason": reason, "latest_checkpoint": job.latest_checkpoint},
        )
        self._enter(job, phase, now, reason)
        return event

    def _enter(self, job: Job, phase: JobPhase, now: float, detail: str) -> None:
        job.phase = phase
        self.table.record(job, f"phase_{phase.value.lower()}", detail=detail, now=now)

    # ---- planning --------------------------------------------------------------------------------
    async def _plan(self, job: Job, now: float) -> None:
        retry = self._retry.get(job.name)
        if retry is not None and now < retry.not_before:
            return
        snapshot = snapshot_of(job)
        taken = list(job.pending_changes)
        job.pending_changes.clear()
        request = job.recovery.request  # answered (cleared) only once a plan or a decision is recorded
        started = time.perf_counter()
        try:
            decision = self.policy.decide(snapshot)
        except Exception as exc:
            job.pending_changes[:0] = taken  # nothing was planned: the changes are still to plan for
            self._back_off(job, now, f"policy {getattr(self.policy, 'name', '?')} failed: {exc!r}")
            return
        self.metrics.plan_seconds.observe(time.perf_counter() - started)
        data: dict[str, Any] = {
            "policy": decision.policy,
            "changes": list(snapshot.changes),
            "alternatives": list(decision.alternatives),
            "epoch": job.plan_epoch,
            **request_data(request),
        }
        if taken:
            # What caused this plan: its earliest change (the dashboard's MTTR counts from it,
            # never from an older event a previous decision already answered).
            data.update(cause_seq=taken[0].seq, cause_kind=taken[0].kind, cause_unix=taken[0].time_unix)
        recovery = job.recovery
        # A RESTORE plan whose apply failed: the failure counts once, when it is answered.
        restore_failed = bool(
            request is not None
            and request.failed
            and job.last_plan is not None
            and job.last_plan.mode == PlanMode.RESTORE
            and request.epoch == job.plan_epoch
        )
        restore_failures = recovery.restore_failures + int(restore_failed)
        if restore_failed and restore_failures >= MAX_RESTORE_FAILURES:
            assert request is not None
            recovery.restore_failures = restore_failures
            self._settle(
                job,
                "refuse",
                f"restoring from the latest durable checkpoint failed {restore_failures} times without a "
                f"committed step (last: {request.summary()}): no further plan is published; check the "
                "checkpoint and the workers' logs, then restart the job from its latest checkpoint",
                now,
                {**data, "mode": PlanMode.RESTORE.value, "restore_failures": restore_failures},
            )
            return
        target = target_of(job, decision, request)
        if target is None and decision.action == "refuse" and not job.live_members():
            # Nobody is left to apply any plan, and the policy can make none: the job cannot go
            # on. FAILED (terminal) with the reason and where to resume from, not RUNNING forever.
            self.table.record(job, "decision_refuse", detail=decision.reason, now=now, data=data)
            self.end(
                job, JobPhase.FAILED, f"every worker is gone and no plan is possible: {decision.reason}", now
            )
            return
        if target is None:
            recovery.restore_failures = restore_failures
            self._settle(job, decision.action, decision.reason, now, data)
            return
        new, reasons, detail, predicted, retry_of = target
        committed = None if job.committed_layout_json is None else Layout.from_json(job.committed_layout_json)
        refusal = outside_bounds(snapshot, new)
        joiners: tuple[tuple[int, str], ...] = ()
        if not refusal:
            joiners, refusal = joiners_of(job, committed, new, decision)
        if refusal:
            recovery.restore_failures = restore_failures
            self._settle(job, "refuse", refusal, now, {**data, "ranks": len(new.ranks())})
            return
        standby = standby_ranks(job, committed, new, request)
        mode, why = choose_mode(job, committed, new, request, standby)
        in_place_retries = recovery.in_place_retries
        if retry_of is not None and request is not None and request.failed and mode == PlanMode.IN_PLACE:
            if in_place_retries >= MAX_IN_PLACE_RETRIES:
                mode = PlanMode.RESTORE
                why = (
                    f"{RESTORE}: the in-place recovery was retried {in_place_retries} times "
                    "without a committed step",
                )
            else:
                in_place_retries += 1
        plan = Plan(
            epoch=job.plan_epoch + 1,
            old=committed,
            new=new,
            reasons=(*reasons, *why),
            predicted_step_time_s=predicted,
            job=job.name,
            policy=decision.policy,
            mode=mode,
            created_unix=now,
            joiners=joiners,
            standby=tuple(sorted(standby)),
        )
        try:
            epoch = await self.publish(job.name, plan.to_json().encode(), job.plan_epoch)
        except BaseException:
            job.pending_changes[:0] = taken  # not published: plan again on the next tick
            raise
        if epoch != plan.epoch:  # the store allocates expected + 1 or refuses: never happens
            raise RuntimeError(f"job {job.name}: plan {plan.epoch} was stored as epoch {epoch}")
        self._retry.pop(job.name, None)
        recovery.in_place_retries, recovery.restore_failures = in_place_retries, restore_failures
        if request is not None:
            for rank in request.peers:
                recovery.collective_retries[rank] = recovery.collective_retries.get(rank, 0) + 1
        recovery.request = None
        if decision.optional:
            old_layout = Layout.from_json(job.layout_json) if job.layout_json else None
            note_unit_moves(job, old_layout, new, snapshot.step)
        job.plan_epoch, job.layout_json, job.last_plan = epoch, new.to_json(), plan
        job.acks.setdefault(epoch, {})  # watched from now on (recovery.answered)
        self.metrics.plans_published.labels(policy=decision.policy).inc()
        data.update(
            epoch=epoch,
            mode=mode.value,
            reasons=list(plan.reasons),
            in_place_retries=in_place_retries,
            restore_failures=restore_failures,
        )
        if retry_of is not None:
            data["retry_of"] = retry_of
        if mode == PlanMode.RESTORE:
            detail = f"{detail}; {'; '.join(why)}"
        if joiners:
            data["joiners"] = [[rank, worker] for rank, worker in joiners]
        self.table.record(job, "plan_published", detail=detail, now=now, data=data)
        self._place_joiners(job, new, decision.joiners, epoch, now)
        self._applying[job.name] = _Applying(epoch, now, now + self.apply_timeout_s, decision.optional)
        self._enter(job, JobPhase.APPLYING, now, f"waiting for executors to apply epoch {epoch}")

    def _place_joiners(
        self, job: Job, new: Layout, joiners: tuple[tuple[int, str], ...], epoch: int, now: float
    ) -> None:
        """The spares plan `epoch` takes in get their rank, stage and DP rank (JOINING until they
        report a step). One that died while the plan was stored keeps its rank too, so the next
        plan finds it going and plans it out (a failure during a join)."""
        for rank, worker_id in joiners:
            member = job.members.get(worker_id)
            if member is None:
                continue
            stage = new.stage_layout_of_rank(rank)
            member.rank, member.stage, member.dp_rank = rank, stage.stage, stage.dp_index(rank)
            gone = member.state.is_gone
            if not gone:
                member.state, member.state_changed_unix = WorkerState.JOINING, now
            self.table.save_member(job, member)
            self.table.record(
                job,
                "joiner_lost" if gone else "spare_joining",
                worker_id=worker_id,
                detail=f"rank {rank} (stage {stage.stage}, DP rank {member.dp_rank}) in epoch {epoch}"
                + ("; it is already gone: planned out again" if gone else ""),
                now=now,
                data={"epoch": epoch, "rank": rank, "stage": stage.stage, "dp_rank": member.dp_rank},
                membership_change=gone,
            )

    def _restore_joiners(self, job: Job, latest: Plan, now: float) -> None:
        """The previous leader may have stored a plan and died before its joiners' records were:
        they get their ranks from the plan, as `_place_joiners` would have given them."""
        for rank, worker_id in latest.joiners:
            member = job.members.get(worker_id)
            if member is not None and member.rank < 0:
                self._place_joiners(job, latest.new, ((rank, worker_id),), latest.epoch, now)

    def _settle(self, job: Job, action: str, reason: str, now: float, data: dict[str, Any]) -> None:
        """No plan: records the decision and returns to RUNNING. A refused retry request is given
        up for this epoch: later failures of the same epoch do not plan again."""
        self._retry.pop(job.name, None)
        if job.recovery.request is not None and action == "refuse":
            job.recovery.gave_up_at = job.plan_epoch
        job.recovery.request = None
        self.table.record(job, f"decision_{action}", detail=reason, now=now, data=data)
        self._enter(job, JobPhase.RUNNING, now, reason)

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

    # ---- applying --------------------------------------------------------------------------------
    def _watch_apply(self, job: Job, now: float) -> None:
        applying = self._applying[job.name]
        acks = job.acks.get(applying.epoch, {})
        if any(a.phase == AckPhase.RESUMED for a in acks.values()) and job.layout_json is not None:
            self.commit(job, applying.epoch, job.layout_json, now)
        # A spare that became ready is no reason to supersede the plan in flight: a superseded
        # plan abandons group builds its members may have entered (seconds lost to the group
        # timeout), and the spare is taken in by the next plan, once this one is applied, with
        # every other spare that became ready meanwhile. Any other change re-plans at once.
        if any(e.kind != SPARE_READY_EVENT for e in job.pending_changes):
            self._enter(
                job,
                JobPhase.PLANNING,
                now,
                "new change while applying: re-planning from the cumulative state",
            )
            return
        failed = {w: a for w, a in acks.items() if a.failed}
        if failed:
            self._request_retry(job, applying.epoch, failed=failed)
        if job.recovery.request is not None:
            self._enter(job, JobPhase.PLANNING, now, f"re-planning: {job.recovery.request.summary()}")
            return
        # Members the plan removed (a preempted rank on its way out) never resume: not waited for.
        live = {
            m.worker_id
            for m in job.live_members()
            if m.state is not WorkerState.JOINING and m.state is not WorkerState.SPARE and job.in_layout(m)
        }
        if live and all(w in acks and acks[w].phase == AckPhase.RESUMED for w in live):
            self.metrics.apply_seconds.observe(now - applying.started)
            if applying.optional:  # a loss's plan also replays a step: not what an optional one costs
                job.plan_pause_s = now - applying.started  # what the next optional plan must pay back
            self._enter(job, JobPhase.RUNNING, now, f"epoch {applying.epoch} applied by {len(live)} workers")
        elif now >= applying.deadline:
            self._enter(
                job, JobPhase.RUNNING, now, f"epoch {applying.epoch} not confirmed by every worker in time"
            )

    def _request_retry(
        self,
        job: Job,
        epoch: int,
        *,
        failed: dict[str, Ack] | None = None,
        collective: str = "",
        peer_rank: int | None = None,
    ) -> None:
        """Asks for a plan newer than `epoch` (merged into a request not yet answered)."""
        recovery = job.recovery
        if recovery.gave_up_at == epoch:
            return
        request = recovery.request
        if request is None:
            request = recovery.request = RetryRequest(epoch)
        request.failed.update(failed or {})
        if collective:
            request.collective.append(collective)
        if peer_rank is not None:
            request.peers.add(peer_rank)

    # ---- what executors report -----------------------------------------------------------------
    def acknowledge(
        self, job: Job, worker_id: str, epoch: int, ack: Ack, phase_time_s: float, now: float
    ) -> None:
        """Records a phase acknowledgement of plan `epoch` (the newest; ExecutorService checks).

        RESUMED commits the epoch (one is proof: a commit is atomic across the layout's workers);
        FAILED asks for a newer plan, which the next tick plans (in any phase)."""
        job.acks.setdefault(epoch, {})[worker_id] = ack
        data: dict[str, Any] = {"epoch": epoch, "phase_time_s": phase_time_s}
        detail = f"epoch {epoch} in {phase_time_s:.3f}s"
        if ack.failure is not None:
            data.update(failure=ack.failure.value, reason=ack.reason)
            detail += f" ({ack.failure.value}): {ack.reason}"
        if ack.steps_replayed:
            data["steps_lost"] = ack.steps_replayed
            detail += f"; restored in place, {ack.steps_replayed} committed steps replayed"
        self.table.record(
            job, f"plan_{ack.phase.value.lower()}", worker_id=worker_id, detail=detail, now=now, data=data
        )
        if ack.phase == AckPhase.RESUMED and epoch == job.plan_epoch and job.layout_json is not None:
            self.commit(job, epoch, job.layout_json, now)
        elif ack.failed and epoch == job.plan_epoch and epoch > job.committed_epoch:
            self._request_retry(job, epoch, failed={worker_id: ack})
        self.table.save_recovery(job)  # queued before the caller waits for durability

    def commit(self, job: Job, epoch: int, layout_json: str, now: float) -> bool:
        """Epoch `epoch` (layout `layout_json`) committed a step: it is where executors restart an
        interrupted apply from. Progress: the retry bounds start again. False if not newer."""
        if epoch <= job.committed_epoch:
            return False
        job.committed_epoch, job.committed_layout_json = epoch, layout_json
        job.recovery.progress()
        self.table.save_recovery(job)
        self.table.record(
            job,
            COMMITTED_EVENT,
            detail=f"a step committed on the layout of epoch {epoch}: later plans start from it",
            now=now,
            data={"epoch": epoch},
        )
        return True

    def collective_failure(self, job: Job, failure: CollectiveFailure, now: float) -> PeerOutcome:
        """A collective failed with no membership change: a replay on the same layout while the
        named peer looks alive, bounded by `recovery.COLLECTIVE_RETRIES`; the caller marks the
        peer lost when the outcome says so (membership owns that path)."""
        outcome = judge_collective_failure(job, failure, self.table.settings.heartbeat_timeout_s, now)
        data = {
            "peer_rank": failure.peer_rank,
            "step": failure.step,
            "operation": failure.operation,
            "epoch": job.plan_epoch,
            "outcome": outcome.action.value,
        }
        if outcome.action == PeerAction.RETRY:
            fresh = job.recovery.request is None
            self._request_retry(
                job, job.plan_epoch, collective=outcome.reason if fresh else "", peer_rank=failure.peer_rank
            )
            if fresh:
                self.table.record(
                    job,
                    COLLECTIVE_EVENT,
                    worker_id=failure.reporter,
                    detail=f"{outcome.reason} ({failure.describe()})",
                    now=now,
                    data=data,
                )
        elif outcome.action == PeerAction.REFUSED and job.recovery.gave_up_at != job.plan_epoch:
            job.recovery.gave_up_at = job.plan_epoch
            self.table.record(
                job, "decision_refuse", worker_id=failure.reporter, detail=outcome.reason, now=now, data=data
            )
        log.info("job=%s collective failure report %s: %s", job.name, outcome.action.value, outcome.reason)
        self.table.save_recovery(job)
        return outcome

    # ---- takeover --------------------------------------------------------------------------------
    def reset(self) -> None:
        """Forgets what a previous leadership term was watching."""
        self._applying.clear()
        self._retry.clear()

    def restore(
        self,
        job: Job,
        epoch: int,
        latest_plan: tuple[int, bytes] | None,
        now: float,
        committed_plan: tuple[int, bytes | None] | None = None,
    ) -> None:
        """Resumes `job` where the previous leader left it, from what the registry holds.

        The layout is the newest stored plan's (the job spec keeps the layout the job was created
        with); the committed layout is that of `committed_plan` (the newest epoch the event log
        shows a commit for, `recovery.committed_epoch_in`; the creation layout without one); ranks
        of the layout whose worker is leaving are planned again (the previous leader may have died
        between storing the loss and publishing its plan); and a plan whose apply had not finished
        is watched again, with the acknowledgements found in the event log.
        """
        job.plan_epoch = epoch
        job.phase = JobPhase.RUNNING if job.completed_unix is None else JobPhase.COMPLETED
        if job.end_phase:
            job.phase = JobPhase(job.end_phase)
        job.pending_changes.clear()
        latest = None
        if latest_plan is not None:
            latest = Plan.from_json(latest_plan[1])
            job.layout_json, job.last_plan = latest.new.to_json(), latest
        if job.phase.terminal:
            return
        job.check_completion = True  # workers may have finished while no Core led
        if latest is not None:
            self._restore_joiners(job, latest, now)
        if committed_plan is not None and committed_plan[0] > 0:
            body = committed_plan[1]
            if body is not None:
                job.committed_layout_json = Plan.from_json(body).new.to_json()
            elif latest is not None and latest.old is not None:
                # Pruned: the newest plan was planned from the committed layout of its time.
                job.committed_layout_json = latest.old.to_json()
            job.committed_epoch = committed_plan[0]
        for member, rank in leaving_ranks(job):
            self.table.record(
                job,
                "replan_after_takeover",
                worker_id=member.worker_id,
                now=now,
                membership_change=True,
                detail=f"rank {rank} is in the layout of epoch {epoch} but its worker is {member.state.value}",
            )
        for spare in ready_spares(job):
            # Its readiness is in its member record, but the change the previous leader had still
            # to plan for was in that leader's memory: without it no plan would take it in.
            self.table.record(
                job,
                SPARE_READY_EVENT,
                worker_id=spare.worker_id,
                now=now,
                membership_change=True,
                detail="ready before the takeover and not taken in yet: planned for again",
            )
        if latest_plan is not None and latest_plan[0] == epoch and apply_unfinished(job, epoch):
            job.acks[epoch] = acks_from_events(job.events, epoch)
            self._applying[job.name] = _Applying(epoch, now, now + self.apply_timeout_s)
            self._enter(
                job, JobPhase.APPLYING, now, f"watching the apply of epoch {epoch} again after a takeover"
            )
