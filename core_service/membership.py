"""Agent lifecycle: registration, reports, departures and the fail-stop paths
(docs/architecture.md, "The Core's decisions", detection paths).

Paths, fastest first: the agent reports the worker's exit; the agent's stream closes without a
Leave; the liveness lease expires (`core_service.registry_watch`); heartbeats stop
(`core_service.heartbeat_sweep`). Whichever fires first marks the worker LOST with its reason;
the others then find it gone. Gone members beyond a bound are compacted
(core_service.member_bounds).

The Core also tells agents the device frequency their rank should run at (SetFrequency) when a
layout carries per-rank frequencies: at registration, and whenever a new plan is stored.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import secrets

import grpc

from core_service.agent_session import AgentSession, Registration
from core_service.grpc_util import RpcError
from core_service.heartbeat_sweep import HeartbeatSweep
from core_service.jobs import Job, JobTable, parse_layout, token_digest
from core_service.liveness import ArrivalWindow
from core_service.member_bounds import RegistrationBucket, rate_limited
from core_service.metrics import CoreMetrics
from core_service.model import (
    SPARE_READY_EVENT,
    JobPhase,
    MemberRecord,
    StepReport,
    WorkerState,
)
from core_service.persist import registry_call
from core_service.registry import FenceLost, LeaseNotFound, Registry, RegistryError
from core_service.registry_watch import RegistryWatch
from wire.v1 import agent_pb2

log = logging.getLogger("elaswave.core.membership")
# gRPC metadata key an agent presents its worker's credential under when it registers again.
WORKER_TOKEN_METADATA = "x-elaswave-worker-token"


class Membership:
    def __init__(self, table: JobTable, registry: Registry, metrics: CoreMetrics) -> None:
        self.table = table
        self.registry = registry
        self.metrics = metrics
        self.settings = table.settings
        self.sessions: dict[tuple[str, str], AgentSession] = {}
        self._next_session = 1
        # Set while this Core closes every stream itself (it stops leading or shuts down): those
        # closes say nothing about the workers, and recording them as losses would make the next
        # leader plan healthy workers out before they have had time to reconnect.
        self.closing_streams = False
        self._gone_scanned: dict[str, int] = {}  # per job: gone members left by the last compaction
        self.heartbeats = HeartbeatSweep(self)  # the leader tick runs `heartbeats.sweep`
        self.watch = RegistryWatch(self)

    # ---- registration -------------------------------------------------------------------------
    def member_limit(self, job: Job) -> int:
        """Live members a job may have: its expected workers plus its spares plus the workers
        accepted offers admitted, or the Core's bound for a job that did not say how many it expects."""
        if job.expected_workers > 0:
            return job.expected_workers + job.spare_workers + job.offered_workers
        return self.settings.max_workers_per_job

    def admit(self, job: Job, reg: Registration, presented: str | None, now: float) -> str:
        """The worker's credential for this registration, or RpcError. A live member's id is
        registered again only with its own credential (a reconnect, a new leader): from anyone
        else it is refused, never a takeover. A new (or returning) worker gets a new credential,
        within the job's member limit. Synchronous: no other registration interleaves."""
        member = job.members.get(reg.worker_id)
        if member is not None and not member.state.is_gone:
            if not member.worker_token_sha256:
                return secrets.token_urlsafe(24)  # a member from a Core that issued none
            if presented is not None and hmac.compare_digest(
                token_digest(presented), member.worker_token_sha256
            ):
                return presented
            raise RpcError(
                grpc.StatusCode.ALREADY_EXISTS,
                f"worker {reg.worker_id!r} of job {job.name!r} is a live member (on host "
                f"{member.host!r}); registering it again needs its own credential "
                f"('{WORKER_TOKEN_METADATA}' metadata from its RegisterAck)",
            )
        if job.phase.terminal:
            why = "every worker finished" if job.phase is JobPhase.COMPLETED else job.end_reason
            raise RpcError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"job {job.name!r} is {job.phase.value} ({why}): worker {reg.worker_id!r} refused",
            )
        limit = self.member_limit(job)
        # Counting live members is O(members): only needed once there could be too many.
        live = len(job.members) if len(job.members) < limit else len(job.live_members())
        if live >= limit:
            raise RpcError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"job {job.name!r} has {live} live workers, its limit (expected_workers "
                f"{job.expected_workers} + spare_workers {job.spare_workers} + offered "
                f"{job.offered_workers}, or the Core's "
                f"max_workers_per_job) is {limit}: worker {reg.worker_id!r} refused",
            )
        self._take_registration(job, reg.worker_id, now)
        return secrets.token_urlsafe(24)

    def _take_registration(self, job: Job, worker_id: str, now: float) -> None:
        """A new (or returning) worker id passes the job token's rate limit, or RpcError
        (RESOURCE_EXHAUSTED saying when to retry). Reconnects of live members never get here."""
        # A job may always register the workers it declared at once (a start, a restart of them
        # all): only registrations beyond that, or beyond the Core's burst, wait for the rate.
        declared = self.member_limit(job) if job.expected_workers > 0 else 0
        burst = max(self.settings.registration_burst, declared)
        bucket = job.registrations
        if bucket is None:
            bucket = RegistrationBucket(self.settings.registrations_per_s, burst, now)
            job.registrations = bucket
        bucket.burst = burst
        retry_s = bucket.take(now)
        if retry_s > 0.0:
            self.metrics.registrations_refused.inc()
            raise rate_limited(job.name, worker_id, bucket, retry_s)

    async def register(self, reg: Registration, now: float, presented: str | None = None) -> AgentSession:
        """Registers the worker (see `admit`); the session carries the worker's credential."""
        job = self.table.get(reg.job)
        worker_token = self.admit(job, reg, presented, now)
        old = self.sessions.get((reg.job, reg.worker_id))
        if old is not None:
            await self._drop_lease(old)
        session = AgentSession(
            reg.job, reg.worker_id, self._next_session, worker_token=worker_token, arrivals=self._window(now)
        )
        self._next_session += 1
        self.sessions[(reg.job, reg.worker_id)] = session
        member = job.members.get(reg.worker_id)
        rejoined = member is not None and member.state.is_gone
        reconnected = member is not None and not member.state.is_gone
        # Rank -1 into a job with a layout: a spare, which a plan may take in (Plan.joiners). It
        # stays JOINING until its worker subscribes to plans (`mark_spare_ready`): planned in
        # before its process can join, it would hold every survivor at the group build while it
        # starts (seconds of a Python process importing torch).
        spare = job.layout_json is not None and reg.rank < 0
        if member is None or rejoined:
            member = MemberRecord(reg.worker_id, reg.host, reg.pid, registered_unix=now)
            job.members[reg.worker_id] = member
            job.gone.returned(reg.worker_id)
        member.host, member.pid, member.devices = reg.host, reg.pid, reg.devices
        member.worker_token_sha256 = token_digest(worker_token)
        member.holds_own_lease = reg.holds_own_lease
        # A spare taken in keeps the rank its plan gave it when its agent (still saying -1) reconnects.
        if not (reconnected and reg.rank < 0 and member.rank >= 0):
            member.stage, member.dp_rank, member.rank = reg.stage, reg.dp_rank, reg.rank
        member.last_heartbeat_unix = now
        member.heartbeat_late_since_unix = None
        if not reg.holds_own_lease:
            try:
                await self._grant_lease(job, session, now)
            except BaseException:
                # No stream will serve this session: leave no session behind that commands
                # would be queued on and never delivered.
                if self.sessions.get((reg.job, reg.worker_id)) is session:
                    del self.sessions[(reg.job, reg.worker_id)]
                raise
        if job.layout_json is not None:
            self.send_frequencies(job, self._frequencies(job), [member])
        self.table.save_member(job, member)
        kind = "worker_reconnected" if reconnected else ("worker_rejoined" if rejoined else "worker_joined")
        if spare and not reconnected:
            kind = "spare_registered"  # a change to plan for once its worker is ready
            self._use_offer(job, reg.host)
        self.table.record(
            job,
            kind,
            worker_id=reg.worker_id,
            detail=f"host={reg.host} pid={reg.pid}",
            now=now,
            membership_change=not reconnected and not spare,
        )
        self.metrics.agent_streams.set(len(self.sessions))
        return session

    def _window(self, now: float) -> ArrivalWindow:
        return ArrivalWindow(
            floor_s=self.settings.heartbeat_timeout_s,
            ceiling_s=self.settings.heartbeat_ceiling,
            phi=self.settings.heartbeat_phi,
            window=self.settings.heartbeat_window,
            start=now,
        )

    def _use_offer(self, job: Job, host: str) -> None:
        """A spare registered from `host`: one device an accepted offer admitted there is used."""
        key = host if job.offered_hosts.get(host, 0) > 0 else ""
        if job.offered_hosts.get(key, 0) <= 0:
            return
        job.offered_hosts[key] -= 1
        if not job.offered_hosts[key]:
            del job.offered_hosts[key]
        self.table.save_spec(job)

    def mark_spare_ready(self, job: Job, worker_id: str, now: float) -> bool:
        """A registered spare's worker subscribed to plans: it can join now, so it becomes a
        SPARE and a change to plan for (the policy may take it in). False when `worker_id` is no
        waiting spare (a member of the layout, a spare already ready, a worker gone)."""
        member = job.members.get(worker_id)
        if (
            member is None
            or member.state is not WorkerState.JOINING
            or member.rank >= 0
            or job.layout_json is None
        ):
            return False
        member.state = WorkerState.SPARE
        member.state_changed_unix = now
        self.table.save_member(job, member)
        self.table.record(
            job,
            SPARE_READY_EVENT,
            worker_id=worker_id,
            detail="its worker subscribed to plans",
            now=now,
            membership_change=True,
        )
        return True

    # ---- commands to agents --------------------------------------------------------------------
    def send(self, job: str, worker_id: str, command: agent_pb2.ConnectResponse) -> bool:
        """Queues `command` on the worker's live stream; False when it has none on this Core."""
        session = self.sessions.get((job, worker_id))
        if session is None:
            return False
        session.outbox.put_nowait(command)
        self.metrics.agent_commands.labels(command=command.WhichOneof("body") or "empty").inc()
        return True

    def _frequencies(self, job: Job) -> dict[int, int]:
        """The frequencies the job's current layout pins (parsed once per layout, by the job)."""
        parsed = job.parsed_layout()
        return {} if parsed is None else parsed.frequencies_mhz

    def send_frequencies(self, job: Job, frequencies: dict[int, int], members: list[MemberRecord]) -> None:
        """SetFrequency to each of `members` whose rank the layout pins (DVFS for stragglers,
        ElasWave §5.3); 0 MHz restores the device default."""
        if not frequencies:
            return
        for member in members:
            mhz = frequencies.get(member.rank) if member.rank >= 0 else None
            if mhz is not None:
                command = agent_pb2.ConnectResponse(set_frequency=agent_pb2.SetFrequency(mhz=mhz))
                self.send(job.name, member.worker_id, command)

    async def _grant_lease(self, job: Job, session: AgentSession, now: float) -> None:
        ttl = self.settings.lease_ttl_s
        key = self.table.job_key(job.name, "alive", session.worker_id)
        value = json.dumps({"core": self.settings.core_id, "session": session.session_id}).encode()
        lease = await registry_call(self.registry, self.registry.grant_lease, ttl)
        fence = self.table.persister.fence
        try:
            if fence is None:
                await registry_call(self.registry, self.registry.put, key, value, lease)
            else:
                # A deposed leader must not re-point a worker's liveness key at its own lease.
                await registry_call(self.registry, self.registry.put_fenced, fence, key, value, lease)
        except FenceLost as exc:
            self.table.persister.lost_fence(exc)  # ends the term: this Core steps down
            with contextlib.suppress(RegistryError):
                await registry_call(self.registry, self.registry.revoke_lease, lease)
            raise
        session.lease_id, session.lease_refreshed = lease, now

    async def regrant_lease(self, job: Job, session: AgentSession, now: float) -> None:
        """The lease this Core held for `session` lapsed while its stream is open (see
        `RegistryWatch._check_alive`): grants a new one, so the liveness key is back."""
        member = job.members.get(session.worker_id)
        current = self.sessions.get((session.job, session.worker_id)) is session
        if not current or member is None or member.state.is_gone:
            return
        self.metrics.lease_regrants.inc()
        log.warning(
            "job %s worker %s: the liveness lease this Core held for it lapsed while its stream is "
            "open (this Core did not refresh it in time); granting a new one",
            job.name,
            session.worker_id,
        )
        try:
            await self._grant_lease(job, session, now)
        except RegistryError as exc:  # the next heartbeat's refresh grants it (refresh_lease)
            log.warning("granting the liveness lease of %s/%s again: %s", job.name, session.worker_id, exc)

    async def _drop_lease(self, session: AgentSession) -> None:
        if session.lease_id is None:
            return
        lease, session.lease_id = session.lease_id, None
        try:
            await registry_call(self.registry, self.registry.revoke_lease, lease)
        except RegistryError as exc:
            log.debug("revoking lease %s: %s", lease, exc)

    # ---- reports ------------------------------------------------------------------------------
    async def heartbeat(self, session: AgentSession, now: float, job: Job | None = None) -> None:
        job = self.table.get(session.job) if job is None else job
        member = job.member(session.worker_id)
        member.last_heartbeat_unix = now
        if session.arrivals is not None:
            session.arrivals.record(now)
        if member.heartbeat_late_since_unix is not None:
            self._on_time(job, member, now)
        if member.state.is_gone or session.lease_id is None:
            return
        await self.refresh_lease(job, session, now)

    async def refresh_lease(self, job: Job, session: AgentSession, now: float, force: bool = False) -> None:
        """Keeps the Core-held liveness lease alive (at most every third of its TTL, unless `force`)."""
        if session.lease_id is None:
            return
        if not force and now - session.lease_refreshed < self.settings.lease_ttl_s / 3:
            return
        session.lease_refreshed = now
        try:
            await registry_call(self.registry, self.registry.refresh_lease, session.lease_id)
        except LeaseNotFound:
            if self.sessions.get((session.job, session.worker_id)) is session:  # not closed meanwhile
                await self._grant_lease(job, session, now)
        except RegistryError as exc:
            log.warning("refreshing the liveness lease of %s/%s: %s", job.name, session.worker_id, exc)

    def _on_time(self, job: Job, member: MemberRecord, now: float) -> None:
        """A late worker's heartbeat arrived: the note is cleared and the episode recorded."""
        since, member.heartbeat_late_since_unix = member.heartbeat_late_since_unix, None
        late_s = now - (since if since is not None else now)
        self.table.record(
            job,
            "heartbeat_on_time",
            worker_id=member.worker_id,
            detail=f"heartbeat after {late_s:.2f}s late",
            now=now,
        )

    def step(self, session: AgentSession, report: StepReport) -> None:
        job = self.table.get(session.job)
        member = job.member(session.worker_id)
        member.last_step = report
        # Progress survives a takeover: the member (with its last step) is stored at most every
        # progress_persist_s; state changes store it too (issue 27: members read 0 after one).
        if report.received_unix - session.progress_saved_unix >= self.settings.progress_persist_s:
            session.progress_saved_unix = report.received_unix
            self.table.save_member(job, member)
        if report.checkpoint:
            self.checkpoint_written(job, member.worker_id, report.checkpoint, report.received_unix)
        member.stage, member.dp_rank = report.stage, report.dp_rank
        # Any step report, not only a member's first: after a takeover the stored member can hold
        # a step and still say JOINING (the leader died between storing the step and storing the
        # state change), and it must not stay JOINING while it trains.
        if member.state == WorkerState.JOINING:
            self.table.set_state(
                job,
                member,
                WorkerState.RUNNING,
                f"step {report.step} reported",
                now=report.received_unix,
                kind="worker_running",
            )
        transition = job.failslow.observe(member.worker_id, report.stage, report.own_time_s)
        if transition is None or member.state.is_gone:
            return
        if transition.slow:
            self.metrics.failures_detected.labels(path="fail_slow").inc()
            self.table.set_state(
                job, member, WorkerState.SLOW, transition.reason, now=report.received_unix, kind="worker_slow"
            )
        elif member.state == WorkerState.SLOW:
            self.table.set_state(
                job,
                member,
                WorkerState.RUNNING,
                transition.reason,
                now=report.received_unix,
                kind="worker_recovered",
            )

    def checkpoint_written(self, job: Job, worker_id: str, path: str, now: float) -> None:
        """A worker completed checkpoint `path` (a requested one, a periodic one, the final one):
        the job's latest checkpoint, recorded once per checkpoint (`checkpoint_written`)."""
        if path == job.latest_checkpoint:
            return
        job.latest_checkpoint = path
        self.table.save_spec(job)  # a new leader, and a job that ends FAILED, know where to resume
        self.table.record(
            job, "checkpoint_written", worker_id=worker_id, detail=path, now=now, data={"checkpoint": path}
        )

    def preemption(self, job: Job, member: MemberRecord, deadline: float, source: str, now: float) -> None:
        if member.state is not WorkerState.PREEMPTING:
            self.metrics.departures.labels(kind="preempted").inc()
        member.preemption_deadline_unix = deadline
        self.table.set_state(
            job,
            member,
            WorkerState.PREEMPTING,
            f"preemption signalled by {source}; gone by {deadline:.3f}",
            now=now,
            kind="worker_preempting",
        )

    # ---- fail-stop paths ----------------------------------------------------------------------
    def mark_lost(self, job: Job, worker_id: str, reason: str, path: str, now: float) -> bool:
        member = job.members.get(worker_id)
        if member is None or member.state.is_gone:
            return False
        self.metrics.failures_detected.labels(path=path).inc()
        since = max(0.0, now - member.last_heartbeat_unix)
        self.metrics.detection_gap.observe(since)
        self.table.set_state(job, member, WorkerState.LOST, reason, now=now, kind="worker_lost")
        return True

    async def leave(
        self, session: AgentSession, reason: str, now: float, finished: bool = False, checkpoint: str = ""
    ) -> None:
        """A clean departure; `finished`: the worker completed its work, and `checkpoint` is where
        it says the final checkpoint is (the job is COMPLETED once every worker finished)."""
        job = self.table.get(session.job)
        member = job.member(session.worker_id)
        if finished and not member.state.is_gone:
            member.finished, member.checkpoint = True, checkpoint
        if checkpoint:  # a stop on request: its checkpoint is reported with the Leave
            self.checkpoint_written(job, member.worker_id, checkpoint, now)
        if not member.state.is_gone and member.state not in (WorkerState.PREEMPTING, WorkerState.DRAINING):
            self.metrics.departures.labels(kind="finished" if finished else "left").inc()
        # A worker that completed its work takes nothing from the job: the others finish theirs too,
        # so re-planning for it would only reshuffle a job that is ending.
        self.table.set_state(
            job,
            member,
            WorkerState.LEFT,
            reason or "left cleanly",
            now=now,
            kind="worker_finished" if finished else "worker_left",
            planned=finished,
        )
        await self.close_session(session, now, clean=True)

    async def close_session(self, session: AgentSession, now: float, *, clean: bool) -> None:
        """The stream of `session` ended; without a clean Leave that is a fail-stop signal."""
        if self.sessions.get((session.job, session.worker_id)) is not session:
            return  # a newer stream of the same worker took over
        del self.sessions[(session.job, session.worker_id)]
        self.metrics.agent_streams.set(len(self.sessions))
        if not clean and not self.closing_streams:
            job = self.table.get(session.job)
            self.mark_lost(job, session.worker_id, "agent stream closed without leave", "stream_closed", now)
        await self._drop_lease(session)

    # ---- bounded state ------------------------------------------------------------------------
    def compact(self, job: Job) -> int:
        """Removes the oldest gone members beyond `gone_members_kept` from the job and the
        registry (their events stay in the bounded event log); returns how many. Never removed:
        a member with a stream still open on this Core (its agent may still report on it), and
        for each rank of the current or committed layout the newest gone member that held it
        (the one the layout references; older holders of the rank, such as ghosts claiming it,
        are not, so they cannot grow the job either)."""
        keep = self.settings.gone_members_kept
        # Protected members may hold the count above the bound: rescan only once more have gone
        # (this runs on every leader tick, and a scan parses the layouts' ranks).
        if len(job.gone) <= max(keep, self._gone_scanned.get(job.name, 0)):
            return 0
        ranks = self._referenced_ranks(job)
        newest: dict[int, str] = {}
        for worker_id in job.gone:  # oldest first: the last one seen per rank is the newest
            member = job.members.get(worker_id)
            if member is not None and member.rank in ranks:
                newest[member.rank] = worker_id
        referenced = set(newest.values())

        def protected(worker_id: str) -> bool:
            return worker_id in referenced or (job.name, worker_id) in self.sessions

        removed = job.gone.overflow(keep, protected)
        for worker_id in removed:
            job.gone.returned(worker_id)
            if job.members.pop(worker_id, None) is not None:
                self.table.persister.delete(self.table.job_key(job.name, "members", worker_id))
        self.metrics.members_compacted.inc(len(removed))
        self._gone_scanned[job.name] = len(job.gone)
        return len(removed)

    @staticmethod
    def _referenced_ranks(job: Job) -> frozenset[int]:
        """Ranks of the job's current and committed layouts (empty for a job without one)."""
        ranks: set[int] = set()
        for raw in (job.layout_json, job.committed_layout_json):
            if raw is None:
                continue
            try:
                ranks.update(parse_layout(raw).ranks())
            except (ValueError, KeyError, TypeError):
                continue
        return frozenset(ranks)

    # ---- terms -------------------------------------------------------------------------------
    def start_watching(self, loop: asyncio.AbstractEventLoop) -> None:
        """This Core leads (again): sweep and watch the members it loaded."""
        self.closing_streams = False  # a new term: a stream that closes now is a signal again
        self.heartbeats.reset()
        self._gone_scanned.clear()  # the gone members were reloaded in a new order
        self.watch.start(loop)

    def kick_all(self) -> None:
        """Closes every agent stream (this Core stopped leading); agents reconnect elsewhere."""
        self.closing_streams = True
        for session in self.sessions.values():
            if session.handler is not None:
                session.handler.cancel()

    def stop_watching(self) -> None:
        self.watch.stop()
