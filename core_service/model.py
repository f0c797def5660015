"""What the Core knows about jobs and their members, as plain records serialisable to the registry."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

# The event that makes a registered spare's worker ready to join (its worker subscribed to plans
# with its own credential, `Membership.mark_spare_ready`): a change the engine plans for.
SPARE_READY_EVENT = "spare_ready"


class WorkerState(StrEnum):
    JOINING = "JOINING"
    # Registered with rank -1 into a job that has a layout: not in the layout, watched for
    # liveness like any member, taken in by a plan that names it in `Plan.joiners`.
    SPARE = "SPARE"
    RUNNING = "RUNNING"
    SLOW = "SLOW"
    PREEMPTING = "PREEMPTING"
    DRAINING = "DRAINING"
    LOST = "LOST"
    LEFT = "LEFT"

    @property
    def is_gone(self) -> bool:
        # Identity, not equality: asked for every member on every sweep and plan.
        return self is WorkerState.LOST or self is WorkerState.LEFT


class JobPhase(StrEnum):
    RUNNING = "RUNNING"
    PLANNING = "PLANNING"
    APPLYING = "APPLYING"
    # Every worker of the layout finished its work (terminal: nothing is planned any more).
    COMPLETED = "COMPLETED"
    # Terminal too: every worker is gone and no plan is possible, or an operator ended the job
    # (DELETE /api/v1/jobs/{job}); the job keeps its reason and latest checkpoint.
    FAILED = "FAILED"
    # Terminal: ended on request (REST DELETE /api/v1/jobs/{job}, SchedulerService.EndJob).
    STOPPED = "STOPPED"

    @property
    def terminal(self) -> bool:
        return self is JobPhase.COMPLETED or self is JobPhase.FAILED or self is JobPhase.STOPPED


class AckPhase(StrEnum):
    """A phase an executor acknowledges for a plan (executor.proto `PlanPhase`)."""

    RECEIVED = "RECEIVED"
    PAUSED = "PAUSED"
    APPLIED = "APPLIED"
    RESUMED = "RESUMED"
    FAILED = "FAILED"


class PlanFailure(StrEnum):
    """Why an executor could not apply a plan (executor.proto `PlanFailure`).

    NOT_APPLICABLE: it cannot reach the new layout in place (planners.applicability), so the next
    plan is a RESTORE. INTERRUPTED: applying was cut short (a peer died, a wait timed out) and the
    executor is back at its last committed state, waiting for a newer plan. UNSPECIFIED: only in
    event logs written before the field existed; treated as INTERRUPTED."""

    NOT_APPLICABLE = "not_applicable"
    INTERRUPTED = "interrupted"
    UNSPECIFIED = "unspecified"


@dataclass(frozen=True)
class Ack:
    """One executor's last acknowledged phase of one plan; `failure` and `reason` only with FAILED."""

    phase: AckPhase
    failure: PlanFailure | None = None
    reason: str = ""
    steps_replayed: int = 0  # RESUMED after a restore: committed steps the job went back over

    def __post_init__(self) -> None:
        if (self.phase == AckPhase.FAILED) != (self.failure is not None):
            raise ValueError(f"an ack has a failure kind exactly when it is FAILED, got {self}")
        if self.steps_replayed < 0 or (self.steps_replayed and self.phase != AckPhase.RESUMED):
            raise ValueError(f"steps_replayed is a count >= 0 given only with RESUMED, got {self}")

    @property
    def failed(self) -> bool:
        return self.phase == AckPhase.FAILED

    def __str__(self) -> str:
        if self.failure is None:
            return self.phase.value
        return f"{self.phase.value} ({self.failure.value}): {self.reason}"


@dataclass
class DeviceInfo:
    kind: str
    index: int
    name: str = ""
    memory_bytes: int = 0


@dataclass
class StepReport:
    step: int
    step_time_s: float
    compute_time_s: float
    loss: float | None
    samples: int
    stage: int
    dp_rank: int
    received_unix: float
    checkpoint: str = ""  # a checkpoint the worker completed since its previous report

    @property
    def own_time_s(self) -> float:
        """The rank's own compute, where its worker reports it, else its wall step time: in a
        synchronous job every rank's wall step time is the slowest rank's, which would hide a
        straggler among its stage peers (fail-slow detection, the policy's slowdown sizing)."""
        return self.compute_time_s if self.compute_time_s > 0 else self.step_time_s


