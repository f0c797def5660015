"""Ending a job on request: REST `DELETE /api/v1/jobs/{job}` and its gRPC twin
`SchedulerService.EndJob` (the same rule, the same scheduler token; docs/api.md).

Any job can be ended, whatever its phase (issue 27: a job whose workers were all lost used to
stay RUNNING forever, with DELETE answering 405). Its live workers are asked to checkpoint and
leave at one step boundary (the operator's clean stop, `core_service.checkpoint_request`); the job
becomes STOPPED at once (terminal: nothing is planned any more, no worker may register), and its
record and name stay, so its events and latest checkpoint can still be read. A job already
terminal (COMPLETED, FAILED, STOPPED) is answered as it is.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from core_service.checkpoint_request import CheckpointRequestBody, request_checkpoint
from core_service.grpc_util import RpcError
from core_service.limits import MAX_REASON_CHARS
from core_service.model import JobPhase
from core_service.seams import ServicerCore

if TYPE_CHECKING:
    from core_service.engine import ScheduleEngine

log = logging.getLogger("elaswave.core.job_end")


class JobEndCore(ServicerCore, Protocol):
    """Ending a job: the guards, the job state and the schedule engine."""

    engine: ScheduleEngine


@dataclass(frozen=True)
class Ended:
    phase: JobPhase
    event_seq: int
    stopping: tuple[str, ...]  # live workers asked to checkpoint and leave


def end_job(core: JobEndCore, name: str, reason: str, now: float) -> Ended:
    """Ends job `name` (STOPPED) unless it already ended; UnknownJob (NOT_FOUND) for no such job."""
    job = core.job_or_not_found(name)
    if job.phase.terminal:
        return Ended(job.phase, job.next_seq - 1, ())
    stopping: tuple[str, ...] = ()
    try:
        asked = request_checkpoint(core, name, CheckpointRequestBody(stop=True), now)
        stopping = tuple(asked["workers"])
    except RpcError as err:  # no live stream or no step yet: nobody to stop cleanly
        log.info("job=%s ends without a clean stop: %s", name, err.message)
    said = reason[:MAX_REASON_CHARS] if reason else "no reason given"
    event = core.engine.end(job, JobPhase.STOPPED, f"ended on request ({said})", now)
    return Ended(job.phase, event.seq, stopping)
