"""SchedulerService: what a cluster scheduler may ask and tell the Core (scheduler.proto)."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import grpc

from core_service.executor_service import plan_message
from core_service.grpc_util import RpcError, bearer_token, finite, invalid, require
from core_service.job_end import JobEndCore, end_job
from core_service.job_snapshot import snapshot_of
from core_service.jobs import Job
from core_service.limits import MAX_DEVICES, MAX_HOST_CHARS, MAX_IDS_PER_REQUEST, MAX_REASON_CHARS
from core_service.model import MemberRecord, WorkerState
from core_service.offload import PlanningFailed, PlanningTimeout
from core_service.policies import (
    DEFAULT_RECLAIM_RATE_PER_S,
    RECONFIGURATION_OVERHEAD_S,
    judge_offer,
    scale_table,
)
from core_service.recovery import RESTORE, choose_mode
from planners.chameleon.schema import state_from_dict
from planners.flextrain import build_scale_table, choose_scale_up, predict_configs
from planners.layout import Layout, Plan, PlanMode, make_uniform_layout
from wire.v1 import agent_pb2, common_pb2, scheduler_pb2

if TYPE_CHECKING:
    from core_service.job_snapshot import Policy
    from core_service.offload import PlanningWorker

MAX_DEADLINE_AHEAD_S = 7 * 24 * 3600.0
T = TypeVar("T")


class SchedulerCore(JobEndCore, Protocol):
    """What the SchedulerService needs of the Core beyond the guards, the job state and the engine."""

    planning: PlanningWorker
    policy: Policy


def planning_copy(job: Job) -> Job:
    """What a planner call needs of `job` (name, model, layouts), without its members and events:
    it is pickled to the planning process."""
    return dataclasses.replace(
        job, members={}, events=type(job.events)(maxlen=1), pending_changes=[], acks={}
    )


def check_devices(devices: int, name: str) -> None:
    require(1 <= devices <= MAX_DEVICES, f"{name} must be >= 1 and <= {MAX_DEVICES}")


def check_ids(ids: Any, name: str) -> None:
    require(len(ids) <= MAX_IDS_PER_REQUEST, f"{name} has {len(ids)} entries; at most {MAX_IDS_PER_REQUEST}")


def member_message(member: MemberRecord) -> common_pb2.Member:
    step = member.last_step
    return common_pb2.Member(
        worker_id=member.worker_id,
        host=member.host,
        pid=member.pid,
        devices=[
            common_pb2.Device(kind=d.kind, index=d.index, name=d.name, memory_bytes=d.memory_bytes)
            for d in member.devices
        ],
        state=common_pb2.WorkerState.Value(f"WORKER_STATE_{member.state.value}"),
        lost_reason=member.lost_reason,
        state_reason=member.state_reason,
        last_heartbeat_unix=member.last_heartbeat_unix,
        last_step=step.step if step else -1,
        last_step_time_s=step.step_time_s if step else 0.0,
        stage=member.stage,
        dp_rank=member.dp_rank,
        rank=member.rank,
    )


def what_if_plan(
    job: Job, new: Layout | None, reasons: tuple[str, ...], predicted_s: float, policy: str, now: float
) -> common_pb2.Plan:
    """The plan the engine would publish (epoch 0: nothing is stored), with the mode the Core's
    rules give it from the committed layout (`core_service.recovery.choose_mode`)."""
    if new is None:  # refused: no layout to show
        return common_pb2.Plan(
            job=job.name, epoch=0, reasons=list(reasons), predicted_step_time_s=predicted_s, created_unix=now
        )
    committed = None if job.committed_layout_json is None else Layout.from_json(job.committed_layout_json)
    why: tuple[str, ...]
    if committed is None:
        mode, why = PlanMode.RESTORE, (f"{RESTORE}: the job has no committed layout to change in place",)
    else:
        mode, why = choose_mode(job, committed, new, None)
    plan = Plan(
        epoch=0,
        old=committed,
        new=new,
        reasons=(*reasons, *why),
        predicted_step_time_s=predicted_s,
        job=job.name,
        policy=policy,
        mode=mode,
        created_unix=now,
    )
    return plan_message(plan)


def offer_room(job: Job) -> int:
    """Workers an accepted offer may still admit under `max_workers` (unbounded without it): the
    layout's ranks and the waiting spares count against it."""
    if not job.max_workers:
        return MAX_DEVICES
    parsed = job.parsed_layout()
    ranks = len(parsed.ranks) if parsed is not None else 0
    spares = sum(1 for m in job.members.values() if m.state is WorkerState.SPARE)
    return max(0, job.max_workers - ranks - spares)


