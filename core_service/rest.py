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
import secrets
import time
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import Depends, FastAPI, HTTPException, Query, Response
from fastapi.responses import PlainTextResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field, SecretStr

from core_service.config import JOB_NAME_PATTERN, MIN_TOKEN_LENGTH, JobSpec, check_worker_bounds
from core_service.grpc_util import RpcError
from core_service.http_guard import JobName, error_responses, field_error
from core_service.http_guard import install as install_guards
from core_service.jobs import Job, JobExists, UnknownJob
from core_service.limits import (
    MAX_DEVICES,
    MAX_IDS_PER_REQUEST,
    MAX_LAYERS,
    MAX_REASON_CHARS,
    MAX_SPARE_WORKERS,
    MAX_TOKEN_CHARS,
    MAX_WORKERS_PER_JOB,
)
from core_service.model import MemberRecord, WorkerState
from core_service.scale_cache import ScaleTables
from planners.chameleon.schema import state_from_dict
from planners.layout import Layout
from planners.validation import validate

if TYPE_CHECKING:
    from core_service.core import Core

bearer = HTTPBearer(auto_error=False)


class CreateJobRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # no "1" for 1, no false for 0
    name: str = Field(pattern=JOB_NAME_PATTERN.pattern, description="job name")
    expected_workers: int = Field(default=0, ge=0, le=MAX_WORKERS_PER_JOB)
    spare_workers: int = Field(
        default=0, ge=0, le=MAX_SPARE_WORKERS, description="workers that may register beyond expected_workers"
    )
    min_workers: int = Field(
        default=0, ge=0, le=MAX_WORKERS_PER_JOB, description="fewest ranks a plan may leave (0: no bound)"
    )
    max_workers: int = Field(
        default=0,
        ge=0,
        le=MAX_WORKERS_PER_JOB,
        description="most ranks a plan may have (0: the creation layout's ranks plus accepted offers)",
    )
    token: str | None = Field(
        default=None, min_length=MIN_TOKEN_LENGTH, max_length=MAX_TOKEN_CHARS, description="omit to generate"
    )
    layout: dict[str, Any] | None = Field(default=None, description="planners.Layout as JSON")
    model: dict[str, Any] | None = Field(
        default=None,
        description="model, profile and shape as the `elaswave plan` state.json; enables the scale table",
    )


class CreateJobResponse(BaseModel):
    name: str
    token: str = Field(description="per-job token for agents and executors; shown only once")


class PreemptRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # no "1" for 1, no false for 0
    worker_ids: list[Annotated[str, Field(min_length=1, max_length=128)]] = Field(
        min_length=1, max_length=MAX_IDS_PER_REQUEST
    )
    deadline_unix: float = Field(allow_inf_nan=False, description="seconds since the epoch, in the future")
    reason: str = Field(default="", max_length=MAX_REASON_CHARS)


def spare_view(member: MemberRecord) -> dict[str, Any]:
    return {
        "worker_id": member.worker_id,
        "host": member.host,
        "devices": len(member.devices),
        "registered_unix": member.registered_unix,
        "last_heartbeat_unix": member.last_heartbeat_unix,
    }


def job_summary(job: Job) -> dict[str, Any]:
    counts: dict[str, int] = {}
    for member in job.members.values():
        counts[member.state.value] = counts.get(member.state.value, 0) + 1
    return {
        "name": job.name,
        "phase": job.phase.value,
        "plan_epoch": job.plan_epoch,
        # The newest epoch a step committed on, and how the newest plan is applied (in_place or
        # restore): a plan's apply restarts from the committed layout (docs/architecture.md).
        "committed_epoch": job.committed_epoch,
        "plan_mode": None if job.last_plan is None else job.last_plan.mode.value,
        "expected_workers": job.expected_workers,
        "min_workers": job.min_workers,
        "max_workers": job.max_workers,
        "offered_workers": job.offered_workers,  # admitted by accepted offers (OfferResources)
        "members_by_state": counts,
        # COMPLETED: every worker finished; where the final checkpoint is, as they reported it.
        "completed_unix": job.completed_unix,
        "final_checkpoint": job.final_checkpoint or None,
        # FAILED or STOPPED: when and why it ended; the newest checkpoint the workers reported.
        "ended_unix": job.ended_unix,
        "end_reason": job.end_reason or None,
        "latest_checkpoint": job.latest_checkpoint or None,
        "has_layout": job.layout_json is not None,
        "last_event_seq": job.next_seq - 1,
    }


