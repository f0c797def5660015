"""What the Core keeps per connected agent stream, and what an agent registers with.

`core_service.membership` creates and closes sessions; the heartbeat sweep
(`core_service.heartbeat_sweep`) and the registry watch (`core_service.registry_watch`) read them.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from core_service.liveness import ArrivalWindow
from core_service.model import DeviceInfo


@dataclass
class AgentSession:
    """One connected agent stream. Commands for the agent go through `outbox`."""

    job: str
    worker_id: str
    session_id: int
    outbox: asyncio.Queue = field(default_factory=asyncio.Queue)
    handler: asyncio.Task | None = None  # the RPC handler serving this stream
    lease_id: int | None = None
    lease_refreshed: float = 0.0
    # The member's last_heartbeat_unix when ReportNow was last sent: one nudge per silence.
    nudged_for_heartbeat: float | None = None
    rejected_reports: int = 0
    progress_saved_unix: float = 0.0  # when the member's last step was last stored
    worker_token: str = field(default="", repr=False)  # the worker's credential, sent in the RegisterAck
    arrivals: ArrivalWindow | None = None  # this stream's heartbeat gaps (its adaptive deadline)


@dataclass(frozen=True)
class Registration:
    job: str
    worker_id: str
    host: str
    pid: int
    devices: list[DeviceInfo]
    stage: int
    dp_rank: int
    rank: int
    holds_own_lease: bool
