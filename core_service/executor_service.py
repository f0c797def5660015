"""ExecutorService: executors follow their job's plans and acknowledge each phase (executor.proto)."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Protocol

import grpc

from core_service.backup_windows import record_window
from core_service.grpc_util import RpcError, bearer_token, finite, require
from core_service.jobs import token_digest
from core_service.limits import MAX_DETAIL_CHARS, MAX_OPERATION_CHARS
from core_service.model import Ack, AckPhase, PlanFailure
from core_service.persist import registry_call
from core_service.recovery import NO_PEER, CollectiveFailure, PeerAction
from core_service.seams import ServicerCore
from planners.layout import Plan
from planners.reprotect import ReprotectWindow
from wire.v1 import common_pb2, executor_pb2

if TYPE_CHECKING:
    from core_service.engine import ScheduleEngine
    from core_service.jobs import Job
    from core_service.membership import Membership
    from core_service.registry import Registry
    from core_service.registry.plans import PlanStore

PHASES = {
    executor_pb2.PLAN_PHASE_RECEIVED: AckPhase.RECEIVED,
    executor_pb2.PLAN_PHASE_PAUSED: AckPhase.PAUSED,
    executor_pb2.PLAN_PHASE_APPLIED: AckPhase.APPLIED,
    executor_pb2.PLAN_PHASE_RESUMED: AckPhase.RESUMED,
    executor_pb2.PLAN_PHASE_FAILED: AckPhase.FAILED,
}
FAILURES = {
    executor_pb2.PLAN_FAILURE_NOT_APPLICABLE: PlanFailure.NOT_APPLICABLE,
    executor_pb2.PLAN_FAILURE_INTERRUPTED: PlanFailure.INTERRUPTED,
}
MAX_WINDOW_PAIRS = 65536  # BackupWindow.pairs: k copies of every rank's shard


def backup_window_of(request: executor_pb2.AckPlanPhaseRequest) -> ReprotectWindow | None:
    """The re-protection window an APPLIED or REPROTECTED ack carries (core_service.backup_windows),
    checked; None without one. INVALID_ARGUMENT naming what is wrong otherwise."""
    reprotected = request.phase == executor_pb2.PLAN_PHASE_REPROTECTED
    if not request.HasField("backup_window"):
        require(not reprotected, "backup_window is required with PLAN_PHASE_REPROTECTED")
        return None
    require(
        reprotected or request.phase == executor_pb2.PLAN_PHASE_APPLIED,
        "backup_window is only sent with PLAN_PHASE_APPLIED or PLAN_PHASE_REPROTECTED",
    )
    w = request.backup_window
    require(0 < len(w.pairs) <= MAX_WINDOW_PAIRS, f"backup_window needs 1 to {MAX_WINDOW_PAIRS} pairs")
    require(all(p.owner != p.holder for p in w.pairs), "a backup pair's owner and holder must differ")
    require(
        0 <= w.from_step <= w.until_step,
        f"backup_window must run from a step >= 0 to one at or after it, got {w.from_step}..{w.until_step}",
    )
    if reprotected:
        require(w.closed_step >= w.until_step, "closed_step must be the commit of until_step or later")
    else:
        require(w.closed_step == 0, "closed_step is only set with PLAN_PHASE_REPROTECTED")
    pairs = tuple(sorted({(p.owner, p.holder) for p in w.pairs}))
    return ReprotectWindow(
        request.epoch, pairs, w.from_step, w.until_step, w.closed_step if reprotected else None
    )


class ExecutorCore(ServicerCore, Protocol):
    """What the ExecutorService needs of the Core beyond the guards and the job state."""

    engine: ScheduleEngine
    plans: PlanStore
    plan_feed: PlanFeed
    registry: Registry


def plan_message(plan: Plan, plan_json: bytes | None = None) -> common_pb2.Plan:
    """The protobuf of `plan`: `plan_json` is the whole record (what executors decode); the other
    fields repeat parts of it for readers that only show them."""
    return common_pb2.Plan(
        job=plan.job,
        epoch=plan.epoch,
        layout_json=plan.new.to_json().encode(),
        reasons=list(plan.reasons),
        predicted_step_time_s=plan.predicted_step_time_s,
        created_unix=plan.created_unix,
        plan_json=plan.to_json().encode() if plan_json is None else plan_json,
    )


def plan_from_body(job: str, epoch: int, body: bytes) -> common_pb2.Plan:
    """A stored plan (`Plan.to_json()`, stored under `epoch`) as the protobuf executors receive."""
    plan = Plan.from_json(body)
    if plan.epoch != epoch or (plan.job and plan.job != job):
        raise ValueError(f"the plan stored as {job!r} epoch {epoch} names {plan.job!r} epoch {plan.epoch}")
    return plan_message(plan, body)


class PlanFeed:
    """Wakes plan subscribers of a job when a newer epoch is published: every waiter of a job
    waits on the job's current event, and a notify sets it and starts a new one. No lock: a
    subscriber cancelled while it waits (its stream closed) leaves nothing half-held, where
    cancelling `asyncio.wait_for(Condition.wait())` on Python 3.11 could leave the condition's
    lock released under it ('Lock is not acquired' when the `async with` exits, seen in CI)."""

    def __init__(self) -> None:
        self._events: dict[str, asyncio.Event] = {}

    async def notify(self, job: str) -> None:
        event = self._events.pop(job, None)
        if event is not None:
            event.set()

    async def wait(self, job: str, timeout_s: float) -> None:
        """Return at the job's next notify, or after `timeout_s` seconds."""
        event = self._events.setdefault(job, asyncio.Event())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), timeout_s)