async def store_new_job(core: Core, body: CreateJobRequest) -> CreateJobResponse:
    """Create the job (POST /api/v1/jobs, and the rendezvous of `elaswave run --core`); raises
    HTTPException with what is wrong. Async: the job table is only ever changed on the event loop
    (a sync handler would run in a worker thread), and it returns once the job is stored."""
    if not core.settings.allow_job_creation:
        raise HTTPException(403, detail="job creation through the API is disabled (allow_job_creation)")
    layout_json = None
    if body.layout is not None:
        try:
            layout = Layout.from_json(json.dumps(body.layout))
        except (ValueError, TypeError, KeyError) as exc:
            raise HTTPException(422, detail=field_error("layout", f"layout: {exc}")) from None
        report = validate(layout)
        if not report.ok:
            problems = "; ".join(report.problems)
            raise HTTPException(422, detail=field_error("layout", f"layout does not validate: {problems}"))
        layout_json = layout.to_json()
    model_json = None
    if body.model is not None:
        try:
            state_from_dict(body.model)
        except (ValueError, TypeError, KeyError) as exc:
            raise HTTPException(422, detail=field_error("model", f"model: {exc}")) from None
        problem = model_too_large(body.model)
        if problem is not None:
            raise HTTPException(422, detail=field_error("model", f"model: {problem}"))
        model_json = json.dumps(body.model, sort_keys=True)
    token = body.token or secrets.token_urlsafe(24)
    try:
        check_worker_bounds(body.min_workers, body.max_workers)
    except ValueError as exc:
        raise HTTPException(422, detail=field_error("min_workers", str(exc))) from None
    spec = JobSpec(
        name=body.name,
        token=SecretStr(token),
        expected_workers=body.expected_workers,
        spare_workers=body.spare_workers,
        min_workers=body.min_workers,
        max_workers=body.max_workers,
    )
    try:
        core.table.create_job(spec, layout_json, now=time.time(), model_json=model_json)
    except JobExists as exc:
        raise HTTPException(409, detail=str(exc)) from None
    try:
        await core.wait_durable()
    except RpcError as err:
        raise HTTPException(503, detail=err.message) from None
    return CreateJobResponse(name=body.name, token=token)


def model_too_large(model: dict[str, Any]) -> str | None:
    """Why a registered model would make planning unbounded (limits.MAX_DEVICES, MAX_LAYERS)."""
    state = state_from_dict(model)[0]
    devices = [("the cluster's device count", state.shape.num_devices)]
    if "max_devices" in model:
        try:
            devices.append(("max_devices", int(model["max_devices"])))
        except (TypeError, ValueError):
            return f"max_devices {str(model['max_devices'])[:40]!r} is not a whole number"
    for name, value in devices:
        if not 1 <= value <= MAX_DEVICES:
            return f"{name} is {value}; it must be 1..{MAX_DEVICES}"
    if state.profile.num_layers > MAX_LAYERS:
        return f"{state.profile.num_layers} layers; at most {MAX_LAYERS}"
    return None


def build_app(core: Core) -> FastAPI:
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
    def list_jobs() -> dict[str, Any]:
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

        def view() -> dict[str, Any]:  # 10,000 members: serialised off the event loop
            members = sorted(record.members.values(), key=lambda m: m.worker_id)
            return {
                **job_summary(record),
                "members": [m.public() for m in members],
                "spares": [spare_view(m) for m in members if m.state is WorkerState.SPARE],
                "scale_table": scale,
                "layout": None if record.layout_json is None else json.loads(record.layout_json),
                "committed_layout": None
                if record.committed_layout_json is None
                else json.loads(record.committed_layout_json),
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
        from core_service.job_end import end_job

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