def offer_refusal(job: Job, hosts: list[str] | None = None) -> str:
    """Why an offer (of devices on `hosts`; "" for an offer naming none) is refused before
    FlexTrain's test is asked ("" when it is not): a terminal job, a full one, or a host that
    still has devices an earlier accepted offer admitted and no worker has used."""
    if job.phase.terminal:
        return f"job {job.name!r} is {job.phase.value}: it needs no more devices"
    if offer_room(job) <= 0:
        return f"job {job.name!r} is at its max_workers {job.max_workers}: no plan may add a rank"
    for host in hosts or []:
        waiting = job.offered_hosts.get(host, 0)
        if waiting:
            where = f"host {host!r}" if host else "offers naming no host"
            return (
                f"{where} already has {waiting} offered device(s) that no worker has registered from "
                "yet: another offer for it is refused until those are used"
            )
    return ""


class SchedulerServicer:
    def __init__(self, core: SchedulerCore) -> None:
        self.core = core
        self.metrics = core.metrics  # grpc_util.generic_handler times and counts through this

    def _authorise(self, context: grpc.aio.ServicerContext) -> None:
        self.core.require_leader()
        self.core.check_scheduler_token(bearer_token(context))

    async def _plan(self, context: grpc.aio.ServicerContext, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` in the planning process with the client's deadline (capped); a deadline
        that passes, or a client that goes away, stops the work (core_service.offload)."""
        remaining = context.time_remaining()
        try:
            return await self.core.planning.call(fn, *args, timeout_s=remaining)
        except PlanningTimeout as exc:
            raise RpcError(grpc.StatusCode.DEADLINE_EXCEEDED, str(exc)) from None
        except PlanningFailed as exc:
            if exc.code is not None:
                raise RpcError(grpc.StatusCode[exc.code], exc.message) from None
            if exc.kind in ("ValueError", "KeyError", "TypeError"):
                raise RpcError(grpc.StatusCode.FAILED_PRECONDITION, exc.message) from None
            raise RpcError(grpc.StatusCode.INTERNAL, f"planning failed: {exc.kind}: {exc.message}") from None

    def _deadline(self, deadline_unix: float, now: float) -> None:
        finite(deadline_unix, "deadline_unix")
        require(deadline_unix > now, f"deadline_unix is not in the future (the Core's clock reads {now:.3f})")
        require(deadline_unix <= now + MAX_DEADLINE_AHEAD_S, "deadline_unix is more than 7 days ahead")

    async def SignalPreemption(
        self, request: scheduler_pb2.SignalPreemptionRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.SignalPreemptionResponse:
        self._authorise(context)
        return await self.preempt(request)

    async def preempt(
        self, request: scheduler_pb2.SignalPreemptionRequest
    ) -> scheduler_pb2.SignalPreemptionResponse:
        """Marks the workers PREEMPTING and tells their agents to drain (caller is authorised)."""
        now = time.time()
        job = self.core.job_or_not_found(request.job)
        require(len(request.worker_ids) > 0, "worker_ids is empty")
        check_ids(request.worker_ids, "worker_ids")
        require(
            len(request.reason) <= MAX_REASON_CHARS, f"reason is longer than {MAX_REASON_CHARS} characters"
        )
        require(len(set(request.worker_ids)) == len(request.worker_ids), "worker_ids has duplicates")
        self._deadline(request.deadline_unix, now)
        members = []
        for worker_id in request.worker_ids:
            member = job.members.get(worker_id)
            if member is None:
                raise RpcError(grpc.StatusCode.NOT_FOUND, f"job {job.name!r} has no worker {worker_id!r}")
            require(not member.state.is_gone, f"worker {worker_id!r} is already {member.state.value}")
            members.append(member)
        survivors = [
            m
            for m in job.live_members()
            if m.worker_id not in set(request.worker_ids) and m.state is not WorkerState.SPARE
        ]
        if not survivors:
            raise RpcError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"preempting {len(members)} worker(s) would leave job {job.name!r} with no worker",
            )
        source = f"scheduler: {request.reason}" if request.reason else "scheduler"
        for member in members:
            self.core.membership.preemption(job, member, request.deadline_unix, source, now)
            drain = agent_pb2.Drain(reason=source, deadline_unix=request.deadline_unix)
            self.core.membership.send(job.name, member.worker_id, agent_pb2.ConnectResponse(drain=drain))
        event_seq = job.next_seq - 1
        await self.core.wait_durable()  # answer only once the preemption is stored
        return scheduler_pb2.SignalPreemptionResponse(event_seq=event_seq)

    async def OfferResources(
        self, request: scheduler_pb2.OfferResourcesRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.OfferResourcesResponse:
        self._authorise(context)
        job = self.core.job_or_not_found(request.job)
        check_devices(request.devices, "devices")
        check_ids(request.hosts, "hosts")
        require(
            all(0 < len(h) <= MAX_HOST_CHARS for h in request.hosts), "hosts must be 1-255 characters each"
        )
        finite(request.expected_duration_s, "expected_duration_s")
        hosts = sorted(set(request.hosts)) or [""]
        refusal = offer_refusal(job, hosts)
        usable = 0
        if refusal:
            accepted, reason = False, refusal
        else:
            accepted, reason, usable = await self._plan(
                context, judge_offer, planning_copy(job), request.devices, request.expected_duration_s
            )
            job = self.core.job_or_not_found(request.job)  # the loop turned: it may be gone
            refusal = offer_refusal(job, hosts)  # ... or have completed, or filled up
            if refusal:
                accepted, reason = False, refusal
        admitted = min(usable, offer_room(job)) if accepted else 0
        if accepted:
            # The devices' workers register as spares (rank -1); the engine plans them in.
            job.offered_workers += admitted
            for i, host in enumerate(hosts):  # outstanding per host until its workers register
                share = admitted // len(hosts) + (1 if i < admitted % len(hosts) else 0)
                if share:
                    job.offered_hosts[host] = job.offered_hosts.get(host, 0) + share
            self.core.table.save_spec(job)
            if admitted < request.devices:
                reason += f"; {admitted} of the {request.devices} devices admitted" + (
                    f" (max_workers {job.max_workers})"
                    if admitted < usable
                    else " (what that configuration uses)"
                )
        event = self.core.table.record(
            job,
            "resources_offered",
            detail=f"{request.devices} device(s) on {list(request.hosts)}: {reason}",
            now=time.time(),
            data={
                "accepted": accepted,
                "devices": request.devices,
                "admitted_workers": admitted,
                "reason": reason,
            },
        )
        await self.core.wait_durable()  # answer only once the offer's event (and admission) is stored
        return scheduler_pb2.OfferResourcesResponse(
            accepted=accepted, reason=reason, event_seq=event.seq, admitted_workers=admitted
        )

    async def ReclaimResources(
        self, request: scheduler_pb2.ReclaimResourcesRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.ReclaimResourcesResponse:
        self._authorise(context)
        now = time.time()
        job = self.core.job_or_not_found(request.job)
        check_devices(request.devices, "devices")
        self._deadline(request.deadline_unix, now)
        live = job.live_members()
        if request.devices >= len(live):
            raise RpcError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"reclaiming {request.devices} device(s) would leave job {job.name!r} with no worker "
                f"({len(live)} live)",
            )
        # Spares go first (they train nothing), then slow workers (they cost the most), then the
        # highest (stage, dp rank) to keep the lower stages intact.
        order = sorted(
            live,
            key=lambda m: (
                m.state != WorkerState.SPARE,
                m.state != WorkerState.SLOW,
                -m.stage,
                -m.dp_rank,
                m.worker_id,
            ),
        )
        chosen = [m.worker_id for m in order[: request.devices]]
        for worker_id in chosen:
            member = job.members[worker_id]
            self.core.membership.preemption(job, member, request.deadline_unix, "scheduler reclaim", now)
            drain = agent_pb2.Drain(reason="reclaimed by scheduler", deadline_unix=request.deadline_unix)
            self.core.membership.send(job.name, worker_id, agent_pb2.ConnectResponse(drain=drain))
        event_seq = job.next_seq - 1
        await self.core.wait_durable()  # answer only once the reclaim is stored
        return scheduler_pb2.ReclaimResourcesResponse(worker_ids=chosen, event_seq=event_seq)

    async def GetJobState(
        self, request: scheduler_pb2.GetJobStateRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.GetJobStateResponse:
        # A read: open or token-protected by `read_access`, the same policy as the REST reads.
        self.core.require_leader()
        self.core.check_read_access(bearer_token(context))
        job = self.core.job_or_not_found(request.job)
        return scheduler_pb2.GetJobStateResponse(
            job=job.name,
            phase=common_pb2.JobPhase.Value(f"JOB_PHASE_{job.phase.value}"),
            members=[member_message(m) for m in sorted(job.members.values(), key=lambda m: m.worker_id)],
            plan_epoch=job.plan_epoch,
            last_event_seq=job.next_seq - 1,
            final_checkpoint=job.final_checkpoint,
            end_reason=job.end_reason,
            latest_checkpoint=job.latest_checkpoint,
        )

    async def EndJob(
        self, request: scheduler_pb2.EndJobRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.EndJobResponse:
        """The twin of REST DELETE /api/v1/jobs/{job} (core_service.job_end)."""
        self._authorise(context)
        require(
            len(request.reason) <= MAX_REASON_CHARS, f"reason must be at most {MAX_REASON_CHARS} characters"
        )
        ended = end_job(self.core, request.job, request.reason, time.time())
        await self.core.wait_durable()  # answer only once the end is stored
        return scheduler_pb2.EndJobResponse(
            phase=common_pb2.JobPhase.Value(f"JOB_PHASE_{ended.phase.value}"),
            event_seq=ended.event_seq,
            stopping_worker_ids=list(ended.stopping),
        )

    async def GetScaleTable(
        self, request: scheduler_pb2.GetScaleTableRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.GetScaleTableResponse:
        self._authorise(context)
        job = self.core.job_or_not_found(request.job)
        rows = await self._plan(context, scale_table, planning_copy(job))
        return scheduler_pb2.GetScaleTableResponse(rows=[scheduler_pb2.ScaleTableRow(**row) for row in rows])

    async def PlanWhatIf(
        self, request: scheduler_pb2.PlanWhatIfRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.PlanWhatIfResponse:
        self._authorise(context)
        job = self.core.job_or_not_found(request.job)
        check_ids(request.remove_worker_ids, "remove_worker_ids")
        if request.add_devices:
            check_devices(request.add_devices, "add_devices")
            require(
                not request.remove_worker_ids,
                "add_devices and remove_worker_ids together are not modelled: ask one what-if at a time",
            )
            # Seconds of planner work for a large model: off the event loop, heartbeats keep flowing.
            return await self._plan(
                context, scale_up_what_if, planning_copy(job), request.add_devices, time.time()
            )
        snapshot = snapshot_of(job)
        live_ids = {w.worker_id for w in snapshot.live}
        for worker_id in request.remove_worker_ids:
            require(worker_id in live_ids, f"worker {worker_id!r} is not a live member of {job.name!r}")
        removed = set(request.remove_worker_ids)
        gone = snapshot.gone + tuple(
            dataclasses.replace(w, state="LOST") for w in snapshot.live if w.worker_id in removed
        )
        # Everything else (the registered model, step times) as the real plan would see it.
        hypothetical = dataclasses.replace(
            snapshot,
            live=tuple(w for w in snapshot.live if w.worker_id not in removed),
            gone=gone,
            changes=tuple(f"what_if_lost:{w}" for w in sorted(removed)),
        )
        if not hypothetical.live:
            return scheduler_pb2.PlanWhatIfResponse(runnable=False, reason="no worker would be left")
        decision = await self._plan(context, self.core.policy.decide, hypothetical)
        runnable = decision.action != "refuse"
        plan = what_if_plan(
            job,
            decision.layout,
            decision.reasons or (decision.reason,),
            decision.predicted_step_time_s,
            decision.policy,
            time.time(),
        )
        return scheduler_pb2.PlanWhatIfResponse(plan=plan, runnable=runnable, reason=decision.reason)


def scale_up_what_if(job: Job, add_devices: int, now: float) -> scheduler_pb2.PlanWhatIfResponse:
    """What adding `add_devices` would do to a job registered with a model: FlexTrain's best
    scale-table entry within current + added devices (FlexTrain §4.4), runnable when it pays for
    its reconfiguration (eq. 16) - the same table, cap and rule as OfferResources (policies.judge_offer)
    with an offer of unknown duration. Jobs without a model have no scale table, so adding devices
    is refused rather than answered with a guess."""
    if job.model_json is None:
        raise invalid(
            f"adding devices is not modelled for job {job.name!r}: it was registered without a model "
            "(the `elaswave plan` state.json), so it has no scale table"
        )
    request = json.loads(job.model_json)
    state = state_from_dict(request)[0]
    current, shape = state.shape.num_devices, state.shape
    max_devices = int(request.get("max_devices", current + add_devices))
    predictions = predict_configs(state, max_devices // shape.tp)
    table = build_scale_table(predictions)
    _, decision = choose_scale_up(
        table, current, add_devices, max_devices, RECONFIGURATION_OVERHEAD_S, DEFAULT_RECLAIM_RATE_PER_S
    )
    target = table.best_within(min(current + add_devices, max_devices))
    now_entry = table.best_within(current)
    if target is None or now_entry is None or target.gpus <= now_entry.gpus:
        return scheduler_pb2.PlanWhatIfResponse(
            runnable=False, reason=f"adding {add_devices} device(s): {decision.reason}"
        )
    step_s = next(
        p.profiled_step_s for p in predictions if (p.gpus, p.dp, p.pp) == (target.gpus, target.dp, target.pp)
    )
    layout = make_uniform_layout(
        state.profile.num_layers,
        target.pp,
        target.dp,
        shape.global_batch,
        shape.global_batch // (target.dp * shape.micro_batch),
    )
    summary = (
        f"with {add_devices} more device(s): {target.gpus} devices as DP={target.dp}, PP={target.pp}, "
        f"TP={shape.tp} (from {current}), predicted step {step_s:.3f} s"
    )
    plan = what_if_plan(job, layout, (summary, decision.reason), step_s, "flextrain", now)
    return scheduler_pb2.PlanWhatIfResponse(
        plan=plan, runnable=decision.scale_up, reason=f"{summary}; {decision.reason}"
    )
