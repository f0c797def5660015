"""AgentService: one bidirectional stream per agent (agent.proto)."""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time
from typing import TYPE_CHECKING

import grpc

from agent.worker import EXIT_CODE_UNKNOWN
from core_service.grpc_util import Malformed, RpcError, bearer_token, finite, invalid, require
from core_service.jobs import UnknownJob
from core_service.membership import AgentSession, Registration
from core_service.model import DeviceInfo, StepReport, WorkerState
from elaswave.v1 import agent_pb2

if TYPE_CHECKING:
    from core_service.core import Core

log = logging.getLogger("elaswave.core.agents")

WORKER_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}$")
FIRST_MESSAGE_TIMEOUT_S = 10.0
MAX_DEADLINE_AHEAD_S = 7 * 24 * 3600.0


def _registration(msg: agent_pb2.Register) -> Registration:
    require(bool(msg.job), "register.job is empty")
    require(bool(WORKER_ID_PATTERN.match(msg.worker_id)),
            f"register.worker_id {msg.worker_id!r} must be 1-128 characters of letters, digits, '._:@-'")
    require(bool(msg.host) and len(msg.host) <= 255, "register.host must be 1-255 characters")
    require(msg.pid >= 0, f"register.pid must be >= 0, got {msg.pid}")
    require(msg.stage >= -1 and msg.dp_rank >= -1 and msg.rank >= -1,
            "register.stage, dp_rank and rank must be >= -1")
    require(msg.heartbeat_interval_ms <= 60_000, "register.heartbeat_interval_ms must be <= 60000")
    devices = []
    for d in msg.devices:
        require(d.kind in ("cuda", "npu", "cpu"), f"device kind {d.kind!r} is not cuda, npu or cpu")
        require(d.index >= 0, f"device index must be >= 0, got {d.index}")
        devices.append(DeviceInfo(d.kind, d.index, d.name, d.memory_bytes))
    return Registration(msg.job, msg.worker_id, msg.host, msg.pid, devices, msg.stage, msg.dp_rank,
                        msg.rank, msg.holds_own_lease)


def _step_report(msg: agent_pb2.StepMetrics, now: float) -> StepReport:
    require(msg.step >= 0, f"step.step must be >= 0, got {msg.step}")
    finite(msg.step_time_s, "step.step_time_s")
    finite(msg.compute_time_s, "step.compute_time_s")
    require(msg.stage >= -1 and msg.dp_rank >= -1, "step.stage and step.dp_rank must be >= -1")
    loss = None if math.isnan(msg.loss) else msg.loss
    if loss is not None:
        finite(loss, "step.loss", minimum=float("-inf"))
    return StepReport(msg.step, msg.step_time_s, msg.compute_time_s, loss, msg.samples, msg.stage,
                      msg.dp_rank, now)


class AgentServicer:
    def __init__(self, core: Core) -> None:
        self.core = core

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
        if first.WhichOneof("body") != "register":
            raise invalid(f"first message must be register, got {first.WhichOneof('body')}")
        reg = _registration(first.register)
        self.core.check_job_token(reg.job, bearer_token(context))
        session = await self.core.membership.register(reg, time.time())
        ack = agent_pb2.RegisterAck(
            session=session.session_id,
            heartbeat_timeout_ms=int(self.core.settings.heartbeat_timeout_s * 1000),
            core_id=self.core.settings.core_id,
        )
        await context.write(agent_pb2.ConnectResponse(ack=ack))
        return session

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
            if await self._dispatch(session, msg):
                return True

    async def _dispatch(self, session: AgentSession, msg: object) -> bool:
        if isinstance(msg, Malformed):
            raise invalid(msg.message)
        assert isinstance(msg, agent_pb2.ConnectRequest)
        started = time.perf_counter()
        kind = msg.WhichOneof("body")
        self.core.metrics.agent_reports.labels(kind=kind or "empty").inc()
        if kind == "leave":
            await self.core.membership.leave(session, msg.leave.reason, time.time())
            return True
        await self._handle(session, kind, msg)
        self.core.metrics.report_seconds.observe(time.perf_counter() - started)
        return False

    async def _handle(self, session: AgentSession, kind: str | None, msg: agent_pb2.ConnectRequest) -> None:
        core, now = self.core, time.time()
        try:
            job = core.table.get(session.job)
        except UnknownJob as exc:
            raise RpcError(grpc.StatusCode.NOT_FOUND, str(exc)) from None
        member = job.member(session.worker_id)
        if kind == "heartbeat":
            await core.membership.heartbeat(session, now)
        elif kind == "step":
            core.membership.step(session, _step_report(msg.step, now))
        elif kind == "memory":
            m = msg.memory
            require(0.0 <= m.cpu_percent <= 100.0 * 1024, f"memory.cpu_percent out of range: {m.cpu_percent}")
            member.memory = {
                "host_used_bytes": m.host_used_bytes, "host_total_bytes": m.host_total_bytes,
                "worker_rss_bytes": m.worker_rss_bytes, "device_used_bytes": list(m.device_used_bytes),
                "device_total_bytes": list(m.device_total_bytes), "cpu_percent": m.cpu_percent,
            }
        elif kind == "probe":
            self._probe(session, msg.probe, now)
        elif kind == "preemption":
            p = msg.preemption
            finite(p.deadline_unix, "preemption.deadline_unix")
            require(p.deadline_unix <= now + MAX_DEADLINE_AHEAD_S, "preemption.deadline_unix is too far ahead")
            core.membership.preemption(job, member, p.deadline_unix, p.source or "agent", now)
        elif kind == "worker_exit":
            e = msg.worker_exit
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
        member.probes[name] = {"healthy": probe.healthy, "detail": probe.detail, "at": now}
        if not probe.healthy and was_healthy:
            self.core.table.record(job, "probe_unhealthy", worker_id=session.worker_id,
                                   detail=f"{name}: {probe.detail}", now=now)
            if name == "device" and member.state != WorkerState.LOST:
                self.core.membership.mark_lost(job, session.worker_id, f"device probe failed: {probe.detail}",
                                               "device_probe", now)

