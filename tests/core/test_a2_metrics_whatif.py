"""A real Core's /metrics after real calls: per-method gRPC and per-route REST latency histograms,
and refusals counted per API; and PlanWhatIf with added devices, answered from FlexTrain's scale
table for a job with a model and refused for a job without one."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from planners.layout import Layout
from tests.core.procs import CoreProcess, create_job, new_token
from wire.v1 import (
    agent_pb2,
    agent_pb2_grpc,
    executor_pb2,
    executor_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)

pytestmark = pytest.mark.multiproc

GRPC = "elaswave_grpc_server_handling_seconds_count"
HTTP = "elaswave_http_request_duration_seconds_count"
REJECTED = "elaswave_rejected_requests_total"


@pytest.fixture(scope="module")
def core(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[CoreProcess, str, str]]:
    tmp = tmp_path_factory.mktemp("a2metrics")
    token = new_token()
    proc = CoreProcess(tmp, "a2m", "memory://", token)
    proc.wait_leader()
    job_token = create_job(proc, token, "plain")
    yield proc, token, job_token
    proc.stop()


def counts(proc: CoreProcess, wanted: dict[str, tuple[str, dict[str, str]]]) -> dict[str, float]:
    return {key: proc.metric(name, **labels) for key, (name, labels) in wanted.items()}


@pytest.mark.timeout(60)
def test_latency_histograms_and_refusals_move_with_real_calls(core: tuple[CoreProcess, str, str]) -> None:
    proc, token, job_token = core
    sched, execu = "elaswave.v1.SchedulerService", "elaswave.v1.ExecutorService"
    wanted = {
        "state_ok": (GRPC, {"service": sched, "method": "GetJobState", "code": "OK"}),
        # GetJobState is a read (open by default); a planning call needs the scheduler token.
        "table_denied": (GRPC, {"service": sched, "method": "GetScaleTable", "code": "PERMISSION_DENIED"}),
        "ack_denied": (GRPC, {"service": execu, "method": "AckPlanPhase", "code": "PERMISSION_DENIED"}),
        "connect_ok": (GRPC, {"service": "elaswave.v1.AgentService", "method": "Connect", "code": "OK"}),
        "rej_scheduler": (REJECTED, {"api": "scheduler", "reason": "PERMISSION_DENIED"}),
        "rej_executor": (REJECTED, {"api": "executor", "reason": "PERMISSION_DENIED"}),
        "rej_rest_401": (REJECTED, {"api": "rest", "reason": "UNAUTHENTICATED"}),
        "rej_rest_403": (REJECTED, {"api": "rest", "reason": "PERMISSION_DENIED"}),
        "rej_rest_404": (REJECTED, {"api": "rest", "reason": "NOT_FOUND"}),
        "get_job": (HTTP, {"method": "GET", "route": "/api/v1/jobs/{job}", "status": "200"}),
        "post_401": (HTTP, {"method": "POST", "route": "/api/v1/jobs", "status": "401"}),
        "command_404": (
            HTTP,
            {"method": "POST", "route": "/api/v1/jobs/{job}/workers/{worker}/commands", "status": "404"},
        ),
    }
    before = counts(proc, wanted)
    good, bad = [("authorization", f"Bearer {token}")], [("authorization", "Bearer wrong-token-0123456789")]
    with grpc.insecure_channel(proc.grpc_address) as channel:
        scheduler = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        for _ in range(3):
            scheduler.GetJobState(scheduler_pb2.GetJobStateRequest(job="plain"), metadata=good, timeout=5)
        with pytest.raises(grpc.RpcError):
            scheduler.GetScaleTable(scheduler_pb2.GetScaleTableRequest(job="plain"), metadata=bad, timeout=5)
        with pytest.raises(grpc.RpcError):
            executor_pb2_grpc.ExecutorServiceStub(channel).AckPlanPhase(
                executor_pb2.AckPlanPhaseRequest(
                    job="plain", worker_id="w0", epoch=0, phase=executor_pb2.PLAN_PHASE_RECEIVED
                ),
                metadata=bad,
                timeout=5,
            )
        # One agent stream, registered and left cleanly: one Connect with status OK.
        register = agent_pb2.Register(job="plain", worker_id="w0", host="h", heartbeat_interval_ms=200)
        stream = agent_pb2_grpc.AgentServiceStub(channel).Connect(
            iter(
                [
                    agent_pb2.ConnectRequest(register=register),
                    agent_pb2.ConnectRequest(leave=agent_pb2.Leave()),
                ]
            ),
            metadata=[("authorization", f"Bearer {job_token}")],
            timeout=10,
        )
        assert [r.WhichOneof("body") for r in stream] == ["ack"]
    for _ in range(2):
        assert proc.http.get("/api/v1/jobs/plain").status_code == 200
    assert proc.http.post("/api/v1/jobs", json={"name": "x"}).status_code == 401
    assert (
        proc.http.post(
            "/api/v1/jobs", json={"name": "x"}, headers={"Authorization": "Bearer nope"}
        ).status_code
        == 403
    )
    assert (
        proc.http.post(
            "/api/v1/jobs/plain/workers/ghost/commands",
            json={"command": "report_now"},
            headers={"Authorization": f"Bearer {token}"},
        ).status_code
        == 404
    )
    after = counts(proc, wanted)
    moved = {key: after[key] - before[key] for key in wanted}
    assert moved == {
        "state_ok": 3,
        "table_denied": 1,
        "ack_denied": 1,
        "connect_ok": 1,
        "rej_scheduler": 1,
        "rej_executor": 1,
        "rej_rest_401": 1,
        "rej_rest_403": 1,
        "rej_rest_404": 1,
        "get_job": 2,
        "post_401": 1,
        "command_404": 1,
    }
    # The histograms measured something (seconds, not zero) and sort it into buckets.
    assert (
        proc.metric(
            "elaswave_grpc_server_handling_seconds_sum", service=sched, method="GetJobState", code="OK"
        )
        > 0
    )
    assert (
        proc.metric(
            "elaswave_http_request_duration_seconds_bucket",
            method="GET",
            route="/api/v1/jobs/{job}",
            status="200",
            le="+Inf",
        )
        == after["get_job"]
    )


def _model() -> dict:
    model = json.loads(
        (Path(__file__).parents[2] / "planners/examples/llama2-34b-one-node-lost.json").read_text()
    )
    model["failed_ranks"] = []
    model["max_devices"] = 128
    return model


@pytest.mark.timeout(90)
def test_plan_what_if_adds_devices_through_the_scale_table(core: tuple[CoreProcess, str, str]) -> None:
    proc, token, _ = core
    create_job(proc, token, "big", model=_model())
    auth = [("authorization", f"Bearer {token}")]
    with grpc.insecure_channel(proc.grpc_address) as channel:
        scheduler = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        # References: the scale table and the offer decision for the same 32 devices.
        rows = scheduler.GetScaleTable(
            scheduler_pb2.GetScaleTableRequest(job="big"), metadata=auth, timeout=30
        ).rows
        offer = scheduler.OfferResources(
            scheduler_pb2.OfferResourcesRequest(job="big", devices=32), metadata=auth, timeout=30
        )
        assert offer.accepted and "scale to 128 devices (DP=16, PP=2)" in offer.reason
        before = (proc.job("big")["last_event_seq"], proc.job("big")["plan_epoch"])

        what_if = scheduler.PlanWhatIf(
            scheduler_pb2.PlanWhatIfRequest(job="big", add_devices=32), metadata=auth, timeout=30
        )
        row = next(r for r in rows if r.devices == 128)
        assert what_if.runnable and what_if.plan.epoch == 0
        assert "128 devices as DP=16, PP=2, TP=4 (from 96)" in what_if.reason
        assert what_if.plan.predicted_step_time_s == pytest.approx(row.step_time_s)
        layout = Layout.from_json(what_if.plan.layout_json)
        assert (layout.num_stages, len(layout.stages[0].ranks), layout.num_layers) == (2, 16, 48)
        assert layout.global_batch == _model()["job"]["global_batch"]

        small = scheduler.PlanWhatIf(
            scheduler_pb2.PlanWhatIfRequest(job="big", add_devices=1), metadata=auth, timeout=30
        )
        assert not small.runnable and "no scale-table entry above the current allocation" in small.reason
        refusals = [
            (
                scheduler_pb2.PlanWhatIfRequest(job="plain", add_devices=4),
                "adding devices is not modelled for job 'plain'",
            ),
            (
                scheduler_pb2.PlanWhatIfRequest(job="big", add_devices=4, remove_worker_ids=["w0"]),
                "add_devices and remove_worker_ids together are not modelled",
            ),
        ]
        for request, text in refusals:
            with pytest.raises(grpc.RpcError) as err:
                scheduler.PlanWhatIf(request, metadata=auth, timeout=30)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and text in err.value.details()
    # A what-if stores and records nothing.
    assert (proc.job("big")["last_event_seq"], proc.job("big")["plan_epoch"]) == before
