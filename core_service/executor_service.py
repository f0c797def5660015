"""ExecutorService: executors follow their job's plans and acknowledge each phase (executor.proto)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import grpc

from core_service.grpc_util import RpcError, bearer_token, finite, require
from core_service.persist import registry_call
from elaswave.v1 import common_pb2, executor_pb2

if TYPE_CHECKING:
    from core_service.core import Core

PHASE_NAMES = {
    executor_pb2.PLAN_PHASE_RECEIVED: "RECEIVED",
    executor_pb2.PLAN_PHASE_PAUSED: "PAUSED",
    executor_pb2.PLAN_PHASE_APPLIED: "APPLIED",
    executor_pb2.PLAN_PHASE_RESUMED: "RESUMED",
    executor_pb2.PLAN_PHASE_FAILED: "FAILED",
}


def plan_from_body(job: str, epoch: int, body: bytes) -> common_pb2.Plan:
    data = json.loads(body)
    return common_pb2.Plan(
        job=job,
        epoch=epoch,
        layout_json=data["layout_json"].encode(),
        reasons=data["reasons"],
        predicted_step_time_s=data["predicted_step_time_s"],
        created_unix=data["created_unix"],
    )


class PlanFeed:
    """Wakes plan subscribers of a job when a newer epoch is published."""

    def __init__(self) -> None:
        self._conditions: dict[str, asyncio.Condition] = {}

    def _condition(self, job: str) -> asyncio.Condition:
        return self._conditions.setdefault(job, asyncio.Condition())

    async def notify(self, job: str) -> None:
        condition = self._condition(job)
        async with condition:
            condition.notify_all()

    async def wait(self, job: str, timeout_s: float) -> None:
        condition = self._condition(job)
        async with condition:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(condition.wait(), timeout_s)


class ExecutorServicer:
    def __init__(self, core: Core) -> None:
        self.core = core
        self.metrics = core.metrics  # grpc_util.generic_handler times and counts through this

    def _authorise(self, job_name: str, worker_id: str, context: grpc.aio.ServicerContext) -> None:
        self.core.require_leader()
        require(bool(job_name), "job is empty")
        require(bool(worker_id), "worker_id is empty")
        self.core.check_job_token(job_name, bearer_token(context))

    async def SubscribePlans(
        self, request: executor_pb2.SubscribePlansRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[executor_pb2.SubscribePlansResponse]:
        self._authorise(request.job, request.worker_id, context)
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
        self._authorise(request.job, request.worker_id, context)
        job = self.core.job_or_not_found(request.job)
        require(request.worker_id in job.members, f"job {job.name!r} has no worker {request.worker_id!r}")
        phase = PHASE_NAMES.get(request.phase)
        require(phase is not None, f"phase {request.phase} is not a known plan phase")
        finite(request.phase_time_s, "phase_time_s")
        if phase == "FAILED":
            require(bool(request.failure_reason), "failure_reason is required when phase is FAILED")
        if request.epoch > job.plan_epoch:
            raise RpcError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"epoch {request.epoch} was never published (newest is {job.plan_epoch})",
            )
        if request.epoch < job.plan_epoch:
            raise RpcError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"epoch {request.epoch} is stale: the job is at epoch {job.plan_epoch}",
            )
        recorded = f"FAILED: {request.failure_reason}" if phase == "FAILED" else phase
        job.acks.setdefault(request.epoch, {})[request.worker_id] = recorded
        self.core.table.record(
            job,
            f"plan_{phase.lower()}",
            worker_id=request.worker_id,
            detail=f"epoch {request.epoch} in {request.phase_time_s:.3f}s"
            + (f": {request.failure_reason}" if phase == "FAILED" else ""),
            now=time.time(),
            data={"epoch": request.epoch, "phase_time_s": request.phase_time_s},
        )
        return executor_pb2.AckPlanPhaseResponse(current_epoch=job.plan_epoch)

    async def ReportPeerFailure(
        self, request: executor_pb2.ReportPeerFailureRequest, context: grpc.aio.ServicerContext
    ) -> executor_pb2.ReportPeerFailureResponse:
        self._authorise(request.job, request.worker_id, context)
        job = self.core.job_or_not_found(request.job)
        require(request.worker_id in job.members, f"job {job.name!r} has no worker {request.worker_id!r}")
        require(request.peer_rank >= 0, f"peer_rank must be >= 0, got {request.peer_rank}")
        peer = next(
            (m for m in job.members.values() if m.rank == request.peer_rank and not m.state.is_gone), None
        )
        if peer is None:
            peer = next((m for m in job.members.values() if m.rank == request.peer_rank), None)
            require(peer is not None, f"job {job.name!r} has no worker with rank {request.peer_rank}")
            return executor_pb2.ReportPeerFailureResponse(
                peer_marked_lost=False, peer_worker_id=peer.worker_id
            )
        if not job.in_layout(peer):
            # The plan in force already removed it (a preempted rank on its way out): its closed
            # connections are expected, not a failure.
            return executor_pb2.ReportPeerFailureResponse(
                peer_marked_lost=False, peer_worker_id=peer.worker_id
            )
        reason = (
            f"collective {request.operation or 'operation'} failed on {request.worker_id} at step "
            f"{request.step}: {request.error or 'peer unreachable'}"
        )
        marked = self.core.membership.mark_lost(
            job, peer.worker_id, reason, "collective_failure", time.time()
        )
        return executor_pb2.ReportPeerFailureResponse(peer_marked_lost=marked, peer_worker_id=peer.worker_id)
