"""The Core process: gRPC + REST servers, leader election, detection loops and the schedule engine.

Every Core instance serves both APIs. Only the leader accepts agents, executors and schedulers;
a standby answers UNAVAILABLE with "not leader; leader is <address>" so clients move on, and
campaigns until the leader's lease lapses. On winning, it reloads jobs, members, events, plan
epochs and each job's current layout (its newest stored plan) from the registry, re-plans ranks
whose worker was lost before the old leader could plan, and resumes watching an unfinished apply:
nothing the old leader persisted is lost. Mutating API calls answer only once their writes are
stored, so nothing acknowledged is lost either.

Each leadership term has exactly one registry writer task; a Core that loses its lease drops its
queued writes (its successor owns the registry). Every write of the term (records, events, plans,
liveness keys) is fenced by the leader key: stored only while it still holds this Core's election
entry, checked in the write's own transaction. So a Core whose lease lapsed before it noticed
cannot overwrite its successor's records; the first write refused that way ends the term and the
Core steps down. A leader whose loop keeps failing (e.g. plans cannot be stored) gives the
leadership up and holds off campaigning, so a standby takes over.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Coroutine
from typing import Any

import grpc
import uvicorn
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry

from core_service.agent_service import AgentServicer
from core_service.config import CoreSettings
from core_service.elaswave_policy import make_policy
from core_service.engine import ScheduleEngine
from core_service.executor_service import ExecutorServicer, PlanFeed
from core_service.grpc_util import RpcError, generic_handler
from core_service.job_snapshot import Policy
from core_service.jobs import Job, JobTable, UnknownJob
from core_service.loop_watch import LoopWatch
from core_service.membership import Membership
from core_service.metrics import CoreMetrics
from core_service.offload import PlanningWorker
from core_service.persist import NotDurable, Persister, registry_call
from core_service.policies import scale_table
from core_service.recovery import stored_plans
from core_service.registry import (
    EtcdSecurity,
    FenceLost,
    KVEvent,
    LeaderElection,
    MemoryRegistry,
    PlanStore,
    Registry,
    RegistryError,
    WatchHandle,
    holder_of,
    open_registry,
)
from core_service.rest import build_app
from core_service.scheduler_service import SchedulerServicer
from core_service.tcp_listen import tcp_listener
from wire.v1 import agent_pb2, executor_pb2, scheduler_pb2

log = logging.getLogger("elaswave.core")

SERVICES = (
    agent_pb2.DESCRIPTOR.services_by_name["AgentService"],
    executor_pb2.DESCRIPTOR.services_by_name["ExecutorService"],
    scheduler_pb2.DESCRIPTOR.services_by_name["SchedulerService"],
)
# Heartbeat sweeps and engine ticks. Heartbeat loss is the slowest detection path (seconds), so
# 100 ms of granularity costs nothing and keeps a 10,000-member sweep off the hot path.
LOOP_INTERVAL_S = 0.1
MIN_TICK_GAP_S = 0.005
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
# The event loop marks each turn this often; the leader watchdog reads the mark.
LOOP_BEAT_S = 0.05
# Consecutive leader-loop ticks with a failure (a plan that cannot be stored, a sweep that raises)
# before this Core gives the leadership up: 2 s of ticks, long enough to ride out one slow etcd
# call, short enough that a standby with a working registry connection takes over promptly.
MAX_CONSECUTIVE_FAILURES = 20
# After giving up, do not campaign for this long, so that a standby wins the election.
STEP_DOWN_HOLD_OFF_S = 10.0
# A mutating API call waits at most this long for its writes to be stored, then answers UNAVAILABLE.
DURABLE_WAIT_S = 5.0
# On a graceful stop or a voluntary step-down, queued writes get this long to be stored.
STOP_FLUSH_S = 5.0
# Stop's bound on the Core's own tasks (the REST server, the leader's loops) once cancelled, and
# on the REST server's open connections (a dashboard's event stream never closes by itself): a
# stop that waits on them forever turns a clean shutdown into a SIGKILL after the pod's grace.
STOP_TASKS_S = 5.0


def etcd_security(settings: CoreSettings) -> EtcdSecurity:
    """TLS and user/password for etcd, from the settings (files read once, at start)."""
    password = settings.etcd_password.get_secret_value() if settings.etcd_password else None
    return EtcdSecurity(
        ca=settings.etcd_ca.read_bytes() if settings.etcd_ca else None,
        cert=settings.etcd_cert.read_bytes() if settings.etcd_cert else None,
        key=settings.etcd_key.read_bytes() if settings.etcd_key else None,
        user=settings.etcd_user,
        password=password,
    )


def advertised_host(settings: CoreSettings) -> str:
    """The host agents and standbys are told to reach this Core at (leader hints): --advertise,
    else the pod IP, else grpc_host; a wildcard bind address (0.0.0.0, ::) is never advertised,
    since no client can connect to it, so it falls back to this machine's name."""
    if settings.advertise:
        return settings.advertise
    pod_ip = os.environ.get("POD_IP", "").strip()
    if pod_ip:
        return pod_ip
    if settings.grpc_host in ("0.0.0.0", "::", "[::]", ""):
        return socket.getfqdn()
    return settings.grpc_host


