"""The leader's sweep over heartbeats: nudge, note late, or mark lost (docs/architecture.md, "The
Core's decisions", detection paths).

Heartbeats are judged against each stream's own adaptive deadline (core_service.liveness). A
worker silent for half its deadline is sent one ReportNow, so a merely slow agent answers before
it is judged. A worker past its deadline whose stream is open on this Core is *late* (noted, its
Core-held lease kept alive), never LOST, unless its silence reaches the ceiling; only a worker
with no stream here is LOST at its deadline.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Protocol

from wire.v1 import agent_pb2

if TYPE_CHECKING:
    from core_service.agent_session import AgentSession
    from core_service.jobs import Job, JobTable
    from core_service.metrics import CoreMetrics
    from core_service.model import MemberRecord

log = logging.getLogger("elaswave.core.membership")
# Sweeps further apart than this mean the Core's own loop stalled (a loaded machine, a long GC):
# heartbeats that arrived meanwhile wait in it uncounted, so that sweep judges nobody.
SWEEP_STALL_S = 1.0


class SweptMembers(Protocol):
    """What the sweep needs of `core_service.membership.Membership`."""

    table: JobTable
    metrics: CoreMetrics
    sessions: dict[tuple[str, str], AgentSession]

    def compact(self, job: Job) -> int: ...

    def mark_lost(self, job: Job, worker_id: str, reason: str, path: str, now: float) -> bool: ...

    def send(self, job: str, worker_id: str, command: agent_pb2.ConnectResponse) -> bool: ...

    async def refresh_lease(
        self, job: Job, session: AgentSession, now: float, force: bool = False
    ) -> None: ...


class HeartbeatSweep:
    """Judges the live members' silences on each leader tick (`sweep`); one per Core."""

    def __init__(self, members: SweptMembers) -> None:
        self.members = members
        self.settings = members.table.settings
        # Per job: no live member can be due for a nudge or a loss before this time (see
        # `sweep`); the leader tick skips the job's scan until then.
        self._due: dict[str, float] = {}
        self._last_sweep: float | None = None

    def reset(self) -> None:
        """A new term: members were reloaded with heartbeats of their own."""
        self._due.clear()
        self._last_sweep = None

    def sweep(self, now: float) -> None:
        """Compacts gone members beyond the bound, nudges members silent for half their
        deadline, notes late ones and marks lost those that nothing else keeps alive.

        The leader ticks up to a few hundred times a second while events stream in, and scanning
        10,000 members each time took a fifth of the Core's loop. A heartbeat only moves a
        member's last_heartbeat_unix forward and a (re)registration sets it to the present, so
        no member can become due before the earliest due time the previous scan saw: until
        then the job is skipped, and a job with members beating at 1 Hz is scanned about once
        a second (one heap entry per heartbeat would cost every report instead)."""
        last, self._last_sweep = self._last_sweep, now
        if last is not None and now - last > SWEEP_STALL_S:
            # This Core's loop stalled: heartbeats that arrived meanwhile are still queued in it.
            # Judging silences now would blame the workers for the Core's own pause.
            log.warning("heartbeat sweep %.2fs after the last one: judging nobody this time", now - last)
            self._due.clear()
            return
        floor = self.settings.heartbeat_timeout_s
        for job in self.members.table.jobs.values():
            self.members.compact(job)
            if now < self._due.get(job.name, 0.0):
                continue
            due = now + floor / 2  # the earliest a member registering from now on can be due
            for member in job.live_members():
                due = min(due, self._judge(job, member, now))
            self._due[job.name] = due

    def _judge(self, job: Job, member: MemberRecord, now: float) -> float:
        """Acts on one live member's silence; returns when it next needs looking at."""
        session = self.members.sessions.get((job.name, member.worker_id))
        arrivals = session.arrivals if session is not None else None
        deadline = arrivals.deadline_s() if arrivals is not None else self.settings.heartbeat_timeout_s
        ceiling = self.settings.heartbeat_ceiling
        last = member.last_heartbeat_unix
        silent = now - last
        if session is not None and silent > deadline / 2 and silent <= ceiling:
            self._keep_lease(job, session, now)
        if silent <= deadline / 2:
            due = last + deadline / 2
        elif silent <= deadline:
            self._nudge(job, member)
            due = last + deadline
        elif session is None or silent > ceiling:
            # No stream on this Core (a takeover's reconnect window ran out), or a stream open but
            # silent past the ceiling (a hung agent): nothing says this worker is alive.
            where = "no agent stream on this Core" if session is None else f"past the {ceiling:g}s ceiling"
            self.members.mark_lost(
                job, member.worker_id, f"no heartbeat for {silent:.2f}s ({where})", "heartbeat", now
            )
            return now + deadline
        else:
            self._nudge(job, member)
            self._mark_late(job, member, session, silent, deadline, now)
            due = last + ceiling
        if session is not None and session.lease_id is not None and silent > deadline / 2:
            due = min(due, session.lease_refreshed + self.settings.lease_ttl_s / 3)
        return due

    def _keep_lease(self, job: Job, session: AgentSession, now: float) -> None:
        """Heartbeats are overdue but the stream is open: the Core-held lease is kept alive
        meanwhile (heartbeats refresh it otherwise), so that its expiry only ever means that this
        Core is gone, never that a loaded agent was slow."""
        if session.lease_id is not None and now - session.lease_refreshed >= self.settings.lease_ttl_s / 3:
            session.lease_refreshed = now  # one refresh in flight at a time
            asyncio.ensure_future(self.members.refresh_lease(job, session, now, force=True))

    def _mark_late(
        self,
        job: Job,
        member: MemberRecord,
        session: AgentSession,
        silent: float,
        deadline: float,
        now: float,
    ) -> None:
        """Heartbeats are past the deadline but the stream is open (and an agent's own lease is
        alive, or its expiry would have said otherwise): a slow agent, not a dead one. Noted once
        per episode, with an event and elaswave_heartbeats_late_total."""
        if member.heartbeat_late_since_unix is not None:
            return
        member.heartbeat_late_since_unix = now
        self.members.metrics.heartbeats_late.inc()
        phi = session.arrivals.suspicion(silent) if session.arrivals is not None else 0.0
        self.members.table.record(
            job,
            "heartbeat_late",
            worker_id=member.worker_id,
            detail=f"no heartbeat for {silent:.2f}s (deadline {deadline:.2f}s, phi {phi:.1f}); stream "
            "open: late, not lost",
            now=now,
        )

    def _nudge(self, job: Job, member: MemberRecord) -> None:
        """Half the deadline without a heartbeat: ask the agent to report now, once per silence."""
        session = self.members.sessions.get((job.name, member.worker_id))
        if session is None or session.nudged_for_heartbeat == member.last_heartbeat_unix:
            return
        session.nudged_for_heartbeat = member.last_heartbeat_unix
        self.members.send(
            job.name, member.worker_id, agent_pb2.ConnectResponse(report_now=agent_pb2.ReportNow())
        )
