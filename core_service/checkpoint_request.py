"""`POST /api/v1/jobs/{job}/checkpoint`: an operator asks a running job for a checkpoint (docs/api.md).

The Core cannot reach into the workers' memory; it relays the request on every live agent's
stream (`Checkpoint` command), and each agent writes it into its worker's control file
(wire.local_protocol). The step to save is chosen so that every worker sees the request
before it gets there: about two seconds of steps past the furthest step any worker has reported
(`wire.worker_env.steps_ahead`; workers of one synchronous job are never more than one step
apart). With `stop`, every worker leaves the job
after that step: the operator's clean stop, ending with a checkpoint from which
`elaswave run --resume DIR` continues on any layout. Workers started without a checkpoint
directory cannot save and say so in their results.
"""

from __future__ import annotations

import time
from typing import Any

import grpc
from fastapi import APIRouter, HTTPException
from fastapi.params import Depends
from pydantic import BaseModel, ConfigDict, Field

from core_service.grpc_util import HTTP_STATUS, RpcError
from core_service.http_guard import JobName, error_responses, field_error
from core_service.seams import ServicerCore
from wire.v1 import agent_pb2
from wire.worker_env import steps_ahead


class CheckpointRequestBody(BaseModel):
    """Body of POST /api/v1/jobs/{job}/checkpoint."""

    model_config = ConfigDict(extra="forbid", strict=True)  # no "1" for 1, no false for 0
    stop: bool = Field(default=False, description="leave the job after the checkpointed step (a clean stop)")


# job -> (after_step, stop) of the request its workers are heading to: a second request before
# that step joins it (same step; a stop is added), so workers never see two different steps.
Pending = dict[str, tuple[int, bool]]


def request_checkpoint(
    core: ServicerCore, job_name: str, body: CheckpointRequestBody, now: float, pending: Pending | None = None
) -> dict[str, Any]:
    """Queue the Checkpoint command on every live agent stream of the job; records an event."""
    job = core.job_or_not_found(job_name)
    live = [m for m in job.live_members() if (job_name, m.worker_id) in core.membership.sessions]
    if not live:
        raise RpcError(
            grpc.StatusCode.FAILED_PRECONDITION, f"job {job_name!r} has no worker with a live agent stream"
        )
    steps = [m.last_step.step for m in live if m.last_step is not None]
    if not steps:
        raise RpcError(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"no worker of job {job_name!r} has committed a step yet; ask again once it trains",
        )
    times = [m.last_step.step_time_s for m in live if m.last_step is not None]
    after_step, stop = max(steps) + steps_ahead(max(times) if times else None), body.stop
    earlier = (pending or {}).get(job_name)
    if earlier is not None and earlier[0] > max(steps):  # still ahead: join it
        after_step, stop = earlier[0], earlier[1] or body.stop
    if pending is not None:
        pending[job_name] = (after_step, stop)
    command = agent_pb2.ConnectResponse(checkpoint=agent_pb2.Checkpoint(after_step=after_step, stop=stop))
    for member in live:
        core.membership.send(job_name, member.worker_id, command)
    what = "checkpoint and stop" if stop else "checkpoint"
    event = core.table.record(
        job,
        "checkpoint_requested",
        detail=f"{what} after step {after_step}",
        now=now,
        data={"after_step": after_step, "stop": stop, "workers": len(live)},
    )
    return {
        "job": job_name,
        "after_step": after_step,
        "stop": stop,
        "workers": sorted(m.worker_id for m in live),
        "event_seq": event.seq,
    }


def checkpoint_router(core: ServicerCore, dependencies: list[Depends]) -> APIRouter:
    """The REST route; `dependencies` are the app's leader and scheduler-token checks."""
    router = APIRouter(dependencies=dependencies)
    pending: Pending = {}

    @router.post(
        "/api/v1/jobs/{job}/checkpoint",
        status_code=202,
        responses=error_responses(400, 401, 403, 404, 409, 413, 422, 503),
    )
    async def post_checkpoint(job: JobName, body: CheckpointRequestBody | None = None) -> dict[str, Any]:
        # async: the commands go into asyncio.Queues, which only the event loop may touch.
        try:
            return request_checkpoint(core, job, body or CheckpointRequestBody(), time.time(), pending)
        except RpcError as err:
            status = HTTP_STATUS.get(err.code, 400)
            detail: Any = field_error("", err.message) if status == 422 else err.message
            raise HTTPException(status, detail=detail) from None

    return router
