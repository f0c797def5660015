"""REST API under /api/v1, /healthz and /metrics (FastAPI). Reads (jobs, events) follow the
Core's `read_access` (open, or the scheduler token), the same policy as gRPC GetJobState; every
call that changes something needs `Authorization: Bearer <scheduler token>`. Bodies are bounded
and checked before any of this (core_service.http_guard); every route documents each status it
answers with, and its body."""

from __future__ import annotations

import asyncio
import bisect
import itertools
import json
import time
from typing import TYPE_CHECKING, Annotated, Any, Protocol

from fastapi import Depends, FastAPI, HTTPException, Query, Response
from fastapi.responses import PlainTextResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field

from core_service.dashboard import DashboardCore
from core_service.grpc_util import RpcError
from core_service.http_guard import JobName, error_responses, field_error
from core_service.http_guard import install as install_guards
from core_service.job_create import (
    CreateJobRequest,
    CreateJobResponse,
    StoresRequest,
    replace_stores,
    store_new_job,
)
from core_service.job_end import JobEndCore, end_job
from core_service.job_view import job_summary, spare_view
from core_service.jobs import Job, UnknownJob
from core_service.limits import (
    MAX_IDS_PER_REQUEST,
    MAX_REASON_CHARS,
)
from core_service.model import WorkerState
from core_service.rendezvous import RendezvousCore
from core_service.scale_cache import Planning, ScaleTables

if TYPE_CHECKING:
    from core_service.scheduler_service import SchedulerServicer


class RestCore(DashboardCore, RendezvousCore, Planning, JobEndCore, Protocol):
    """What the REST app needs of the Core: every router's interface, the scheduler servicer its
    scheduler routes share handlers with, and when this Core started."""

    scheduler: SchedulerServicer
    started_unix: float


bearer = HTTPBearer(auto_error=False)


class PreemptRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # no "1" for 1, no false for 0
    worker_ids: list[Annotated[str, Field(min_length=1, max_length=128)]] = Field(
        min_length=1, max_length=MAX_IDS_PER_REQUEST
    )
    deadline_unix: float = Field(allow_inf_nan=False, description="seconds since the epoch, in the future")
    reason: str = Field(default="", max_length=MAX_REASON_CHARS)


