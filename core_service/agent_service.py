"""AgentService: one bidirectional stream per agent (agent.proto), and the REST route that sends
an agent a command (SetFrequency, Drain, ReportNow) on that stream.

A report that fails validation after registration is refused on its own: the agent gets a
ReportRejected on the stream, the refusal is counted, and neither the stream nor the member
changes. Closing the stream would read as a fail-stop and re-plan the job for nothing.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time
from typing import Annotated, Any, Literal

import grpc
from fastapi import APIRouter, HTTPException, Path
from fastapi.params import Depends
from pydantic import BaseModel, ConfigDict, Field, model_validator

from core_service.agent_session import AgentSession, Registration
from core_service.grpc_util import (
    HTTP_STATUS,
    Malformed,
    RpcError,
    bearer_token,
    finite,
    invalid,
    metadata_value,
    require,
)
from core_service.http_guard import JobName, error_responses, field_error
from core_service.jobs import UnknownJob
from core_service.limits import MAX_DETAIL_CHARS, MAX_HOST_CHARS, MAX_OPERATION_CHARS, MAX_REASON_CHARS
from core_service.membership import WORKER_TOKEN_METADATA
from core_service.model import DeviceInfo, StepReport, WorkerState
from core_service.node_stream import NodeStream
from core_service.seams import ServicerCore
from wire.local_protocol import EXIT_CODE_UNKNOWN
from wire.v1 import agent_pb2

log = logging.getLogger("elaswave.core.agents")

WORKER_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}$")
FIRST_MESSAGE_TIMEOUT_S = 10.0
MAX_DEADLINE_AHEAD_S = 7 * 24 * 3600.0
# Refusal notices queued for one stream at most: an agent that floods bad reports and does not
# read its stream must not grow the Core's memory. Refusals beyond it are still counted.
MAX_QUEUED_NOTICES = 100
# Device clocks are below 4 GHz; a bound of 10 GHz catches values sent in Hz or kHz.
MAX_FREQUENCY_MHZ = 10_000
MAX_DEVICES_PER_WORKER = 1_024
DEFAULT_DRAIN_S = 60.0


def _registration(msg: agent_pb2.Register, heartbeat_timeout_s: float) -> Registration:
    require(bool(msg.job), "register.job is empty")
    require(
        bool(WORKER_ID_PATTERN.match(msg.worker_id)),
        f"register.worker_id {msg.worker_id!r} must be 1-128 characters of letters, digits, '._:@-'",
    )
    require(
        bool(msg.host) and len(msg.host) <= MAX_HOST_CHARS and msg.host.isprintable(),
        f"register.host must be 1-{MAX_HOST_CHARS} printable characters (no newline or control character)",
    )
    require(
        len(msg.devices) <= MAX_DEVICES_PER_WORKER, f"register has more than {MAX_DEVICES_PER_WORKER} devices"
    )
    require(msg.pid >= 0, "register.pid must be >= 0")
    require(
        msg.stage >= -1 and msg.dp_rank >= -1 and msg.rank >= -1,
        "register.stage, dp_rank and rank must be >= -1",
    )
    require(msg.heartbeat_interval_ms <= 60_000, "register.heartbeat_interval_ms must be <= 60000")
    timeout_ms = heartbeat_timeout_s * 1000
    # 0 means the agent did not say; any declared interval must fit inside the timeout, or the
    # worker is declared lost between two heartbeats and flaps.
    require(
        msg.heartbeat_interval_ms < timeout_ms,
        f"register.heartbeat_interval_ms is {msg.heartbeat_interval_ms} ms, not below the Core's heartbeat "
        f"timeout of {timeout_ms:.0f} ms: the worker would be declared lost between heartbeats; send "
        "heartbeats more often (or raise the Core's heartbeat_timeout_s)",
    )
    devices = []
    for d in msg.devices:
        require(d.kind in ("cuda", "npu", "cpu"), f"device kind {d.kind!r} is not cuda, npu or cpu")
        require(d.index >= 0, "device index must be >= 0")
        require(
            len(d.name) <= MAX_HOST_CHARS and d.name.isprintable(),
            "device name must be <= 255 printable characters",
        )
        devices.append(DeviceInfo(d.kind, d.index, d.name, d.memory_bytes))
    return Registration(
        msg.job,
        msg.worker_id,
        msg.host,
        msg.pid,
        devices,
        msg.stage,
        msg.dp_rank,
        msg.rank,
        msg.holds_own_lease,
    )


def _step_report(msg: agent_pb2.StepMetrics, now: float) -> StepReport:
    require(msg.step >= 0, "step.step must be >= 0")
    finite(msg.step_time_s, "step.step_time_s")
    finite(msg.compute_time_s, "step.compute_time_s")
    require(msg.stage >= -1 and msg.dp_rank >= -1, "step.stage and step.dp_rank must be >= -1")
    loss = None if math.isnan(msg.loss) else msg.loss
    if loss is not None:
        finite(loss, "step.loss", minimum=float("-inf"))
    require(
        len(msg.checkpoint) <= MAX_DETAIL_CHARS,
        f"step.checkpoint is longer than {MAX_DETAIL_CHARS} characters",
    )
    return StepReport(
        msg.step,
        msg.step_time_s,
        msg.compute_time_s,
        loss,
        msg.samples,
        msg.stage,
        msg.dp_rank,
        now,
        msg.checkpoint,
    )


class AgentServicer:
    def __init__(self, core: ServicerCore) -> None:
        self.core = core
        self.metrics = core.metrics  # grpc_util.generic_handler times and counts through this
        self._report_counters: dict[str, Any] = {}

    async def Connect(self, request_iterator: object, context: grpc.aio.ServicerContext) -> None:
        try:
            self.core.require_leader()
            session = await self._open(context)
        except RpcError as err:
            self.core.metrics.rejected_requests.labels(api="agent", reason=err.code.name).inc()
            await context.abort(err.code, err.message)
            return
        clean = False
        session.handler = asyncio.current_task()
        writer = asyncio.ensure_future(self._pump_commands(session, context))
        try:
            clean = await self._read_reports(session, context)
        except RpcError as err:
            self.core.metrics.rejected_requests.labels(api="agent", reason=err.code.name).inc()
            clean = False
            await context.abort(err.code, err.message)
        finally:
            writer.cancel()
            # Runs even when the handler is cancelled because the peer vanished.
            asyncio.ensure_future(self.core.membership.close_session(session, time.time(), clean=clean))

    async def _open(self, context: grpc.aio.ServicerContext) -> AgentSession:
        try:
            first = await asyncio.wait_for(context.read(), FIRST_MESSAGE_TIMEOUT_S)
        except TimeoutError:
            raise invalid(f"no register message within {FIRST_MESSAGE_TIMEOUT_S:.0f}s") from None
        if first is grpc.aio.EOF:
            raise invalid("stream closed before a register message")
        if isinstance(first, Malformed):
            raise invalid(first.message)
        session, ack = await self.accept(
            first, bearer_token(context), metadata_value(context, WORKER_TOKEN_METADATA)
        )
        await context.write(ack)
        return session

    async def accept(
        self, first: agent_pb2.ConnectRequest, job_token: str | None, worker_token: str | None
    ) -> tuple[AgentSession, agent_pb2.ConnectResponse]:
        """Registers the agent whose stream opened with `first` (Connect, or a ConnectNode
        channel: core_service.node_stream) under its own credentials; returns its RegisterAck."""
        if first.WhichOneof("body") != "register":
            raise invalid(f"first message must be register, got {first.WhichOneof('body')}")
        self.core.check_job_token(first.register.job, job_token)
        reg = _registration(first.register, self.core.settings.heartbeat_timeout_s)
        session = await self.core.membership.register(reg, time.time(), worker_token)
        ack = agent_pb2.RegisterAck(
            session=session.session_id,
            heartbeat_timeout_ms=int(self.core.settings.heartbeat_timeout_s * 1000),
            core_id=self.core.settings.core_id,
            worker_token=session.worker_token,
        )
        return session, agent_pb2.ConnectResponse(ack=ack)

    async def ConnectNode(self, request_iterator: object, context: grpc.aio.ServicerContext) -> None:
        """Many agents' Connect streams over one stream from their node's multiplexer."""
        await NodeStream(self, context).serve()

    async def _pump_commands(self, session: AgentSession, context: grpc.aio.ServicerContext) -> None:
        while True:
            command = await session.outbox.get()
            await context.write(command)

    async def _read_reports(self, session: AgentSession, context: grpc.aio.ServicerContext) -> bool:
        """Handles reports until the stream ends; True when the agent left cleanly."""
        while True:
            msg = await context.read()
            if msg is grpc.aio.EOF:
                return False
            if await self.dispatch(session, msg):
                return True

    async def dispatch(self, session: AgentSession, msg: object) -> bool:
        if isinstance(msg, Malformed):
            self._reject(session, "malformed", msg.message)
            return False
        assert isinstance(msg, agent_pb2.ConnectRequest)
        started = time.perf_counter()
        kind = msg.WhichOneof("body")
        self._report_counter(kind or "empty").inc()
        if kind == "leave":
            await self.core.membership.leave(
                session,
                msg.leave.reason[:MAX_REASON_CHARS],
                time.time(),
                finished=msg.leave.finished,
                checkpoint=msg.leave.checkpoint[:MAX_DETAIL_CHARS],  # a path or URL: bounded like a detail
            )
            # The agent takes the stream's clean close as "Leave delivered" and never sends it
            # again: close it only once the departure is stored (else UNAVAILABLE, and it retries).
            await self.core.wait_durable()
            return True
        try:
            await self._handle(session, kind, msg)
        except RpcError as err:
            if err.code != grpc.StatusCode.INVALID_ARGUMENT:
                raise  # the job is gone or similar: the stream cannot go on
            self._reject(session, kind or "empty", err.message)
            return False
        self.core.metrics.report_seconds.observe(time.perf_counter() - started)
        return False

    def _report_counter(self, kind: str) -> Any:
        """The counter child of one report kind (a label lookup per report costs more than the
        increment itself at 10,000 reports/s)."""
        counter = self._report_counters.get(kind)
        if counter is None:
            counter = self._report_counters[kind] = self.core.metrics.agent_reports.labels(kind=kind)
        return counter

    def _reject(self, session: AgentSession, report: str, reason: str) -> None:
        """Refuses one report; _handle validates before it changes anything, so nothing changed."""
        session.rejected_reports += 1
        self.core.metrics.rejected_requests.labels(api="agent", reason=f"invalid_report_{report}").inc()
        # Log the 1st, 2nd, 4th, 8th... refusal of a stream: visible, but a flood cannot flood the log.
        if session.rejected_reports & (session.rejected_reports - 1) == 0:
            log.warning(
                "job %s worker %s: refused %s report (%d so far on this stream): %s",
                session.job,
                session.worker_id,
                report,
                session.rejected_reports,
                reason,
            )
        if session.outbox.qsize() < MAX_QUEUED_NOTICES:
            notice = agent_pb2.ReportRejected(report=report, reason=reason)
            session.outbox.put_nowait(agent_pb2.ConnectResponse(rejected=notice))

    async def _handle(self, session: AgentSession, kind: str | None, msg: agent_pb2.ConnectRequest) -> None:
        core, now = self.core, time.time()
        try:
            job = core.table.get(session.job)
        except UnknownJob as exc:
            raise RpcError(grpc.StatusCode.NOT_FOUND, str(exc)) from None
        if kind == "heartbeat":  # nine reports in ten: the fast path
            await core.membership.heartbeat(session, now, job)
            if msg.heartbeat.echo:
                # The agent checks that this Core still answers (a hung loop would not).
                echo = agent_pb2.HeartbeatEcho(seq=msg.heartbeat.seq)
                session.outbox.put_nowait(agent_pb2.ConnectResponse(echo=echo))
            return
        member = job.member(session.worker_id)
        if kind == "step":
            core.membership.step(session, _step_report(msg.step, now))
        elif kind == "memory":
            m = msg.memory
            require(0.0 <= m.cpu_percent <= 100.0 * 1024, f"memory.cpu_percent out of range: {m.cpu_percent}")
            member.memory = {
                "host_used_bytes": m.host_used_bytes,
                "host_total_bytes": m.host_total_bytes,
                "worker_rss_bytes": m.worker_rss_bytes,
                "device_used_bytes": list(m.device_used_bytes),
                "device_total_bytes": list(m.device_total_bytes),
                "cpu_percent": m.cpu_percent,
            }
        elif kind == "probe":
            require(
                len(msg.probe.detail) <= MAX_DETAIL_CHARS,
                f"probe.detail is over {MAX_DETAIL_CHARS} characters",
            )
            self._probe(session, msg.probe, now)
        elif kind == "preemption":
            p = msg.preemption
            finite(p.deadline_unix, "preemption.deadline_unix")
            require(
                len(p.source) <= MAX_OPERATION_CHARS,
                f"preemption.source is over {MAX_OPERATION_CHARS} characters",
            )
            require(
                p.deadline_unix <= now + MAX_DEADLINE_AHEAD_S, "preemption.deadline_unix is too far ahead"
            )
            core.membership.preemption(job, member, p.deadline_unix, p.source or "agent", now)
        elif kind == "register":
            raise invalid("register is only valid as the first message of a stream")
        elif kind == "worker_exit":
            e = msg.worker_exit
            require(
                len(e.detail) <= MAX_DETAIL_CHARS, f"worker_exit.detail is over {MAX_DETAIL_CHARS} characters"
            )
            if e.exit_code == EXIT_CODE_UNKNOWN:
                how = f"exited ({e.detail or 'exit status unknown'})"
            elif e.exit_code < 0:
                how = f"killed by signal {-e.exit_code}"
            else:
                how = f"exited with code {e.exit_code}"
            core.membership.mark_lost(job, session.worker_id, f"worker process {how}", "process_exit", now)
        else:
            raise invalid("report has no body")

    def _probe(self, session: AgentSession, probe: agent_pb2.HealthProbe, now: float) -> None:
        require(probe.kind != agent_pb2.PROBE_KIND_UNSPECIFIED, "probe.kind is unspecified")
        finite(probe.latency_ms, "probe.latency_ms")
        job = self.core.table.get(session.job)
        member = job.member(session.worker_id)
        name = agent_pb2.ProbeKind.Name(probe.kind).removeprefix("PROBE_KIND_").lower()
        was_healthy = member.probes.get(name, {}).get("healthy", True)
        # Replaced, never changed in place: the REST API serialises members on another thread.
        member.probes = {**member.probes, name: {"healthy": probe.healthy, "detail": probe.detail, "at": now}}
        if not probe.healthy and was_healthy:
            self.core.table.record(
                job, "probe_unhealthy", worker_id=session.worker_id, detail=f"{name}: {probe.detail}", now=now
            )
            if name == "device" and member.state != WorkerState.LOST:
                self.core.membership.mark_lost(
                    job, session.worker_id, f"device probe failed: {probe.detail}", "device_probe", now
                )


class WorkerCommandRequest(BaseModel):
    """Body of POST /api/v1/jobs/{job}/workers/{worker}/commands."""

    model_config = ConfigDict(extra="forbid", strict=True)  # no "1" for 1, no false for 0
    command: Literal["set_frequency", "drain", "report_now"]
    frequency_mhz: int | None = Field(
        default=None,
        ge=0,
        le=MAX_FREQUENCY_MHZ,
        description="MHz, set_frequency only (required there); 0 restores the device default",
    )
    reason: str = Field(default="", max_length=1000, description="drain only: why, for people")
    deadline_unix: float | None = Field(
        default=None,
        allow_inf_nan=False,
        description=f"drain only: seconds since the epoch, in the future (default now + {DEFAULT_DRAIN_S:.0f} s)",
    )

    @model_validator(mode="after")
    def _fields_fit_the_command(self) -> WorkerCommandRequest:
        if self.command == "set_frequency" and self.frequency_mhz is None:
            raise ValueError("set_frequency needs frequency_mhz")
        if self.command != "set_frequency" and self.frequency_mhz is not None:
            raise ValueError(f"frequency_mhz is only for set_frequency, not {self.command}")
        if self.command != "drain" and (self.reason or self.deadline_unix is not None):
            raise ValueError(f"reason and deadline_unix are only for drain, not {self.command}")
        return self


def worker_command(
    core: ServicerCore, job_name: str, worker_id: str, body: WorkerCommandRequest, now: float
) -> dict[str, Any]:
    """Validates and queues one command on the worker's live agent stream; records an event."""
    job = core.job_or_not_found(job_name)
    member = job.members.get(worker_id)
    if member is None:
        raise RpcError(grpc.StatusCode.NOT_FOUND, f"job {job_name!r} has no worker {worker_id!r}")
    if member.state.is_gone:
        raise RpcError(grpc.StatusCode.FAILED_PRECONDITION, f"worker {worker_id!r} is {member.state.value}")
    if (job_name, worker_id) not in core.membership.sessions:
        raise RpcError(
            grpc.StatusCode.FAILED_PRECONDITION, f"worker {worker_id!r} has no live agent stream on this Core"
        )
    if body.command == "set_frequency":
        assert body.frequency_mhz is not None
        command = agent_pb2.ConnectResponse(set_frequency=agent_pb2.SetFrequency(mhz=body.frequency_mhz))
        detail = f"set_frequency {body.frequency_mhz} MHz"
    elif body.command == "drain":
        deadline = body.deadline_unix if body.deadline_unix is not None else now + DEFAULT_DRAIN_S
        require(deadline > now, f"deadline_unix is not in the future (the Core's clock reads {now:.3f})")
        require(deadline <= now + MAX_DEADLINE_AHEAD_S, "deadline_unix is more than 7 days ahead")
        reason = body.reason or "drained by the operator"
        command = agent_pb2.ConnectResponse(drain=agent_pb2.Drain(reason=reason, deadline_unix=deadline))
        detail = f"drain by {deadline:.3f}: {reason}"
    else:
        command = agent_pb2.ConnectResponse(report_now=agent_pb2.ReportNow())
        detail = "report_now"
    if body.command == "drain":
        # The worker is leaving on the Core's word: the planner sees it go (docs/architecture.md ("The Core's decisions")).
        if member.state is not WorkerState.DRAINING:
            core.metrics.departures.labels(kind="drained").inc()
        core.table.set_state(job, member, WorkerState.DRAINING, detail, now=now, kind="worker_draining")
    core.membership.send(job_name, worker_id, command)
    event = core.table.record(
        job, "worker_command", worker_id=worker_id, detail=detail, now=now, data={"command": body.command}
    )
    return {"job": job_name, "worker_id": worker_id, "command": body.command, "event_seq": event.seq}


def worker_command_router(core: ServicerCore, dependencies: list[Depends]) -> APIRouter:
    """The REST route; `dependencies` are the app's leader and scheduler-token checks."""
    router = APIRouter(dependencies=dependencies)

    @router.post(
        "/api/v1/jobs/{job}/workers/{worker}/commands",
        status_code=202,
        responses=error_responses(400, 401, 403, 404, 409, 413, 422, 503),
    )
    async def send_worker_command(
        job: JobName,
        worker: Annotated[str, Path(max_length=128)],
        body: WorkerCommandRequest,
    ) -> dict[str, Any]:
        # async: the command goes into an asyncio.Queue, which only the event loop may touch.
        try:
            return worker_command(core, job, worker, body, time.time())
        except RpcError as err:
            status = HTTP_STATUS.get(err.code, 400)
            detail: Any = field_error("", err.message) if status == 422 else err.message
            raise HTTPException(status, detail=detail) from None

    return router
