"""What the Core knows about jobs and their members, as plain records serialisable to the registry."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class WorkerState(StrEnum):
    JOINING = "JOINING"
    RUNNING = "RUNNING"
    SLOW = "SLOW"
    PREEMPTING = "PREEMPTING"
    DRAINING = "DRAINING"
    LOST = "LOST"
    LEFT = "LEFT"

    @property
    def is_gone(self) -> bool:
        return self in (WorkerState.LOST, WorkerState.LEFT)


class JobPhase(StrEnum):
    RUNNING = "RUNNING"
    PLANNING = "PLANNING"
    APPLYING = "APPLYING"


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


@dataclass
class MemberRecord:
    """One worker of a job. Persisted on every state change; heartbeats stay in memory."""

    worker_id: str
    host: str
    pid: int
    devices: list[DeviceInfo] = field(default_factory=list)
    state: WorkerState = WorkerState.JOINING
    lost_reason: str = ""
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