class ExecutorServicer:
    def __init__(self, core: ExecutorCore) -> None:
        self.core = core
        self.metrics = core.metrics  # grpc_util.generic_handler times and counts through this

    def _authorise(self, job_name: str, worker_id: str, context: grpc.aio.ServicerContext) -> None:
        """The job's token or the worker's own credential (reading plans)."""
        self.core.require_leader()
        require(bool(job_name), "job is empty")
        require(bool(worker_id), "worker_id is empty")
        token = bearer_token(context)
        if token is not None and self._is_worker(job_name, worker_id, token):
            return
        self.core.check_job_token(job_name, token)

    def _authorise_worker(self, job_name: str, worker_id: str, context: grpc.aio.ServicerContext) -> None:
        """Only the worker itself, with its credential (RegisterAck.worker_token), may ack plans or
        report failures as `worker_id`: the job's token, shared by every worker, is not enough."""
        self.core.require_leader()
        require(bool(job_name), "job is empty")
        require(bool(worker_id), "worker_id is empty")
        token = bearer_token(context)
        if token is None:
            raise RpcError(grpc.StatusCode.UNAUTHENTICATED, "missing 'authorization: Bearer <worker token>'")
        if not self._is_worker(job_name, worker_id, token):
            raise RpcError(
                grpc.StatusCode.PERMISSION_DENIED,
                f"only worker {worker_id!r} of job {job_name!r} itself may do this: present its own "
                "credential (RegisterAck.worker_token), not the job's token or another worker's",
            )

    def _is_worker(self, job_name: str, worker_id: str, token: str) -> bool:
        job = self.core.table.jobs.get(job_name)
        member = None if job is None else job.members.get(worker_id)
        return (
            member is not None
            and bool(member.worker_token_sha256)
            and hmac.compare_digest(token_digest(token), member.worker_token_sha256)
        )

    async def SubscribePlans(
        self, request: executor_pb2.SubscribePlansRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[executor_pb2.SubscribePlansResponse]:
        self._authorise(request.job, request.worker_id, context)
        job = self.core.table.jobs.get(request.job)
        token = bearer_token(context)
        if job is not None and token is not None and self._is_worker(request.job, request.worker_id, token):
            # The spare's own worker, with its own credential, is ready to join: the policy may
            # take it in now (the job token reads plans too, but speaks for no worker).
            self.core.membership.mark_spare_ready(job, request.worker_id, time.time())
        sent = request.after_epoch
        while not context.done():
            latest = await registry_call(self.core.registry, self.core.plans.latest, request.job)
            if latest is not None and latest[0] > sent:
                epoch, body = latest
                sent = epoch
                yield executor_pb2.SubscribePlansResponse(plan=plan_from_body(request.job, epoch, body))
                continue
            if not self.core.leads:
                raise RpcError(grpc.StatusCode.UNAVAILABLE, self.core.not_leader_message())
            await self.core.plan_feed.wait(request.job, timeout_s=1.0)

    async def AckPlanPhase(
        self, request: executor_pb2.AckPlanPhaseRequest, context: grpc.aio.ServicerContext
    ) -> executor_pb2.AckPlanPhaseResponse:
        self._authorise_worker(request.job, request.worker_id, context)
        job = self.core.job_or_not_found(request.job)
        require(request.worker_id in job.members, f"job {job.name!r} has no worker {request.worker_id!r}")
        window = backup_window_of(request)
        if window is not None:
            require(
                request.epoch <= job.plan_epoch,
                f"epoch {request.epoch} was never published (newest is {job.plan_epoch})",
            )
            # Kept for a stale epoch too: it may still be the committed one (_commit_stale).
            record_window(job, request.epoch, window, closed=window.closed_step is not None)
            if window.closed_step is not None:  # REPROTECTED: no phase of the apply
                return executor_pb2.AckPlanPhaseResponse(current_epoch=job.plan_epoch)
        phase = PHASES.get(request.phase)
        require(phase is not None, f"phase {request.phase} is not a known plan phase")
        assert phase is not None
        finite(request.phase_time_s, "phase_time_s")
        require(
            len(request.failure_reason) <= MAX_DETAIL_CHARS,
            f"failure_reason is longer than {MAX_DETAIL_CHARS} characters",
        )
        failure = FAILURES.get(request.failure)
        if phase == AckPhase.FAILED:
            require(bool(request.failure_reason), "failure_reason is required when phase is FAILED")
            require(
                failure is not None,
                "failure (PLAN_FAILURE_NOT_APPLICABLE or PLAN_FAILURE_INTERRUPTED) is required when "
                "phase is FAILED",
            )
        else:
            require(
                request.failure == executor_pb2.PLAN_FAILURE_UNSPECIFIED, "failure is only set with FAILED"
            )
        require(
            request.steps_replayed >= 0 and (request.steps_replayed == 0 or phase == AckPhase.RESUMED),
            "steps_replayed must be >= 0 and given only with RESUMED",
        )
        if request.epoch > job.plan_epoch:
            raise RpcError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"epoch {request.epoch} was never published (newest is {job.plan_epoch})",
            )
        now = time.time()
        if request.epoch < job.plan_epoch:
            if phase == AckPhase.RESUMED and request.epoch > job.committed_epoch:
                # A commit on an older plan still moves the layout executors restart from.
                await self._commit_stale(job, request.epoch, now)
            raise RpcError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"epoch {request.epoch} is stale: the job is at epoch {job.plan_epoch}",
            )
        ack = (
            Ack(phase, failure, request.failure_reason)
            if phase == AckPhase.FAILED
            else Ack(phase, steps_replayed=request.steps_replayed)
        )
        self.core.engine.acknowledge(job, request.worker_id, request.epoch, ack, request.phase_time_s, now)
        return executor_pb2.AckPlanPhaseResponse(current_epoch=job.plan_epoch)

    async def _commit_stale(self, job: Job, epoch: int, now: float) -> None:
        body = await registry_call(self.core.registry, self.core.plans.get, job.name, epoch)
        if body is None:
            return  # pruned: a newer commit will come
        layout_json = Plan.from_json(body).new.to_json()
        if epoch > job.committed_epoch:  # checked again: the registry call yielded the loop
            self.core.engine.commit(job, epoch, layout_json, now)

    async def ReportPeerFailure(
        self, request: executor_pb2.ReportPeerFailureRequest, context: grpc.aio.ServicerContext
    ) -> executor_pb2.ReportPeerFailureResponse:
        self._authorise_worker(request.job, request.worker_id, context)
        require(
            len(request.operation) <= MAX_OPERATION_CHARS,
            f"operation is longer than {MAX_OPERATION_CHARS} characters",
        )
        require(len(request.error) <= MAX_DETAIL_CHARS, f"error is longer than {MAX_DETAIL_CHARS} characters")
        job = self.core.job_or_not_found(request.job)
        require(request.worker_id in job.members, f"job {job.name!r} has no worker {request.worker_id!r}")
        require(
            request.peer_rank >= NO_PEER,
            f"peer_rank must be >= 0, or {NO_PEER} when no peer can be named",
        )
        require(
            request.peer_rank == NO_PEER or any(m.rank == request.peer_rank for m in job.members.values()),
            f"job {job.name!r} has no worker with rank {request.peer_rank}",
        )
        failure = CollectiveFailure(
            request.worker_id, request.peer_rank, request.step, request.operation, request.error
        )
        marked, peer_id = report_collective_failure(
            self.core.engine, self.core.membership, job, failure, time.time()
        )
        return executor_pb2.ReportPeerFailureResponse(peer_marked_lost=marked, peer_worker_id=peer_id)

    async def GetJobStores(
        self, request: executor_pb2.GetJobStoresRequest, context: grpc.aio.ServicerContext
    ) -> executor_pb2.GetJobStoresResponse:
        self._authorise_worker(request.job, request.worker_id, context)
        job = self.core.job_or_not_found(request.job)
        return executor_pb2.GetJobStoresResponse(stores=list(job.stores))


def report_collective_failure(
    engine: ScheduleEngine, membership: Membership, job: Job, failure: CollectiveFailure, now: float
) -> tuple[bool, str]:
    """Answers a collective-failure report (the peer, if named, exists): a replay plan while the
    peer looks alive, the "collective_failure" detection path once it looks dead or keeps failing
    (`core_service.recovery`). Returns (peer marked lost, the peer's worker id or "")."""
    outcome = engine.collective_failure(job, failure, now)
    peer_id = "" if outcome.peer is None else outcome.peer.worker_id
    if outcome.action != PeerAction.MARK_LOST or outcome.peer is None:
        return False, peer_id
    marked = membership.mark_lost(job, peer_id, outcome.reason, "collective_failure", now)
    return marked, peer_id
