"""The operators' dashboard, served by every Core at `/` (assets shipped in the package).

Read-only without a token: the page reads the routes below and follows a server-sent event
stream (`/api/v1/dashboard/stream`), so it updates without reloading. Its actions (drain or
preempt a worker, checkpoint now, stop the job) call the existing REST endpoints with the
scheduler token the operator types in; a refusal (401/403/409/503) is shown with its reason.
Data routes answer only on the leader, like the rest of /api/v1; a standby's page says which
Core leads.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Protocol

from fastapi import APIRouter, HTTPException, Query, Request, params
from fastapi.responses import FileResponse, StreamingResponse

from core_service.dashboard_history import SAMPLE_INTERVAL_S, JobHistory
from core_service.dashboard_view import (
    layout_grid,
    members_of_stage,
    plans,
    recent_events,
    spares,
    stage_rows,
)
from core_service.grpc_util import RpcError
from core_service.http_guard import JobName
from core_service.job_metrics import JobGauges
from core_service.job_view import job_summary
from core_service.jobs import Job, UnknownJob
from core_service.registry import RegistryError
from core_service.seams import Background, ServicerCore
from planners.layout import Plan

if TYPE_CHECKING:
    from core_service.registry.plans import PlanStore

log = logging.getLogger("elaswave.core.dashboard")

STATIC_DIR = Path(__file__).parent / "static" / "dashboard"
ASSETS = {"app.js": "text/javascript", "app.css": "text/css", "favicon.svg": "image/svg+xml"}
# An event stream ends after this long and the browser's EventSource reconnects by itself: a
# forgotten tab never pins a connection (or its generator) for days.
STREAM_MAX_S = 300.0
STREAM_INTERVAL_S = 1.0


class DashboardCore(ServicerCore, Background, Protocol):
    """What the dashboard reads from the Core beyond the guards and the job state."""

    plans: PlanStore

    def scale_table(self, job: Job) -> list[dict[str, Any]]: ...


class DashboardData:
    """What the dashboard routes read: the job table, the sampled history, plans' predictions."""

    def __init__(self, core: DashboardCore) -> None:
        self.core = core
        self.history = JobHistory()
        self.gauges = JobGauges(core.metrics.registry)
        self._predicted: dict[tuple[str, int], float | None] = {}
        self._scale: dict[str, tuple[object, Any]] = {}

    async def sample_forever(self) -> None:
        while True:
            if self.core.leads:
                self.history.sample(self.core.table.jobs, time.time())
                latest = {name: self.history.latest(name) for name in self.core.table.jobs}
                self.gauges.publish({name: s for name, s in latest.items() if s is not None})
            else:
                self.gauges.clear()
            await asyncio.sleep(SAMPLE_INTERVAL_S)

    def job(self, name: str) -> Job:
        try:
            return self.core.table.get(name)
        except UnknownJob as exc:
            raise HTTPException(404, detail=str(exc)) from None

    async def load_predictions(self, job: Job) -> None:
        """Reads the stored plans of the epochs the view shows, once each (registry I/O, off the
        loop); plans are immutable, so the cache never goes stale."""
        epochs = [int(e.data.get("epoch", 0)) for e in job.events if e.kind == "plan_published"]
        for epoch in epochs[-20:]:
            key = (job.name, epoch)
            if key in self._predicted:
                continue
            if job.last_plan is not None and job.last_plan.epoch == epoch:
                self._predicted[key] = job.last_plan.predicted_step_time_s
                continue
            try:
                raw = await asyncio.to_thread(self.core.plans.get, job.name, epoch)
            except RegistryError as exc:
                log.warning("job %s: plan %d not readable for the dashboard (%s)", job.name, epoch, exc)
                return  # asked again on the next update
            self._predicted[key] = None if raw is None else Plan.from_json(raw).predicted_step_time_s

    async def load_scale_table(self, job: Job) -> None:
        """FlexTrain's scale table of a job registered with a model, computed once per model off
        the event loop (pricing every configuration takes a fraction of a second)."""
        model = job.model_json
        cached = self._scale.get(job.name)
        if cached is not None and cached[0] is model:
            return
        if model is None:
            result: dict[str, Any] = {"rows": [], "why_empty": "the job was created without a model"}
        else:
            try:
                result = {"rows": await asyncio.to_thread(self.core.scale_table, job), "why_empty": ""}
            except RpcError as err:
                result = {"rows": [], "why_empty": err.message}
            except Exception as exc:  # a model the planners cannot price: say so, keep the page
                log.exception("job %s: no scale table", job.name)
                result = {"rows": [], "why_empty": f"the scale table could not be computed: {exc!r}"}
        self._scale[job.name] = (model, result)

    def scale_table(self, job: Job) -> dict[str, Any]:
        cached = self._scale.get(job.name)
        if cached is None or cached[0] is not job.model_json:
            return {"rows": [], "why_empty": "computing..."}
        return dict(cached[1])

    def view(self, job: Job, history_since: float) -> dict[str, Any]:

        now = time.time()
        return {
            "summary": job_summary(job),
            "now_unix": now,
            "stages": stage_rows(job, now),
            "grid": layout_grid(job),
            "history": self.history.columns(job.name, history_since),
            "plans": plans(job, self.history, lambda epoch: self._predicted.get((job.name, epoch))),
            "events": recent_events(job),
            "spares": spares(job),
            "scale": self.scale_table(job),
        }

    def jobs(self) -> list[dict[str, Any]]:

        return [job_summary(j) for j in sorted(self.core.table.jobs.values(), key=lambda j: j.name)]


