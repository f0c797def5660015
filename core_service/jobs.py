"""The Core's in-memory view of jobs and members, persisted to the registry in order.

All mutation happens on the asyncio loop thread, so each method is atomic with respect to other
coroutines. Registry writes go through `Persister`, one ordered queue drained by a background task
(etcd calls never block the loop); a mutating API call waits for them (`Persister.wait_durable`)
before it answers. A standby that takes over reloads everything from the registry.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import hmac
import json
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from core_service.config import JOB_NAME_PATTERN, CoreSettings, JobSpec
from core_service.failslow import FailSlowDetector
from core_service.member_bounds import GoneMembers, RegistrationBucket
from core_service.model import Ack, Event, JobPhase, MemberRecord, Recovery, WorkerState
from core_service.persist import Persister
from core_service.recovery_record import RecoveryRecords, parse_recovery
from core_service.registry import Registry
from planners.layout import Layout, Plan
from planners.reprotect import ReprotectWindow

log = logging.getLogger("elaswave.core.jobs")


class UnknownJob(LookupError):
    def __init__(self, job: str) -> None:
        super().__init__(f"unknown job {job!r}")


class UnknownWorker(LookupError):
    def __init__(self, job: str, worker_id: str) -> None:
        super().__init__(f"job {job!r} has no worker {worker_id!r}")


class JobExists(ValueError):
    def __init__(self, job: str) -> None:
        super().__init__(f"job {job!r} already exists")


def token_digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


@dataclass(frozen=True)
class ParsedLayout:
    """A job's layout JSON parsed, with what the Core looks up in it on hot paths."""

    source: str  # the layout_json it was parsed from (compared by identity)
    layout: Layout
    ranks: frozenset[int]
    frequencies_mhz: dict[int, int]  # rank -> MHz the layout pins (DVFS)