class PortTaken(OSError):
    """A port this Core is configured to listen on cannot be bound; says which setting and port."""

    def __init__(self, setting: str, host: str, port: int, why: str | None) -> None:
        env = "ELASWAVE_" + setting.upper()
        flag = "--" + setting.replace("_", "-")
        super().__init__(
            f"cannot listen on {host}:{port} ({setting}: {flag} or ${env}): {why or 'address in use'}; "
            "choose a free port (0 picks one)"
        )
        self.setting, self.port = setting, port


class Core:
    def __init__(
        self,
        settings: CoreSettings,
        metrics_registry: CollectorRegistry | None = None,
        policy: Policy | None = None,
        registry: Registry | None = None,
    ) -> None:
        """`registry`: an open registry to use instead of opening `settings.registry_url` (several
        Cores of one process sharing an in-memory registry); the caller keeps closing it."""
        self.settings = settings
        self.metrics = CoreMetrics(metrics_registry or CollectorRegistry())
        self._owns_registry = registry is None
        self.registry = (
            open_registry(settings.registry_url, etcd_security(settings)) if registry is None else registry
        )
        self.plans = PlanStore(self.registry, settings.key_prefix)
        self.policy: Policy = policy or make_policy(settings.policy, settings.drop_replicas)
        self.plan_feed = PlanFeed()
        # Scale tables and what-ifs: off the loop, within the client's deadline, stoppable.
        self.planning = PlanningWorker(on_stop=self.metrics.planning_stopped.inc)
        self.loop_watch: LoopWatch | None = None  # started with the loop's turn marks (start)
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
        self._leader_key = f"{settings.key_prefix}/core/leader"
        self._leader_holder: str | None = None  # cached from a watch: never a registry read on the loop
        self._leader_watch: WatchHandle | None = None
        self._leadership_lock = asyncio.Lock()  # take-over and step-down never interleave
        self._campaign_after = 0.0  # monotonic; set when this Core gives the leadership up
        self.max_consecutive_failures = MAX_CONSECUTIVE_FAILURES
        self.step_down_hold_off_s = STEP_DOWN_HOLD_OFF_S
        self.durable_wait_s = DURABLE_WAIT_S
        self.stop_flush_s = STOP_FLUSH_S

    # ---- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        """Binds both servers and starts campaigning; returns once the ports are known."""
        self.persister = Persister(self.registry, on_fenced_out=self._on_fenced_out)
        self.table = JobTable(self.settings, self.registry, self.persister)
        self.membership = Membership(self.table, self.registry, self.metrics)
        self.engine = ScheduleEngine(
            self.table, self.metrics, self.policy, self._publish_plan, self.settings.apply_timeout_s
        )
        await self._start_grpc()
        try:
            await self._start_http()
        except PortTaken:
            if self._grpc is not None:  # nothing may outlive a Core that did not start
                await self._grpc.stop(None)
                self._grpc = None
            raise
        self.identity = json.dumps(
            {
                "core_id": self.settings.core_id,
                "grpc": self.advertised_grpc(),
                "http": self.advertised_http(),
            },
            sort_keys=True,
        )
        self._election = LeaderElection(
            self.registry,
            self._leader_key,
            self.identity,
            self._leader_ttl(),
            on_lost=self._on_leadership_lost_thread,
            stalled=self._loop_stalled,
        )
        self._loop = asyncio.get_running_loop()
        self._leader_watch = await registry_call(
            self.registry, self.registry.watch_prefix, self._leader_key, self._on_leader_key
        )
        await self._refresh_leader_holder()
        self._loop_turned = time.monotonic()
        self._tasks.append(asyncio.ensure_future(self._turn_loop()))
        self.loop_watch = LoopWatch(lambda: self._loop_turned, threading.get_ident(), self.settings.core_id)
        self.loop_watch.start()
        self._tasks.append(asyncio.ensure_future(self._campaign()))
        await self._set_health(False)
        log.info(
            "core %s serving gRPC on %s:%d and HTTP on %s:%d",
            self.settings.core_id,
            self.settings.grpc_host,
            self.grpc_port,
            self.settings.http_host,
            self.http_port,
        )

    def advertised_http(self) -> str:
        """scheme://host:port of this Core's REST API as clients reach it (the REST leader hint):
        the advertised host (without a port it may carry for gRPC) and the bound HTTP port."""
        host = advertised_host(self.settings)
        if host.startswith("["):
            host = host[: host.index("]") + 1]
        elif host.count(":") == 1:
            host = host.split(":")[0]
        elif host.count(":") > 1:
            host = f"[{host}]"  # a bare IPv6 address
        return f"{self.http_scheme}://{host}:{self.http_port}"

    def advertised_grpc(self) -> str:
        """host:port of this Core's gRPC API as clients reach it (the leader hint)."""
        host = advertised_host(self.settings)
        has_port = "]:" in host if host.startswith("[") else host.count(":") == 1
        if has_port:
            return host  # host:port as configured (a port mapped in front of this Core)
        if host.count(":") > 1 and not host.startswith("["):
            host = f"[{host}]"  # a bare IPv6 address
        return f"{host}:{self.grpc_port}"

    @property
    def http_scheme(self) -> str:
        return "https" if self.settings.http_tls_cert is not None else "http"

    def _leader_ttl(self) -> float:
        # An in-memory registry lives in this process, so no standby can exist: a short lease
        # would only let a CPU-starved keepalive thread depose the sole Core for nothing.
        if isinstance(self.registry, MemoryRegistry):
            return max(self.settings.leader_ttl_s, 3600.0)
        return self.settings.leader_ttl_s

    # ---- leader watchdog ---------------------------------------------------------------------
    async def _turn_loop(self) -> None:
        """Marks every turn of the event loop (at LOOP_BEAT_S); the election's keepalive thread
        reads the mark (`_loop_stalled`)."""
        while True:
            now = time.monotonic()
            self.metrics.loop_lag.observe(max(0.0, now - self._loop_turned - LOOP_BEAT_S))
            self._loop_turned = now
            await asyncio.sleep(LOOP_BEAT_S)

    def loop_stall_bound_s(self) -> float:
        # Default: the lease TTL. A frozen leader is then replaced as promptly as a dead one
        # (whose lease lapses within the TTL), and a loop that a loaded machine merely slows
        # down for a second does not cost a leadership change.
        return self.settings.loop_stall_s or self._leader_ttl()

    def _loop_stalled(self) -> str | None:
        """Election keepalive thread: why this Core cannot lead (None: it can). A leader whose
        loop has not turned for the bound answers no agent, sweeps no heartbeat and plans
        nothing, yet its keepalive thread would hold the lease forever; so it gives the lease up."""
        silent = time.monotonic() - self._loop_turned
        bound = self.loop_stall_bound_s()
        if silent <= bound:
            return None
        self.metrics.watchdog_step_downs.inc()
        log.error(
            "core %s: event loop stalled for %.2f s (bound %.2f s)", self.settings.core_id, silent, bound
        )
        return f"the event loop has not turned for {silent:.2f} s (bound {bound:.2f} s)"

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
        self.membership.closing_streams = True  # the streams end because we stop, not the workers
        if self._grpc is not None:
            await self._grpc.stop(grace=1.0)
        if self._http is not None:
            self._http.should_exit = True
        tasks = self._tasks + self._leader_tasks
        for task in tasks:
            task.cancel()
        if tasks:
            done, pending = await asyncio.wait(tasks, timeout=STOP_TASKS_S)
            for task in done:  # retrieved, so that a task that failed is not reported at exit
                if not task.cancelled():
                    task.exception()
            if pending:
                names = sorted(t.get_name() for t in pending)
                log.warning(
                    "stop: %d task(s) still running after %.0f s, left behind: %s",
                    len(pending),
                    STOP_TASKS_S,
                    names,
                )
        self.membership.stop_watching()
        if self._leader_watch is not None:
            self._leader_watch.cancel()
        await self.persister.stop(self.stop_flush_s)
        if self._election is not None:
            with contextlib.suppress(RegistryError):
                await asyncio.to_thread(self._election.resign)
        self.planning.close()
        if self.loop_watch is not None:
            self.loop_watch.stop()
        if self._owns_registry:
            self.registry.close()

    # ---- servers -------------------------------------------------------------------------------
    async def _start_grpc(self) -> None:
        server = grpc.aio.server(options=GRPC_SERVER_OPTIONS)
        self.scheduler = SchedulerServicer(self)
        server.add_generic_rpc_handlers(
            (
                generic_handler(SERVICES[0], AgentServicer(self)),
                generic_handler(SERVICES[1], ExecutorServicer(self)),
                generic_handler(SERVICES[2], self.scheduler),
            )
        )
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        names = [s.full_name for s in SERVICES] + [health.SERVICE_NAME, reflection.SERVICE_NAME]
        reflection.enable_server_reflection(names, server)
        address = f"{self.settings.grpc_host}:{self.settings.grpc_port}"
        credentials = self._server_credentials()
        try:
            if credentials is None:
                self.grpc_port = server.add_insecure_port(address)
            else:
                self.grpc_port = server.add_secure_port(address, credentials)
        except RuntimeError:  # grpcio: "Failed to bind to address ..." (its own log line says why)
            raise PortTaken(
                "grpc_port",
                self.settings.grpc_host,
                self.settings.grpc_port,
                "address in use or not available",
            ) from None
        if self.grpc_port == 0:
            raise PortTaken("grpc_port", self.settings.grpc_host, self.settings.grpc_port, "cannot bind")
        await server.start()
        self._grpc = server

    def _server_credentials(self) -> grpc.ServerCredentials | None:
        s = self.settings
        if s.tls_cert is None or s.tls_key is None:
            return None
        ca = s.tls_client_ca.read_bytes() if s.tls_client_ca else None
        return grpc.ssl_server_credentials(
            [(s.tls_key.read_bytes(), s.tls_cert.read_bytes())],
            root_certificates=ca,
            require_client_auth=ca is not None,
        )

    async def _start_http(self) -> None:
        try:
            sock = tcp_listener(self.settings.http_host, self.settings.http_port)
        except OSError as exc:
            raise PortTaken(
                "http_port", self.settings.http_host, self.settings.http_port, exc.strerror
            ) from None
        self.http_port = sock.getsockname()[1]
        tls = self.settings
        config = uvicorn.Config(
            build_app(self),
            log_level="warning",
            lifespan="off",
            access_log=False,
            timeout_graceful_shutdown=int(STOP_TASKS_S),
            ssl_certfile=str(tls.http_tls_cert) if tls.http_tls_cert else None,
            ssl_keyfile=str(tls.http_tls_key) if tls.http_tls_key else None,
        )
        self._http = uvicorn.Server(config)
        self._tasks.append(asyncio.ensure_future(self._http.serve(sockets=[sock])))

    async def _set_health(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        # The overall status ("") follows leadership too: a standby serves no API call, so
        # load balancers and gRPC health probes route to the leader only (liveness is /healthz).
        await self._health.set("", status)
        for service in SERVICES:
            await self._health.set(service.full_name, status)

    # ---- leadership ----------------------------------------------------------------------------
    async def _campaign(self) -> None:
        assert self._election is not None
        while not self._stopping.is_set():
            if not self.is_leader and time.monotonic() >= self._campaign_after:
                try:
                    await self._campaign_once()
                except Exception as exc:
                    # A takeover that cannot finish (registry unreachable half-way) must not keep
                    # the lease: nobody would lead. Give it up and try again later.
                    log.exception("core %s could not take over", self.settings.core_id)
                    await self._give_up_leadership(f"takeover failed: {exc!r}")
            await asyncio.sleep(0.1)

    async def _campaign_once(self) -> None:
        assert self._election is not None
        won = await asyncio.to_thread(self._election.campaign, 0.5)
        if not won:
            await self._refresh_leader_holder()  # heals a missed watch event
            return
        async with self._leadership_lock:
            if not self._election.is_leader:
                return  # lost again before the takeover began
            await self._take_over()

    async def _take_over(self) -> None:
        assert self._election is not None
        now = time.time()
        jobs = await asyncio.to_thread(self.table.read_registry, now)
        stored = {name: await asyncio.to_thread(stored_plans, self.plans, job) for name, job in jobs.items()}
        self.table.jobs = jobs
        self.persister.start(self._election.fence)
        self.table.ensure_configured_jobs(now)
        self.engine.reset()
        for name, (epoch, latest, committed) in stored.items():
            self.engine.restore(jobs[name], epoch, latest, now, committed)
        self.membership.start_watching(asyncio.get_running_loop())
        self.is_leader = True
        self._leader_holder = self.identity
        self.metrics.is_leader.set(1)
        self._leader_tasks.append(asyncio.ensure_future(self._leader_loop()))
        await self._set_health(True)
        for job in self.table.jobs.values():
            self.table.record(job, "core_leader", detail=f"core {self.settings.core_id} leads", now=now)
        log.info("core %s is the leader (%d jobs loaded)", self.settings.core_id, len(self.table.jobs))

    def _on_leadership_lost_thread(self) -> None:
        self._loop.call_soon_threadsafe(
            lambda: asyncio.ensure_future(self._step_down("the leader lease was lost", flush=False))
        )

    def _on_fenced_out(self, term: int, reason: str) -> None:
        """The persister of `term` had a write refused: the leader key is no longer ours."""
        asyncio.ensure_future(self._lost_the_leader_key(term, reason))

    async def _lost_the_leader_key(self, term: int, reason: str) -> None:
        """Steps down because a fenced write found the leader key held by another Core (or by
        nobody). Our lease may still run, and the election checks the key only on its next
        refresh (an in-memory registry's: an hour away), so the lease is released here, inside
        the leadership lock: the campaign must not take over again with the stale election in
        between. No hold-off: if nobody leads, this Core may win again and reload everything."""
        async with self._leadership_lock:
            if self.persister.terms_started != term or not self.is_leader:
                return  # that term has ended already
            await self._end_term(reason, flush=False)
            await self._release_lease()

    async def _give_up_leadership(self, reason: str) -> None:
        """Steps down on purpose: stores what is queued (bounded), releases the lease at once so a
        standby takes over, and holds off campaigning meanwhile."""
        self._campaign_after = time.monotonic() + self.step_down_hold_off_s
        log.error("core %s gives the leadership up: %s", self.settings.core_id, reason)
        await self._step_down(reason, flush=True)
        await self._release_lease()

    async def _release_lease(self) -> None:
        if self._election is not None:
            try:
                await asyncio.to_thread(self._election.resign)
            except RegistryError as exc:
                log.warning("could not release the leader lease (%s); it expires by itself", exc)

    async def _step_down(self, reason: str, *, flush: bool) -> None:
        """Ends this Core's leadership term; idempotent. With `flush` (we still hold the lease),
        queued writes are stored first; otherwise a successor may lead and they are dropped."""
        async with self._leadership_lock:
            await self._end_term(reason, flush=flush)

    async def _end_term(self, reason: str, *, flush: bool) -> None:
        """`_step_down` with the leadership lock already held."""
        if self.is_leader:
            log.warning("core %s stops leading (%s); standing by", self.settings.core_id, reason)
        self.is_leader = False
        self.metrics.is_leader.set(0)
        current = asyncio.current_task()
        for task in self._leader_tasks:
            if task is not current:
                task.cancel()
        self._leader_tasks.clear()
        self.membership.kick_all()
        self.membership.stop_watching()
        if flush:
            await self.persister.stop(self.stop_flush_s)
        else:
            await self.persister.abandon(f"core {self.settings.core_id} lost the leadership: {reason}")
        self._leader_holder = None
        await self._set_health(False)

    async def _leader_loop(self) -> None:
        last_gauges = 0.0
        failing = 0
        while self.is_leader:
            if not self.leads:
                # The lease lapsed and the keepalive has not called back yet: act on nothing
                # (a successor may be marking members and publishing plans) until it does.
                await asyncio.sleep(LOOP_INTERVAL_S)
                continue
            now = time.time()
            self.table.changed.clear()  # before the tick: what it records wakes the next one
            started = time.perf_counter()
            errors = await self._leader_tick(now)
            tick_s = time.perf_counter() - started
            if now - last_gauges >= GAUGE_INTERVAL_S:
                errors += self._guarded("gauges", self._update_gauges)
                last_gauges = now
            failing = failing + 1 if errors else 0
            if failing >= self.max_consecutive_failures:
                # Run the step-down outside this task: it cancels the leader tasks.
                asyncio.ensure_future(
                    self._give_up_leadership(
                        f"{failing} consecutive leader-loop ticks failed; last: {'; '.join(errors)}"
                    )
                )
                return
            if errors:
                # A full interval after a failed tick, so that MAX_CONSECUTIVE_FAILURES keeps
                # meaning seconds of failure, not a burst of events retried in milliseconds.
                await asyncio.sleep(LOOP_INTERVAL_S)
            else:
                await self._until_next_tick(tick_s)

    async def _until_next_tick(self, tick_s: float) -> None:
        """Sleeps until the job table changes (a loss, a transition of the engine, an ack) or
        LOOP_INTERVAL_S passes: detect -> plan -> publish takes consecutive ticks, and waiting out
        a fixed interval between each would add up to a fifth of a second to every recovery."""
        # While events stream in (thousands of agents registering), ticks may take at most a fifth
        # of the loop's time, however large the heartbeat sweep has grown.
        gap = min(LOOP_INTERVAL_S, max(MIN_TICK_GAP_S, 4 * tick_s))
        await asyncio.sleep(gap)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.table.changed.wait(), LOOP_INTERVAL_S - gap)

    async def _leader_tick(self, now: float) -> list[str]:
        """One sweep and one engine step per job; returns what failed (logged already)."""
        errors = self._guarded("heartbeat sweep", lambda: self.membership.heartbeats.sweep(now))
        for failure in await self.engine.tick_all(now):
            errors.append(f"job {failure.job}: {failure.error!r}")
        return errors

    @staticmethod
    def _guarded(what: str, step: Any) -> list[str]:
        try:
            step()
        except Exception as exc:
            log.exception("leader loop: %s failed", what)
            return [f"{what}: {exc!r}"]
        return []

    def _update_gauges(self) -> None:
        self.metrics.members.clear()
        for job in self.table.jobs.values():
            counts: dict[str, int] = {}
            for member in job.members.values():
                counts[member.state.value] = counts.get(member.state.value, 0) + 1
            for state, count in counts.items():
                self.metrics.members.labels(job=job.name, state=state).set(count)

    async def _publish_plan(self, job: str, body: bytes, expected_epoch: int) -> int:
        # The epoch- and leader-fenced compare-and-swap is etcd I/O: off the loop.
        try:
            epoch = await registry_call(
                self.registry, self.plans.publish, job, body, expected_epoch, self.persister.fence
            )
        except FenceLost as exc:
            self.persister.lost_fence(exc)  # ends the term: this Core steps down
            raise
        await self.plan_feed.notify(job)
        return epoch

    def _on_leader_key(self, event: KVEvent) -> None:
        """Registry watch thread: keeps the leader's identity at hand for "not leader" answers."""
        if event.key == self._leader_key:
            self._leader_holder = None if event.value is None else holder_of(event.value)

    async def _refresh_leader_holder(self) -> None:
        if self._election is not None:
            with contextlib.suppress(RegistryError):
                self._leader_holder = await asyncio.to_thread(self._election.leader_id)

    # ---- helpers for the services ----------------------------------------------------------------
    def run_in_background(self, work: Coroutine[Any, Any, Any]) -> None:
        """Run `work` as one of this Core's tasks: cancelled when the Core stops (seams.Background)."""
        self._tasks.append(asyncio.get_running_loop().create_task(work))

    def not_leader_message(self, api: str = "grpc") -> str:
        """What a standby answers: the leader's address for the client's own API, "grpc" (its
        gRPC host:port, which agents follow) or "http" (its REST URL)."""
        holder = self._leader_holder
        where = json.loads(holder).get(api, "unknown") if holder else "unknown"
        return f"not leader; leader is {where}"

    async def wait_durable(self) -> None:
        """Returns once every registry write queued so far (this call's included) is stored;
        raises RpcError(UNAVAILABLE) with the reason after `durable_wait_s` or on losing the lead."""
        try:
            await self.persister.wait_durable(self.durable_wait_s)
        except NotDurable as exc:
            raise RpcError(
                grpc.StatusCode.UNAVAILABLE, f"the change is not stored in the registry: {exc}"
            ) from None

    @property
    def leads(self) -> bool:
        """True while this Core leads and its leader lease is still valid by its own clock.

        `is_leader` flips only when the election's keepalive thread calls back, and that thread
        can sit in a registry call for the call's deadline (etcd: 5 s), longer than the lease TTL:
        a standby may lead by then. The election's local deadline lapses in time, so requests
        (and the leader loop) check it too and a deposed leader never answers as one."""
        return self.is_leader and (self._election is None or self._election.is_leader)

    def require_leader(self) -> None:
        if not self.leads:
            raise RpcError(grpc.StatusCode.UNAVAILABLE, self.not_leader_message())

    def job_or_not_found(self, name: str) -> Job:
        try:
            return self.table.get(name)
        except UnknownJob as exc:
            raise RpcError(grpc.StatusCode.NOT_FOUND, str(exc)) from None

    def check_job_token(self, job_name: str, token: str | None) -> None:
        """The token is checked before the job is looked up: an unknown job and a wrong token
        get the same answer, so a caller without a token learns nothing about which jobs exist."""
        if token is None:
            raise RpcError(grpc.StatusCode.UNAUTHENTICATED, "missing 'authorization: Bearer <job token>'")
        job = self.table.jobs.get(job_name)
        if job is None or not job.check_token(token):
            raise RpcError(
                grpc.StatusCode.PERMISSION_DENIED, f"unknown job {job_name!r} or wrong token for it"
            )

    def check_read_access(self, token: str | None) -> None:
        """Reads (REST GETs of jobs and events, gRPC GetJobState) follow `read_access`: "open"
        to anyone who reaches the Core, "token" with the scheduler token (docs/api.md)."""
        if self.settings.read_access == "token":
            self.check_scheduler_token(token)

    def scheduler_token_ok(self, token: str | None) -> bool:
        expected = self.settings.scheduler_token
        return (
            token is not None
            and expected is not None
            and hmac.compare_digest(token.encode(), expected.get_secret_value().encode())
        )

    def check_scheduler_token(self, token: str | None) -> None:
        if token is None:
            raise RpcError(
                grpc.StatusCode.UNAUTHENTICATED, "missing 'authorization: Bearer <scheduler token>'"
            )
        if not self.scheduler_token_ok(token):
            raise RpcError(grpc.StatusCode.PERMISSION_DENIED, "wrong scheduler token")

    def scale_table(self, job: Job) -> list[dict[str, Any]]:
        """FlexTrain's scale table, computed here on the caller's thread (bounded: a job's model
        has at most limits.MAX_DEVICES devices). The gRPC handlers run it in the planning process
        within the client's deadline instead (SchedulerServicer._plan, core_service.offload)."""
        try:
            return scale_table(job)
        except ValueError as exc:
            raise RpcError(grpc.StatusCode.FAILED_PRECONDITION, str(exc)) from None

    def send_command(self, job: str, worker_id: str, command: agent_pb2.ConnectResponse) -> bool:
        session = self.membership.sessions.get((job, worker_id))
        if session is None:
            return False
        session.outbox.put_nowait(command)
        return True