def dashboard_router(core: DashboardCore, reads: Sequence[params.Depends]) -> APIRouter:
    """The page, its assets, its data routes and the event stream; starts the history sampler
    (on the running loop, cancelled with the Core's other tasks when it stops). `reads`: the
    REST API's read checks (the leader only; the scheduler token too with read_access "token"),
    applied to every data route and the stream. The page and its assets are public."""
    data = DashboardData(core)
    with contextlib.suppress(RuntimeError):  # no running loop: an app built for inspection only
        core.run_in_background(data.sample_forever())
    router = APIRouter()

    @router.get("/", include_in_schema=False)
    def index() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html", media_type="text/html")

    @router.get("/ui/{name}", include_in_schema=False)
    def asset(name: str) -> FileResponse:
        media_type = ASSETS.get(name)
        if media_type is None:
            raise HTTPException(404, detail=f"no dashboard asset {name!r}")
        return FileResponse(STATIC_DIR / name, media_type=media_type)

    @router.get("/api/v1/dashboard/jobs/{job}", dependencies=list(reads), tags=["dashboard"])
    async def job_view(job: JobName) -> dict[str, Any]:
        """Everything the dashboard shows of one job (members aggregated per stage)."""
        record = data.job(job)
        await data.load_predictions(record)
        await data.load_scale_table(record)
        return data.view(record, 0.0)

    @router.get(
        "/api/v1/dashboard/jobs/{job}/stages/{stage}/members",
        dependencies=list(reads),
        tags=["dashboard"],
    )
    async def stage_members(job: JobName, stage: int) -> dict[str, Any]:  # on the loop, as the jobs' writer
        """One stage's members (state, health, memory, last step), in DP order."""
        return {"job": job, "stage": stage, "members": members_of_stage(data.job(job), stage, time.time())}

    @router.get("/api/v1/dashboard/stream", dependencies=list(reads), tags=["dashboard"])
    async def stream(
        request: Request, job: Annotated[str | None, Query(description="the job whose view to send")] = None
    ) -> StreamingResponse:
        """Server-sent events: an `update` a second with {leader, core_id, jobs, view} (each
        history point is sent once); {leader: false, message} once this Core stops leading."""
        return StreamingResponse(
            _events(core, data, request, job),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
        )

    return router


async def _events(
    core: DashboardCore, data: DashboardData, request: Request, job: str | None
) -> AsyncIterator[str]:
    """One `update` a second (the history gains a point a second anyway); each history point is
    sent once, so an update stays small however long the page has been open."""
    started = time.monotonic()
    history_since = 0.0
    while time.monotonic() - started < STREAM_MAX_S and not await request.is_disconnected():
        payload = await _payload(core, data, job, history_since)
        view = payload.get("view")
        if view is not None and view["history"]["time_unix"]:
            history_since = view["history"]["time_unix"][-1]
        yield f"event: update\ndata: {_json(payload)}\n\n"
        await asyncio.sleep(STREAM_INTERVAL_S)


def _json(payload: dict[str, Any]) -> str:
    """JSON the browser can parse: a non-finite number (never expected) becomes null."""
    try:
        return json.dumps(payload, separators=(",", ":"), allow_nan=False)
    except ValueError:
        return json.dumps(_finite(payload), separators=(",", ":"), allow_nan=False)


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


async def _payload(
    core: DashboardCore, data: DashboardData, job: str | None, history_since: float
) -> dict[str, Any]:
    if not core.leads:
        return {"leader": False, "message": core.not_leader_message("http")}
    payload: dict[str, Any] = {"leader": True, "core_id": core.settings.core_id, "jobs": data.jobs()}
    if job is not None and job in core.table.jobs:
        record = core.table.jobs[job]
        try:
            await data.load_predictions(record)
            await data.load_scale_table(record)
            payload["view"] = data.view(record, history_since)
        except Exception as exc:  # one bad view must not end every viewer's stream
            log.exception("dashboard view of job %s failed", job)
            payload["error"] = f"the view of job {job!r} could not be built: {exc!r}"
    return payload