@dataclass
class Job:
    name: str
    token_sha256: str
    expected_workers: int
    created_unix: float
    failslow: FailSlowDetector
    spare_workers: int = 0  # registrations accepted beyond expected_workers
    # Bounds on the ranks of any plan (0: unset; config.JobSpec), and the workers accepted
    # offers admitted (SchedulerService.OfferResources): they register as spares.
    min_workers: int = 0
    max_workers: int = 0
    offered_workers: int = 0
    # Per host ("" for offers naming none): devices accepted offers admitted that no worker from
    # that host has used yet (registered as a spare). Another offer for such a host is refused.
    offered_hosts: dict[str, int] = field(default_factory=dict)
    # The layout the job was created with: the fault-free shape joins return to.
    original_layout_json: str | None = None
    # Set once every worker of the layout finished (JobPhase.COMPLETED), with the final
    # checkpoint they reported ("" when none); persisted in the spec so a new leader keeps it.
    completed_unix: float | None = None
    final_checkpoint: str = ""
    # FAILED (no plan possible with every worker gone) or STOPPED (ended on request): when, and
    # why; persisted in the spec like COMPLETED. `latest_checkpoint`: the newest checkpoint the
    # workers reported writing ("" when none), where a new job resumes from.
    ended_unix: float | None = None
    end_phase: str = ""
    end_reason: str = ""
    latest_checkpoint: str = ""
    # A member went (finished, left, lost): the engine checks whether the job is complete.
    check_completion: bool = False
    members: dict[str, MemberRecord] = field(default_factory=dict)
    # The LOST and LEFT members, oldest first (compacted beyond gone_members_kept), and the job
    # token's registration rate limit (created on the first registration).
    gone: GoneMembers = field(default_factory=GoneMembers)
    registrations: RegistrationBucket | None = None
    phase: JobPhase = JobPhase.RUNNING
    plan_epoch: int = 0
    next_seq: int = 1
    events: deque[Event] = field(default_factory=lambda: deque(maxlen=10_000))
    # The newest published layout with every going rank planned out: what policies plan from.
    layout_json: str | None = None
    model_json: str | None = None  # the job's model and profile (`elaswave plan` state.json)
    # The job's rendezvous stores ("host:port", in the order the workers try them), run beside the
    # job by its launchers (elaswave.store_keeper), never by a Core: in the spec, so that any Core
    # that leads finds them (a node joining later is told them).
    stores: tuple[str, ...] = ()
    # The layout of the newest epoch on which a step committed (the creation layout before any):
    # executors go back to it when an apply is interrupted, so every plan's `old` is this layout
    # and applicability is judged from it (docs/architecture.md ("The Core's decisions")).
    committed_layout_json: str | None = None
    committed_epoch: int = 0
    last_plan: Plan | None = None  # the newest published plan (its epoch is `plan_epoch`)
    recovery: Recovery = field(default_factory=Recovery)
    # Set by membership changes; the schedule engine clears it when it plans.
    pending_changes: list[Event] = field(default_factory=list)
    acks: dict[int, dict[str, Ack]] = field(default_factory=dict)  # epoch -> worker -> last ack
    # Plan epoch -> the backup copies its layout re-seeds in the background and the steps they
    # are missing, as the workers reported them (core_service.backup_windows); in memory only.
    backup_windows: dict[int, ReprotectWindow] = field(default_factory=dict)
    # What settles optional plans (planners.elaswave_payback): the step each unit last moved at,
    # and how long the last applied plan paused the job (None before one was applied).
    unit_moved_at: dict[int, int] = field(default_factory=dict)
    plan_pause_s: float | None = None
    _parsed: ParsedLayout | None = field(default=None, repr=False, compare=False)

    def check_token(self, presented: str) -> bool:
        return hmac.compare_digest(token_digest(presented), self.token_sha256)

    def member(self, worker_id: str) -> MemberRecord:
        try:
            return self.members[worker_id]
        except KeyError:
            raise UnknownWorker(self.name, worker_id) from None

    def live_members(self) -> list[MemberRecord]:
        return [m for m in self.members.values() if not m.state.is_gone]

    def parsed_layout(self) -> ParsedLayout | None:
        """The current layout, parsed once per layout (None without one); raises ValueError (or
        KeyError/TypeError) for a layout that cannot be read."""
        if self.layout_json is None:
            return None
        cached = self._parsed
        if cached is None or cached.source is not self.layout_json:
            layout = Layout.from_json(self.layout_json)
            cached = ParsedLayout(
                self.layout_json, layout, frozenset(layout.ranks()), dict(layout.frequencies_mhz)
            )
            self._parsed = cached
        return cached

    def in_layout(self, member: MemberRecord) -> bool:
        """Whether the current layout still holds `member`'s rank (True without a layout or a rank:
        then every member counts). A rank a published plan removed is planned for already."""
        if member.rank < 0:
            return True
        try:
            parsed = self.parsed_layout()
        except (ValueError, KeyError, TypeError):
            return True  # unreadable: count every member, as without a layout
        return parsed is None or member.rank in parsed.ranks

    @property
    def work_done(self) -> bool:
        """Whether a worker of the layout finished the job's work. A worker finishes only after
        the job's last step committed, and a step commits on every rank of the layout: from then
        on a loss takes nothing from the job (no plan; the job completes without that worker)."""
        return any(m.finished and self.in_layout(m) for m in self.members.values() if m.rank >= 0)

    def is_spare(self, member: MemberRecord) -> bool:
        return member.state is WorkerState.SPARE

    def rank_limit(self) -> tuple[int, int]:
        """(fewest, most) ranks a plan may have: min_workers (1 when unset), and max_workers or,
        unset, the creation layout's ranks plus the workers accepted offers admitted."""
        most = self.max_workers
        if not most:
            original = self.original_layout()
            most = (len(original.ranks()) if original is not None else 0) + self.offered_workers
        return max(1, self.min_workers), most

    def original_layout(self) -> Layout | None:
        return None if self.original_layout_json is None else parse_layout(self.original_layout_json)

    def spec_json(self) -> bytes:
        return json.dumps(
            {
                "name": self.name,
                "token_sha256": self.token_sha256,
                "expected_workers": self.expected_workers,
                "spare_workers": self.spare_workers,
                "min_workers": self.min_workers,
                "max_workers": self.max_workers,
                "offered_workers": self.offered_workers,
                "offered_hosts": self.offered_hosts,
                "created_unix": self.created_unix,
                # The creation layout: a new leader starts from it until it restores the plans.
                "layout_json": self.original_layout_json or self.layout_json,
                "model_json": self.model_json,
                "completed_unix": self.completed_unix,
                "final_checkpoint": self.final_checkpoint,
                "ended_unix": self.ended_unix,
                "end_phase": self.end_phase,
                "end_reason": self.end_reason,
                "latest_checkpoint": self.latest_checkpoint,
                "stores": list(self.stores),
            },
            sort_keys=True,
        ).encode()


