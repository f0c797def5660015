"""No scheduler call can hold the Core: inputs that size planning work are bounded, and planning
runs in a separate process within the client's deadline, stopped when the deadline passes.

The defects reproduced: `OfferResources(devices=4e9)` ran FlexTrain's scale table for four
billion devices on the event loop (the Core stopped answering for over 15 minutes); a model
registered with an unbounded `max_devices` did the same on every scale-table call; planning
kept burning CPU after the client's deadline.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import psutil
import pytest

from core_service.limits import MAX_DEVICES
from tests.core.procs import CoreProcess, create_job, new_token, wait_until
from wire.v1 import scheduler_pb2, scheduler_pb2_grpc

pytestmark = pytest.mark.multiproc

MODEL_FILE = Path(__file__).parents[2] / "planners/examples/llama2-34b-one-node-lost.json"


def model(max_devices: int) -> dict:
    body = json.loads(MODEL_FILE.read_text())
    body["failed_ranks"] = []
    body["max_devices"] = max_devices
    return body


@pytest.fixture(scope="module")
def core(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[CoreProcess, str]]:
    token = new_token()
    proc = CoreProcess(tmp_path_factory.mktemp("bounded"), "bounded", "memory://", token)
    proc.wait_leader()
    create_job(proc, token, "big", model=model(128))
    yield proc, token
    proc.stop()


def call(
    proc: CoreProcess, token: str, method: str, request: object, timeout_s: float
) -> grpc.RpcError | object:
    with grpc.insecure_channel(proc.grpc_address) as channel:
        stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        try:
            return getattr(stub, method)(
                request, metadata=[("authorization", f"Bearer {token}")], timeout=timeout_s
            )
        except grpc.RpcError as err:
            return err


@pytest.mark.timeout(60)
def test_inputs_that_size_planning_are_refused_above_their_maxima(core: tuple[CoreProcess, str]) -> None:
    proc, token = core
    huge = 4_000_000_000
    for method, request, field in (
        ("OfferResources", scheduler_pb2.OfferResourcesRequest(job="big", devices=huge), "devices"),
        ("PlanWhatIf", scheduler_pb2.PlanWhatIfRequest(job="big", add_devices=huge), "add_devices"),
        (
            "ReclaimResources",
            scheduler_pb2.ReclaimResourcesRequest(job="big", devices=huge, deadline_unix=time.time() + 60),
            "devices",
        ),
        (
            "PlanWhatIf",
            scheduler_pb2.PlanWhatIfRequest(job="big", remove_worker_ids=[f"w{i}" for i in range(10_001)]),
            "remove_worker_ids",
        ),
    ):
        err = call(proc, token, method, request, timeout_s=5)
        assert isinstance(err, grpc.RpcError), f"{method} accepted {field}"
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, err.code(), err.details())
        assert field in err.details() and (str(MAX_DEVICES) in err.details() or "10000" in err.details())
    # A model that would make every scale table unbounded is refused when the job is created.
    created = proc.http.post(
        "/api/v1/jobs",
        json={"name": "unbounded", "model": model(10**9)},
        headers={"Authorization": f"Bearer {token}"},
    )
    assert created.status_code == 422, created.text
    assert "max_devices" in created.text and len(created.content) < 2_000
    assert proc.http.get("/api/v1/jobs/unbounded").status_code == 404
    assert proc.http.get("/healthz", timeout=2).json()["role"] == "leader"


def planning_children(proc: CoreProcess) -> list[psutil.Process]:
    return [p for p in psutil.Process(proc.proc.pid).children() if "spawn" in " ".join(p.cmdline())]


@pytest.mark.timeout(60)
def test_planning_stops_at_the_client_deadline_and_the_core_keeps_answering(
    core: tuple[CoreProcess, str],
) -> None:
    proc, token = core
    stopped = "elaswave_planning_stopped_total"
    before = proc.metric(stopped) or 0.0
    # Far too short for a scale table (the planning process alone takes longer to start).
    err = call(proc, token, "GetScaleTable", scheduler_pb2.GetScaleTableRequest(job="big"), timeout_s=0.3)
    assert isinstance(err, grpc.RpcError) and err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_until(lambda: (proc.metric(stopped) or 0.0) == before + 1, 10, "the planning call to be stopped")
    wait_until(lambda: not planning_children(proc), 10, "the planning process to be gone")
    assert proc.http.get("/healthz", timeout=2).json()["role"] == "leader"

    # The next call gets a fresh planning process and the same table as the planner's own CLI.
    from planners.cli import scale_table as reference_scale_table

    rows = call(proc, token, "GetScaleTable", scheduler_pb2.GetScaleTableRequest(job="big"), timeout_s=30)
    assert not isinstance(rows, grpc.RpcError), rows
    assert isinstance(rows, scheduler_pb2.GetScaleTableResponse), rows
    reference = reference_scale_table(model(128))["entries"]
    assert [(r.devices, r.dp, r.pp) for r in rows.rows] == [
        (e["devices"], e["dp"], e["pp"]) for e in reference
    ]
    assert (proc.metric(stopped) or 0.0) == before + 1
