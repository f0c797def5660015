"""The Core's watch on the job keys in the registry: liveness keys that vanish, plans stored.

A liveness key is deleted when the lease behind it expires (node loss, partition, an agent that
hangs): the worker is LOST unless it registered again meanwhile. That holds for an agent's own
lease. A lease the Core holds for an agent is never news about the worker: after a failover the
dead leader's leases expire on their own, and the agents they stood for get the reconnect grace
instead (`lease_holder`); one this Core holds for a connected agent lapses only when this Core
failed to refresh it, and is granted again.
A stored plan sends each agent whose rank it pins its device frequency (ElasWave §5.3).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Protocol

from core_service.persist import registry_call
from core_service.registry import KVEvent, Registry, RegistryError, WatchHandle
from planners.layout import Plan

if TYPE_CHECKING:
    from core_service.agent_session import AgentSession
    from core_service.jobs import Job, JobTable
    from core_service.model import MemberRecord

log = logging.getLogger("elaswave.core.membership")


class WatchedMembers(Protocol):
    """What the watch needs of `core_service.membership.Membership`."""

    table: JobTable
    registry: Registry
    sessions: dict[tuple[str, str], AgentSession]

    def mark_lost(self, job: Job, worker_id: str, reason: str, path: str, now: float) -> bool: ...

    async def regrant_lease(self, job: Job, session: AgentSession, now: float) -> None: ...

    def send_frequencies(
        self, job: Job, frequencies: dict[int, int], members: list[MemberRecord]
    ) -> None: ...


class RegistryWatch:
    """Watches the job keys while this Core leads (`start` .. `stop`); events land on its loop."""

    def __init__(self, members: WatchedMembers) -> None:
        self.members = members
        self.settings = members.table.settings
        self._watches: list[WatchHandle] = []
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        prefix = self.settings.key_prefix + "/jobs/"
        self._watches.append(self.members.registry.watch_prefix(prefix, self._on_registry_event))

    def stop(self) -> None:
        for handle in self._watches:
            handle.cancel()
        self._watches.clear()

    def _on_registry_event(self, event: KVEvent) -> None:
        parts = event.key[len(self.settings.key_prefix) + 1 :].split("/")
        if len(parts) != 4 or parts[0] != "jobs":
            return
        assert self._loop is not None
        if event.kind == "delete" and parts[2] == "alive":
            self._loop.call_soon_threadsafe(self._alive_key_deleted, parts[1], parts[3])
        elif event.kind == "put" and parts[2] == "plans" and event.value is not None:
            self._loop.call_soon_threadsafe(self._plan_stored, parts[1], event.value)

    def _plan_stored(self, job_name: str, body: bytes) -> None:
        """A plan was published: agents of the ranks it pins get their frequency."""
        job = self.members.table.jobs.get(job_name)
        if job is None:
            return
        try:
            frequencies = dict(Plan.from_json(body).new.frequencies_mhz)
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("plan of job %s has no readable layout: %s", job_name, exc)
            return
        self.members.send_frequencies(job, frequencies, job.live_members())

    def _alive_key_deleted(self, job_name: str, worker_id: str) -> None:
        if job_name in self.members.table.jobs:
            asyncio.ensure_future(self._check_alive(job_name, worker_id))

    async def _check_alive(self, job_name: str, worker_id: str) -> None:
        """A liveness key vanished: lost unless it was re-created meanwhile (a re-registration),
        or the lease behind it said nothing about the worker (see `lease_holder`)."""
        holder = self.lease_holder(job_name, worker_id)
        if holder is None:
            return
        key = self.members.table.job_key(job_name, "alive", worker_id)
        try:
            if await registry_call(self.members.registry, self.members.registry.get, key) is not None:
                return
        except RegistryError as exc:
            log.warning("cannot confirm liveness key %s: %s", key, exc)
            return
        if self.lease_holder(job_name, worker_id) != holder:
            return  # re-registered (a fresh lease) while the key was read
        job = self.members.table.jobs.get(job_name)
        if job is None:
            return
        session = self.members.sessions.get((job_name, worker_id))
        if holder[0] == "core" and session is not None:
            # This Core refreshes the lease while the stream is open, heartbeats or not (up to
            # the ceiling, where the sweep judges): only this Core can have let it lapse (its own
            # stall, a registry it could not reach), which says nothing about the worker.
            await self.members.regrant_lease(job, session, time.time())
            return
        self.members.mark_lost(job, worker_id, "liveness lease expired", "lease_expired", time.time())

    def lease_holder(self, job_name: str, worker_id: str) -> tuple[str, int] | None:
        """Who keeps the worker's liveness lease alive: ("agent", 0) for its agent's own lease,
        ("core", lease) for one this Core refreshes on the agent's heartbeats. None when nobody
        here does, so the key's deletion is no news about the worker: a lease the previous leader
        held for an agent that has not reconnected to this Core yet expires because that leader
        died. Such a worker has the reconnect grace, then the heartbeat timeout, to come back."""
        job = self.members.table.jobs.get(job_name)
        member = job.members.get(worker_id) if job is not None else None
        if member is None or member.state.is_gone:
            return None
        if member.holds_own_lease:
            return ("agent", 0)
        session = self.members.sessions.get((job_name, worker_id))
        if session is None or session.lease_id is None:
            return None
        return ("core", session.lease_id)