class JobTable:
    """Jobs, members and events, with the registry key layout of core_service.registry.base."""

    def __init__(self, settings: CoreSettings, registry: Registry, persister: Persister) -> None:
        self.settings = settings
        self.registry = registry
        self.persister = persister
        self.jobs: dict[str, Job] = {}
        self.changed = asyncio.Event()
        self.recovery_records = RecoveryRecords()

    # ---- keys -------------------------------------------------------------------------------
    def job_key(self, job: str, *parts: str) -> str:
        return "/".join([self.settings.key_prefix, "jobs", job, *parts])

    # ---- jobs -------------------------------------------------------------------------------
    def get(self, job: str) -> Job:
        try:
            return self.jobs[job]
        except KeyError:
            raise UnknownJob(job) from None

    def create_job(
        self,
        spec: JobSpec,
        layout_json: str | None = None,
        *,
        now: float,
        model_json: str | None = None,
        stores: tuple[str, ...] = (),
    ) -> Job:
        if not JOB_NAME_PATTERN.match(spec.name):
            raise ValueError(f"job name {spec.name!r} is not valid")
        if spec.name in self.jobs:
            raise JobExists(spec.name)
        job = self._new_job(
            spec.name, token_digest(spec.token.get_secret_value()), spec.expected_workers, now
        )
        job.layout_json, job.model_json, job.stores = layout_json, model_json, stores
        job.spare_workers = spec.spare_workers
        job.min_workers, job.max_workers = spec.min_workers, spec.max_workers
        job.original_layout_json = layout_json
        job.committed_layout_json = layout_json
        self.jobs[job.name] = job
        self.persister.put(self.job_key(job.name, "spec"), job.spec_json())
        self.record(job, "job_created", detail=f"expects {spec.expected_workers} workers", now=now)
        return job

    def _new_job(self, name: str, digest: str, expected: int, created: float) -> Job:
        job = Job(name, digest, expected, created, FailSlowDetector(self.settings.failslow))
        job.events = deque(maxlen=self.settings.events_kept)
        return job

    def ensure_configured_jobs(self, now: float) -> None:
        """Jobs listed in the settings exist (their token follows the settings)."""
        for spec in self.settings.jobs:
            existing = self.jobs.get(spec.name)
            if existing is None:
                self.create_job(spec, now=now)
            else:
                existing.token_sha256 = token_digest(spec.token.get_secret_value())
                existing.spare_workers = spec.spare_workers
                existing.min_workers, existing.max_workers = spec.min_workers, spec.max_workers
                self.persister.put(self.job_key(spec.name, "spec"), existing.spec_json())

    def save_spec(self, job: Job) -> None:
        self.persister.put(self.job_key(job.name, "spec"), job.spec_json())

    def save_recovery(self, job: Job) -> None:
        """Stores the job's retry bounds and committed epoch when they changed
        (core_service.recovery_record): a new leader continues them."""
        raw = self.recovery_records.changed(job.name, job.recovery, job.committed_epoch)
        if raw is not None:
            self.persister.put(self.job_key(job.name, "recovery"), raw)

    # ---- events -----------------------------------------------------------------------------
    def record(
        self,
        job: Job,
        kind: str,
        *,
        worker_id: str = "",
        detail: str = "",
        now: float,
        data: dict[str, Any] | None = None,
        membership_change: bool = False,
    ) -> Event:
        event = Event(job.next_seq, now, job.name, kind, worker_id, detail, data or {})
        job.next_seq += 1
        job.events.append(event)
        self.persister.put(self.job_key(job.name, "events", f"{event.seq:020d}"), event.to_json())
        if event.seq > self.settings.events_kept:
            stale = event.seq - self.settings.events_kept
            self.persister.delete(self.job_key(job.name, "events", f"{stale:020d}"))
        if membership_change:
            job.pending_changes.append(event)
        log.info("job=%s event=%s worker=%s %s", job.name, kind, worker_id, detail)
        self.changed.set()
        return event

    # ---- members ----------------------------------------------------------------------------
    def save_member(self, job: Job, member: MemberRecord) -> None:
        self.persister.put(self.job_key(job.name, "members", member.worker_id), member.to_json())

    def set_state(
        self,
        job: Job,
        member: MemberRecord,
        state: WorkerState,
        reason: str,
        *,
        now: float,
        kind: str,
        planned: bool = False,
    ) -> Event | None:
        """Moves a member to `state`; a gone member never comes back through here (it re-registers).
        `planned`: the move needs no plan (a worker that finished its work)."""
        if member.state == state or member.state.is_gone:
            return None
        was_spare = member.state is WorkerState.SPARE
        member.state = state
        member.state_changed_unix = now
        # A departure (preempted, drained, left) is no loss: only LOST carries a lost_reason.
        member.lost_reason = reason if state is WorkerState.LOST else ""
        member.state_reason = "" if state is WorkerState.RUNNING else reason
        if state.is_gone:
            job.failslow.forget(member.worker_id)
            job.check_completion = True
            job.gone.went(member.worker_id)
        self.save_member(job, member)
        # A worker starting to step changes nothing the planner cares about; every other move does,
        # except a departure the current layout already planned for (a preempted or drained rank
        # leaving after the plan that removed it): re-planning for it would interrupt the apply.
        changes_layout = state != WorkerState.RUNNING or kind == "worker_recovered"
        # A spare that goes was in no layout: it is just removed.
        if planned or (state.is_gone and (was_spare or not job.in_layout(member) or job.work_done)):
            changes_layout = False
        return self.record(
            job, kind, worker_id=member.worker_id, detail=reason, now=now, membership_change=changes_layout
        )

    # ---- takeover ---------------------------------------------------------------------------
    def read_registry(self, now: float) -> dict[str, Job]:
        """Every job as the registry holds it (blocking I/O: call it off the event loop)."""
        jobs: dict[str, Job] = {}
        self.recovery_records.forget()
        prefix = self.settings.key_prefix + "/jobs/"
        for key, raw in self.registry.get_prefix(prefix):
            parts = key[len(prefix) :].split("/")
            if len(parts) == 2 and parts[1] == "spec":
                spec = json.loads(raw)
                job = self._new_job(
                    spec["name"], spec["token_sha256"], spec["expected_workers"], spec["created_unix"]
                )
                job.layout_json, job.model_json = spec.get("layout_json"), spec.get("model_json")
                job.spare_workers = int(spec.get("spare_workers", 0))
                job.min_workers = int(spec.get("min_workers", 0))
                job.max_workers = int(spec.get("max_workers", 0))
                job.offered_workers = int(spec.get("offered_workers", 0))
                job.offered_hosts = {str(h): int(n) for h, n in spec.get("offered_hosts", {}).items()}
                job.original_layout_json = job.layout_json
                job.completed_unix = spec.get("completed_unix")
                job.final_checkpoint = str(spec.get("final_checkpoint", ""))
                if job.completed_unix is not None:
                    job.phase = JobPhase.COMPLETED
                job.ended_unix = spec.get("ended_unix")
                job.end_phase = str(spec.get("end_phase", ""))
                job.end_reason = str(spec.get("end_reason", ""))
                job.latest_checkpoint = str(spec.get("latest_checkpoint", ""))
                job.stores = tuple(str(a) for a in spec.get("stores", ()))
                if job.end_phase:
                    job.phase = JobPhase(job.end_phase)
                job.committed_layout_json = job.layout_json  # until the engine restores the job
                jobs[job.name] = job
        for name, job in jobs.items():
            self._load_job_contents(job, now)
            log.info("loaded job %s: %d members, %d events", name, len(job.members), len(job.events))
        return jobs

    def load_from_registry(self, now: float) -> None:
        """Rebuilds the table from the registry (a standby becoming leader); the table is
        replaced in one assignment, so a reader never sees it half loaded."""
        self.jobs = self.read_registry(now)

    def _load_job_contents(self, job: Job, now: float) -> None:
        for _, raw in self.registry.get_prefix(self.job_key(job.name, "members") + "/"):
            member = MemberRecord.from_json(raw)
            if not member.state.is_gone:
                # Give every survivor time to reconnect to this Core before heartbeats count.
                member.last_heartbeat_unix = now + self.settings.reconnect_grace_s
            job.members[member.worker_id] = member
        gone = sorted(
            (m for m in job.members.values() if m.state.is_gone), key=lambda m: m.state_changed_unix
        )
        for member in gone:
            job.gone.went(member.worker_id)
        for _, raw in self.registry.get_prefix(self.job_key(job.name, "events") + "/"):
            event = Event.from_json(raw)
            job.events.append(event)
            job.next_seq = max(job.next_seq, event.seq + 1)
        self._load_recovery(job)

    def _load_recovery(self, job: Job) -> None:
        """The retry bounds, the retry request and the committed epoch the previous leader stored
        (none: a job that never planned, or one stored before the record existed)."""
        raw = self.registry.get(self.job_key(job.name, "recovery"))
        if raw is None:
            return
        try:
            job.recovery, job.committed_epoch = parse_recovery(raw)
        except ValueError as exc:
            # Starting the bounds afresh costs retries, never correctness: say so and go on.
            log.error("job %s: %s; its retry bounds start afresh", job.name, exc)
            return
        self.recovery_records.loaded(job.name, raw)


@functools.lru_cache(maxsize=16)
def parse_layout(raw: str) -> Layout:
    return Layout.from_json(raw)


def now_unix() -> float:
    return time.time()