def build_app(core: RestCore) -> FastAPI:
    app = FastAPI(
        title="ElasWave Core",
        version="v1",
        description="Jobs, members and events of the ElasWave control plane.",
        # /docs and /redoc come from core_service.offline_docs, with assets shipped in the package.
        docs_url=None,
        redoc_url=None,
    )

    def leader_only() -> None:
        if not core.leads:
            raise HTTPException(503, detail=core.not_leader_message("http"))

    def job_or_404(name: str) -> Job:
        try:
            return core.table.get(name)
        except UnknownJob as exc:
            raise HTTPException(404, detail=str(exc)) from None

    def admin(credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]) -> None:
        if credentials is None:
            raise HTTPException(
                401,
                detail="missing 'Authorization: Bearer <scheduler token>'",
                headers={"WWW-Authenticate": "Bearer"},
            )
        if not core.scheduler_token_ok(credentials.credentials):
            raise HTTPException(403, detail="wrong scheduler token")

    # Reads follow `read_access` (core_service.core.Core.check_read_access, the same for gRPC):
    # open reads declare no security in the schema, token-protected ones the scheduler token.
    reads = [Depends(leader_only)] + ([Depends(admin)] if core.settings.read_access == "token" else [])

    # Latency histogram and refusal counts of every request; Core -> agent commands (SetFrequency,
    # Drain, ReportNow) on the worker's live stream.
    from core_service.agent_service import worker_command_router
    from core_service.checkpoint_request import checkpoint_router
    from core_service.metrics import observe_http
    from core_service.rendezvous import rendezvous_router

    install_guards(app)  # inside the metrics middleware: refusals are timed and counted too
    observe_http(app, core.metrics)
    app.include_router(worker_command_router(core, [Depends(leader_only), Depends(admin)]))
    app.include_router(checkpoint_router(core, [Depends(leader_only), Depends(admin)]))
    app.include_router(rendezvous_router(core, [Depends(leader_only), Depends(admin)]))
    from core_service.dashboard import dashboard_router
    from core_service.offline_docs import offline_docs_router

    app.include_router(dashboard_router(core, reads))
    app.include_router(offline_docs_router(app.title))

    read_errors = error_responses(
        *((401, 403) if core.settings.read_access == "token" else ()), 404, 422, 503
    )
    write_errors = error_responses(400, 401, 403, 404, 409, 413, 422, 503)

    @app.get("/healthz")
    def healthz() -> dict[str, Any]:
        return {
            "status": "ok",
            "role": "leader" if core.leads else "standby",
            "core_id": core.settings.core_id,
            "leader": core.not_leader_message("http").split("is ")[-1],
            # Launchers given every Core's REST address learn each one's gRPC port here.
            "grpc_port": core.grpc_port,
            "uptime_s": time.time() - core.started_unix,
        }

    @app.get("/readyz", responses={503: {"description": "a standby: not ready to serve as leader"}})
    def readyz() -> Response:
        """Readiness for a leader-only Service: 200 only on the Core that leads now (/healthz is
        the liveness probe of every replica)."""
        ready = core.leads
        body = {"ready": ready, "role": "leader" if ready else "standby", "core_id": core.settings.core_id}
        if not ready:
            body["detail"] = core.not_leader_message("http")
        return Response(json.dumps(body), status_code=200 if ready else 503, media_type="application/json")

    @app.get(
        "/metrics",
        response_class=PlainTextResponse,
        responses={200: {"description": "Prometheus text exposition format"}},
    )
    def metrics() -> Response:
        return Response(generate_latest(core.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/api/v1/jobs", dependencies=reads, responses=read_errors)
    async def list_jobs() -> dict[str, Any]:  # on the loop, which is the only writer of the jobs
        return {"jobs": [job_summary(j) for j in sorted(core.table.jobs.values(), key=lambda j: j.name)]}

    @app.post(
        "/api/v1/jobs",
        status_code=201,
        dependencies=[Depends(leader_only), Depends(admin)],
        responses=write_errors,
    )
    async def create_job(body: CreateJobRequest) -> CreateJobResponse:
        return await store_new_job(core, body)

    scale_tables = ScaleTables(core)

    @app.get("/api/v1/jobs/{job}", dependencies=reads, responses=read_errors)
    async def get_job(job: JobName) -> dict[str, Any]:
        """The job, its members, its layouts, its spares (workers registered with rank -1 that
        a plan may take in) and FlexTrain's scale table (computed off the loop, cached)."""
        record = job_or_404(job)
        scale = await scale_tables.get(record)
        # Read on the loop, the only writer: the summary, and the member list as one C-level copy
        # (no other thread can run during it). Iterating `record.members` on the worker thread
        # raced registrations ("dictionary changed size during iteration": HTTP 500 in a burst).
        summary, members = job_summary(record), list(record.members.values())
        layout, committed = record.layout_json, record.committed_layout_json

        def view() -> dict[str, Any]:
            # 10,000 members: serialised off the event loop. A member's fields are only ever
            # replaced, never changed in place, so reading them here is safe.
            members.sort(key=lambda m: m.worker_id)
            return {
                **summary,
                "members": [m.public() for m in members],
                "spares": [spare_view(m) for m in members if m.state is WorkerState.SPARE],
                "scale_table": scale,
                "layout": None if layout is None else json.loads(layout),
                "committed_layout": None if committed is None else json.loads(committed),
            }

        return await asyncio.to_thread(view)

    @app.get(
        "/api/v1/jobs/{job}/events",
        dependencies=reads,
        responses=read_errors,
    )
    async def get_events(  # on the loop: the deque is never read while it is appended to
        job: JobName,
        since: Annotated[int, Query(ge=0, description="only events with seq > since")] = 0,
        limit: Annotated[int, Query(ge=1, le=10_000)] = 500,
    ) -> dict[str, Any]:
        record = job_or_404(job)
        # Events are kept in seq order: start at the first one after `since` (a follower polling
        # the tail of 100,000 kept events must not cost a scan of all of them per poll).
        start = bisect.bisect_right(record.events, since, key=lambda e: e.seq)
        events = list(itertools.islice(record.events, start, start + limit))
        return {"job": job, "events": [e.__dict__ for e in events]}

    @app.delete(
        "/api/v1/jobs/{job}",
        dependencies=[Depends(leader_only), Depends(admin)],
        responses=error_responses(401, 403, 404, 422, 503),
    )
    async def delete_job(
        job: JobName,
        reason: Annotated[str, Query(max_length=MAX_REASON_CHARS, description="recorded with the end")] = "",
    ) -> dict[str, Any]:
        """Ends the job whatever its phase: its live workers checkpoint and leave at one step
        boundary, the job is STOPPED (terminal; the record stays). An ended job is answered as
        it is. The twin of SchedulerService.EndJob (core_service.job_end)."""
        job_or_404(job)
        ended = end_job(core, job, reason, time.time())
        try:
            await core.wait_durable()
        except RpcError as err:
            raise HTTPException(503, detail=err.message) from None
        return {
            "job": job,
            "phase": ended.phase.value,
            "event_seq": ended.event_seq,
            "stopping_worker_ids": list(ended.stopping),
        }

    @app.put(
        "/api/v1/jobs/{job}/stores",
        dependencies=[Depends(leader_only), Depends(admin)],
        responses=write_errors,
    )
    async def put_stores(job: JobName, body: StoresRequest) -> dict[str, Any]:
        """The job's rendezvous stores now, as the launcher that replaced one says (`elaswave run
        --core`: the stores run beside the job); stored in the job's spec in the registry."""
        return await replace_stores(core, job_or_404(job), body.stores)

    @app.post(
        "/api/v1/jobs/{job}/preempt",
        status_code=202,
        dependencies=[Depends(leader_only), Depends(admin)],
        responses=write_errors,
    )
    async def preempt(job: JobName, body: PreemptRequest) -> dict[str, Any]:
        from wire.v1 import scheduler_pb2

        job_or_404(job)
        grpc_request = scheduler_pb2.SignalPreemptionRequest(
            job=job, worker_ids=body.worker_ids, deadline_unix=body.deadline_unix, reason=body.reason
        )
        try:
            response = await core.scheduler.preempt(grpc_request)
        except RpcError as err:
            status = {"NOT_FOUND": 404, "FAILED_PRECONDITION": 409, "UNAVAILABLE": 503}.get(
                err.code.name, 422
            )
            detail: Any = field_error("", err.message) if status == 422 else err.message
            raise HTTPException(status, detail=detail) from None
        return {"event_seq": response.event_seq}

    return app
