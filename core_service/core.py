"""The Core process: gRPC + REST servers, leader election, detection loops and the schedule engine.

Every Core instance serves both APIs. Only the leader accepts agents, executors and schedulers;
a standby answers UNAVAILABLE with "not leader; leader is <address>" so clients move on, and
campaigns until the leader's lease lapses. On winning, it reloads jobs, members, events and plan
epochs from the registry: nothing the old leader persisted is lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import socket
import time
from typing import Any

import grpc
import uvicorn
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry

from core_service.agent_service import AgentServicer
from core_service.config import CoreSettings
from core_service.engine import Policy, ScheduleEngine
from core_service.executor_service import ExecutorServicer, PlanFeed
from core_service.grpc_util import RpcError, generic_handler
from core_service.jobs import Job, JobTable, UnknownJob
from core_service.membership import Membership
from core_service.metrics import CoreMetrics
from core_service.persist import Persister
from core_service.policies import default_policy, judge_offer, scale_table
from core_service.registry import LeaderElection, MemoryRegistry, PlanStore, open_registry
from core_service.rest import build_app
from core_service.scheduler_service import SchedulerServicer
from elaswave.v1 import agent_pb2, executor_pb2, scheduler_pb2

log = logging.getLogger("elaswave.core")

SERVICES = (
    agent_pb2.DESCRIPTOR.services_by_name["AgentService"],
    executor_pb2.DESCRIPTOR.services_by_name["ExecutorService"],
    scheduler_pb2.DESCRIPTOR.services_by_name["SchedulerService"],
)
# Heartbeat sweeps and engine ticks. Heartbeat loss is the slowest detection path (seconds), so
# 100 ms of granularity costs nothing and keeps a 10,000-member sweep off the hot path.
LOOP_INTERVAL_S = 0.1
# Keepalive pings find dead peers behind a silent partition; clients may ping every 5 s.
GRPC_SERVER_OPTIONS = [
    ("grpc.so_reuseport", 0),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.max_receive_message_length", 16 * 1024 * 1024),
    # Every agent of a large job reconnects at once after a leader failover. grpc rejects calls
    # beyond 3,000 not yet picked up by the server ("Too many pending requests"), which failed
    # most streams of a 10,000-agent burst; the bound stays, above any job we plan for.
    ("grpc.server.max_pending_requests", 100_000),
    ("grpc.server.max_pending_requests_hard_limit", 100_000),
]
GAUGE_INTERVAL_S = 1.0


class Core:
    def __init__(
        self, settings: CoreSettings, metrics_registry: CollectorRegistry | None = None,
        policy: Policy | None = None,
    ) -> None:
        self.settings = settings
        self.metrics = CoreMetrics(metrics_registry or CollectorRegistry())
        self.registry = open_registry(settings.registry_url)
        self.plans = PlanStore(self.registry, settings.key_prefix)
        self.policy: Policy = policy or default_policy()
        self.plan_feed = PlanFeed()
        self.is_leader = False
        self.leader_info: dict[str, Any] = {}
        self.grpc_port = 0
        self.http_port = 0
        self.started_unix = time.time()
        self._stopping = asyncio.Event()
        self._tasks: list[asyncio.Task[Any]] = []
        self._leader_tasks: list[asyncio.Task[Any]] = []
        self._grpc: grpc.aio.Server | None = None
        self._http: uvicorn.Server | None = None
        self._health = health.aio.HealthServicer()
        self._election: LeaderElection | None = None

    # ---- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        """Binds both servers and starts campaigning; returns once the ports are known."""
        self.persister = Persister(self.registry)
        self.persister.enabled = False
        self.table = JobTable(self.settings, self.registry, self.persister)
        self.membership = Membership(self.table, self.registry, self.metrics)
        self.engine = ScheduleEngine(self.table, self.metrics, self.policy, self._publish_plan,
                                     self.settings.apply_timeout_s)
        await self._start_grpc()
        await self._start_http()
        self.identity = json.dumps({
            "core_id": self.settings.core_id,
            "grpc": f"{self.settings.grpc_host}:{self.grpc_port}",
            "http": f"http://{self.settings.http_host}:{self.http_port}",
        }, sort_keys=True)
        self._election = LeaderElection(
            self.registry, f"{self.settings.key_prefix}/core/leader", self.identity,
            self._leader_ttl(), on_lost=self._on_leadership_lost_thread,
        )
        self._loop = asyncio.get_running_loop()
        self._tasks.append(asyncio.ensure_future(self._campaign()))
        await self._set_health(False)
        log.info("core %s serving gRPC on %s:%d and HTTP on %s:%d", self.settings.core_id,
                 self.settings.grpc_host, self.grpc_port, self.settings.http_host, self.http_port)

    def _leader_ttl(self) -> float:
        # An in-memory registry lives in this process, so no standby can exist: a short lease
        # would only let a CPU-starved keepalive thread depose the sole Core for nothing.
        if isinstance(self.registry, MemoryRegistry):
            return max(self.settings.leader_ttl_s, 3600.0)
        return self.settings.leader_ttl_s

    async def wait_leader(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while not self.is_leader and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return self.is_leader

    async def serve_forever(self) -> None:
        await self._stopping.wait()

    def request_stop(self) -> None:
        self._stopping.set()

    async def stop(self) -> None:
        """Graceful shutdown: stop accepting, flush the registry writes, resign leadership."""
        self._stopping.set()
        if self._grpc is not None:
            await self._grpc.stop(grace=1.0)
        if self._http is not None:
            self._http.should_exit = True
        for task in self._tasks + self._leader_tasks:
            task.cancel()
        for task in self._tasks + self._leader_tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self.membership.stop_watching()
        if self.is_leader:
            await self.persister.stop()
        if self._election is not None:
            await asyncio.to_thread(self._election.resign)
        self.registry.close()

    # ---- servers -------------------------------------------------------------------------------
    async def _start_grpc(self) -> None:
        server = grpc.aio.server(options=GRPC_SERVER_OPTIONS)
        self.scheduler = SchedulerServicer(self)
        server.add_generic_rpc_handlers((
            generic_handler(SERVICES[0], AgentServicer(self)),
            generic_handler(SERVICES[1], ExecutorServicer(self)),
            generic_handler(SERVICES[2], self.scheduler),
        ))
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        names = [s.full_name for s in SERVICES] + [health.SERVICE_NAME, reflection.SERVICE_NAME]
        reflection.enable_server_reflection(names, server)
        address = f"{self.settings.grpc_host}:{self.settings.grpc_port}"
        credentials = self._server_credentials()
        if credentials is None:
            self.grpc_port = server.add_insecure_port(address)
        else:
            self.grpc_port = server.add_secure_port(address, credentials)
        if self.grpc_port == 0:
            raise OSError(f"cannot bind gRPC to {address}")
        await server.start()
        self._grpc = server

    def _server_credentials(self) -> grpc.ServerCredentials | None:
        s = self.settings
        if s.tls_cert is None or s.tls_key is None:
            return None
        ca = s.tls_client_ca.read_bytes() if s.tls_client_ca else None
        return grpc.ssl_server_credentials(
            [(s.tls_key.read_bytes(), s.tls_cert.read_bytes())], root_certificates=ca,
            require_client_auth=ca is not None,
        )

    async def _start_http(self) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.settings.http_host, self.settings.http_port))
        self.http_port = sock.getsockname()[1]
        config = uvicorn.Config(build_app(self), log_level="warning", lifespan="off", access_log=False)
        self._http = uvicorn.Server(config)
        self._tasks.append(asyncio.ensure_future(self._http.serve(sockets=[sock])))

    async def _set_health(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        await self._health.set("", health_pb2.HealthCheckResponse.SERVING)
        for service in SERVICES:
            await self._health.set(service.full_name, status)

    # ---- leadership ----------------------------------------------------------------------------
    async def _campaign(self) -> None:
        assert self._election is not None
        while not self._stopping.is_set():
            if not self.is_leader:
                won = await asyncio.to_thread(self._election.campaign, 0.5)
                if won:
                    await self._take_over()
            await asyncio.sleep(0.1)

    async def _take_over(self) -> None:
        now = time.time()
        await asyncio.to_thread(self.table.load_from_registry, now)
        for job in self.table.jobs.values():
            job.plan_epoch = await asyncio.to_thread(self.plans.current_epoch, job.name)
        self.persister.enabled = True
        self.persister.start()
        self.table.ensure_configured_jobs(now)
        self.membership.start_watching(asyncio.get_running_loop())
        self.is_leader = True
        self.metrics.is_leader.set(1)
        self._leader_tasks.append(asyncio.ensure_future(self._leader_loop()))
        await self._set_health(True)
        for job in self.table.jobs.values():
            self.table.record(job, "core_leader", detail=f"core {self.settings.core_id} leads", now=now)
        log.info("core %s is the leader (%d jobs loaded)", self.settings.core_id, len(self.table.jobs))

    def _on_leadership_lost_thread(self) -> None:
        self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._step_down()))

    async def _step_down(self) -> None:
        if not self.is_leader:
            return
        log.warning("core %s lost the leadership; standing by", self.settings.core_id)
        self.is_leader = False
        self.metrics.is_leader.set(0)
        for task in self._leader_tasks:
            task.cancel()
        self._leader_tasks.clear()
        self.membership.kick_all()
        self.membership.stop_watching()
        self.persister.enabled = False
        await self._set_health(False)

    async def _leader_loop(self) -> None:
        last_gauges = 0.0
        while True:
            now = time.time()
            self.membership.sweep_heartbeats(now)
            self.engine.tick_all(now)
            if now - last_gauges >= GAUGE_INTERVAL_S:
                self._update_gauges()
                last_gauges = now
            await asyncio.sleep(LOOP_INTERVAL_S)

    def _update_gauges(self) -> None:
        self.metrics.members.clear()
        for job in self.table.jobs.values():
            counts: dict[str, int] = {}
            for member in job.members.values():
                counts[member.state.value] = counts.get(member.state.value, 0) + 1
            for state, count in counts.items():
                self.metrics.members.labels(job=job.name, state=state).set(count)

    def _publish_plan(self, job: str, body: bytes, expected_epoch: int) -> int:
        epoch = self.plans.publish(job, body, expected_epoch=expected_epoch)
        asyncio.ensure_future(self.plan_feed.notify(job))
        return epoch

    # ---- helpers for the services ----------------------------------------------------------------
    def not_leader_message(self) -> str:
        holder = self._election.leader_id() if self._election else None
        where = json.loads(holder)["grpc"] if holder else "unknown"
        return f"not leader; leader is {where}"

    def require_leader(self) -> None:
        if not self.is_leader:
            raise RpcError(grpc.StatusCode.UNAVAILABLE, self.not_leader_message())

    def job_or_not_found(self, name: str) -> Job:
        try:
            return self.table.get(name)
        except UnknownJob as exc:
            raise RpcError(grpc.StatusCode.NOT_FOUND, str(exc)) from None

    def check_job_token(self, job_name: str, token: str | None) -> None:
        job = self.job_or_not_found(job_name)
        if token is None:
            raise RpcError(grpc.StatusCode.UNAUTHENTICATED, "missing 'authorization: Bearer <job token>'")
        if not job.check_token(token):
            raise RpcError(grpc.StatusCode.PERMISSION_DENIED, f"wrong token for job {job_name!r}")

    def scheduler_token_ok(self, token: str | None) -> bool:
        expected = self.settings.scheduler_token
        return token is not None and expected is not None and hmac.compare_digest(
            token.encode(), expected.get_secret_value().encode())

    def check_scheduler_token(self, token: str | None) -> None:
        if token is None:
            raise RpcError(grpc.StatusCode.UNAUTHENTICATED, "missing 'authorization: Bearer <scheduler token>'")
        if not self.scheduler_token_ok(token):
            raise RpcError(grpc.StatusCode.PERMISSION_DENIED, "wrong scheduler token")

    def send_command(self, job: str, worker_id: str, command: agent_pb2.ConnectResponse) -> bool:
        session = self.membership.sessions.get((job, worker_id))
        if session is None:
            return False
        session.outbox.put_nowait(command)
        return True

    def judge_offer(self, job: Job, devices: int, expected_duration_s: float) -> tuple[bool, str]:
        return judge_offer(job, devices, expected_duration_s)

    def scale_table(self, job: Job) -> list[dict[str, Any]]:
        try:
            return scale_table(job)
        except ValueError as exc:
            raise RpcError(grpc.StatusCode.FAILED_PRECONDITION, str(exc)) from None
