"""Creating a job: the request body of `POST /api/v1/jobs` and the one function that checks it and
stores the job, shared by the REST route and the rendezvous of `elaswave run --core`."""

from __future__ import annotations

import json
import re
import secrets
import time
from typing import TYPE_CHECKING, Any

from fastapi import HTTPException
from pydantic import BaseModel, ConfigDict, Field, SecretStr

from core_service.config import JOB_NAME_PATTERN, MIN_TOKEN_LENGTH, JobSpec, check_worker_bounds
from core_service.grpc_util import RpcError
from core_service.http_guard import field_error
from core_service.jobs import Job, JobExists
from core_service.limits import (
    MAX_DEVICES,
    MAX_LAYERS,
    MAX_SPARE_WORKERS,
    MAX_TOKEN_CHARS,
    MAX_WORKERS_PER_JOB,
)
from planners.chameleon.schema import state_from_dict
from planners.layout import Layout
from planners.validation import validate

if TYPE_CHECKING:
    from core_service.seams import CoreState


MAX_STORES = 8
STORE_ADDRESS = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9][A-Za-z0-9.-]{0,252}):\d{1,5}")


def store_problem(stores: list[str]) -> str | None:
    """Why a list of store addresses cannot be stored (None when it can)."""
    for address in stores:
        if not STORE_ADDRESS.fullmatch(address) or not 0 < int(address.rsplit(":", 1)[1]) < 65536:
            return f"store address {address[:80]!r} is not HOST:PORT"
    if len(set(stores)) != len(stores):
        return f"store addresses {stores} repeat one"
    return None


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
    stores: list[str] = Field(
        default_factory=list,
        max_length=MAX_STORES,
        description="the job's rendezvous stores as HOST:PORT, in the order its workers try them; run "
        "beside the job (its launchers, or pods of their own), stored so that any Core that leads knows them",
    )


class CreateJobResponse(BaseModel):
    name: str
    token: str = Field(description="per-job token for agents and executors; shown only once")


async def store_new_job(core: CoreState, body: CreateJobRequest) -> CreateJobResponse:
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
    if problem := store_problem(body.stores):
        raise HTTPException(422, detail=field_error("stores", problem))
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
        core.table.create_job(
            spec, layout_json, now=time.time(), model_json=model_json, stores=tuple(body.stores)
        )
    except JobExists as exc:
        raise HTTPException(409, detail=str(exc)) from None
    try:
        await core.wait_durable()
    except RpcError as err:
        raise HTTPException(503, detail=err.message) from None
    return CreateJobResponse(name=body.name, token=token)


class StoresRequest(BaseModel):
    """Body of PUT /api/v1/jobs/{job}/stores: the job's stores now (a launcher replaced one)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    stores: list[str] = Field(
        min_length=1, max_length=MAX_STORES, description="HOST:PORT, the workers' order"
    )


async def replace_stores(core: CoreState, job: Job, stores: list[str]) -> dict[str, Any]:
    """Store the job's new store list in its spec (so that any Core that leads later knows it);
    raises HTTPException with what is wrong. Recorded as a `stores_changed` event."""
    if problem := store_problem(stores):
        raise HTTPException(422, detail=field_error("stores", problem))
    if tuple(stores) != job.stores:
        job.stores = tuple(stores)
        core.table.save_spec(job)
        core.table.record(job, "stores_changed", detail=", ".join(stores), now=time.time())
        try:
            await core.wait_durable()
        except RpcError as err:
            raise HTTPException(503, detail=err.message) from None
    return {"job": job.name, "stores": list(job.stores)}


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