@dataclass
class MemberRecord:
    """One worker of a job. Persisted on every state change; heartbeats stay in memory."""

    worker_id: str
    host: str
    pid: int
    devices: list[DeviceInfo] = field(default_factory=list)
    state: WorkerState = WorkerState.JOINING
    lost_reason: str = ""  # why the worker was declared LOST ("" in any other state)
    state_reason: str = ""  # why the worker is in its current state (slow, preempting, left, lost)
    stage: int = -1
    dp_rank: int = -1
    rank: int = -1
    holds_own_lease: bool = False
    registered_unix: float = 0.0
    state_changed_unix: float = 0.0
    last_heartbeat_unix: float = 0.0
    last_step: StepReport | None = None
    memory: dict[str, Any] = field(default_factory=dict)
    probes: dict[str, dict[str, Any]] = field(default_factory=dict)
    preemption_deadline_unix: float | None = None
    # SHA-256 of the worker's own credential (RegisterAck.worker_token), stored so that a new
    # leader knows it too; "" for a record from a Core that issued none. Never served.
    worker_token_sha256: str = ""
    # Its agent said Leave(finished): the worker completed its work and exited 0; `checkpoint`
    # is where it says the job's final checkpoint is ("" when it reported none).
    finished: bool = False
    checkpoint: str = ""
    # Set while its heartbeats are past their adaptive deadline with its stream and lease alive
    # (core_service.liveness): a slow agent, noted, never LOST for it (docs/failures.md).
    heartbeat_late_since_unix: float | None = None

    def to_json(self) -> bytes:
        return json.dumps(dataclasses.asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> MemberRecord:
        data = json.loads(raw)
        data["devices"] = [DeviceInfo(**d) for d in data.get("devices", [])]
        data["state"] = WorkerState(data["state"])
        if data.get("last_step"):
            data["last_step"] = StepReport(**data["last_step"])
        return cls(**data)

    def public(self) -> dict[str, Any]:
        """The view served by the REST API."""
        view = dataclasses.asdict(self)
        view["state"] = self.state.value
        del view["worker_token_sha256"]
        return view


@dataclass(frozen=True)
class Event:
    """Something that happened to a job; kept in order, visible in the API and on the dashboard."""

    seq: int
    time_unix: float
    job: str
    kind: str
    worker_id: str = ""
    detail: str = ""
    data: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> bytes:
        return json.dumps(dataclasses.asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> Event:
        return cls(**json.loads(raw))


@dataclass
class RetryRequest:
    """Why the engine must publish again although the policy may find nothing to change
    (docs/architecture.md ("The Core's decisions")): executors that could not apply the plan of
    `epoch` went back to their committed state, or a collective failed with no membership
    change, and either way they wait for a newer plan."""

    epoch: int  # the plan epoch the request was raised at
    failed: dict[str, Ack] = field(default_factory=dict)  # worker -> its FAILED ack of `epoch`
    collective: list[str] = field(default_factory=list)  # one reason per collective failure
    peers: set[int] = field(default_factory=set)  # ranks the failures named; -1: none named

    def not_applicable(self) -> dict[str, Ack]:
        return {w: a for w, a in self.failed.items() if a.failure == PlanFailure.NOT_APPLICABLE}

    def summary(self) -> str:
        """One clause per cause, for a plan's reasons and the event log."""
        parts = []
        by_kind: dict[PlanFailure, list[str]] = {}
        for worker, ack in sorted(self.failed.items()):
            assert ack.failure is not None
            by_kind.setdefault(ack.failure, []).append(worker)
        for kind, workers in by_kind.items():
            first = self.failed[workers[0]]
            parts.append(f"its apply failed on {workers} ({kind.value}: {first.reason})")
        parts.extend(self.collective)
        return "; ".join(parts)


@dataclass
class Recovery:
    """What the engine counts between two committed steps, to bound retries that make no progress
    (a commit on any plan's layout resets it: executors acknowledge RESUMED only after one)."""

    in_place_retries: int = 0  # retry plans published in place
    restore_failures: int = 0  # RESTORE plans whose apply failed
    collective_retries: dict[int, int] = field(default_factory=dict)  # rank named (-1: none) -> replays
    request: RetryRequest | None = None  # raised and not yet answered by a plan
    gave_up_at: int | None = None  # the epoch whose failures were refused: no more retries for it

    def progress(self) -> None:
        self.in_place_retries = self.restore_failures = 0
        self.collective_retries.clear()
        self.gave_up_at = None
