"""Authentication and input validation of the Core's gRPC and REST APIs: bad requests get a clear
4xx / gRPC status with the reason, and change nothing."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tests.core.procs import AgentProcess, CoreProcess, create_job, new_token, wait_until
from wire.v1 import agent_pb2, executor_pb2, scheduler_pb2, scheduler_pb2_grpc

pytestmark = pytest.mark.multiproc


@pytest.fixture(scope="module")
def core(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[CoreProcess, str, str, list]]:
    tmp = tmp_path_factory.mktemp("core")
    token = new_token()
    proc = CoreProcess(tmp, "guarded", "memory://", token)
    proc.wait_leader()
    job_token = create_job(proc, token, "train")
    agents = [AgentProcess(tmp, "train", f"w{i}", proc.grpc_address, job_token, dp_rank=i) for i in range(2)]
    wait_until(
        lambda: len(proc.states("train")) == 2 and set(proc.states("train").values()) == {"RUNNING"},
        30,
        "two running workers",
    )
    yield proc, token, job_token, agents
    for agent in agents:
        agent.stop()
    proc.stop()


def scheduler_stub(core: CoreProcess) -> tuple[grpc.Channel, scheduler_pb2_grpc.SchedulerServiceStub]:
    channel = grpc.insecure_channel(core.grpc_address)
    return channel, scheduler_pb2_grpc.SchedulerServiceStub(channel)


def events(core: CoreProcess) -> list[dict]:
    return core.http.get("/api/v1/jobs/train/events").json()["events"]


SCHEDULER_KINDS = {"worker_preempting", "resources_offered", "plan_published"}


def scheduler_effects(core: CoreProcess) -> tuple[list[dict], dict[str, float | None]]:
    """What a scheduler call can change: its events and the members' preemption deadlines.
    (Workers keep stepping meanwhile, so unrelated events may arrive.)"""
    mine = [e for e in events(core) if e["kind"] in SCHEDULER_KINDS]
    deadlines = {m["worker_id"]: m["preemption_deadline_unix"] for m in core.job("train")["members"]}
    return mine, deadlines


@pytest.mark.timeout(60)
def test_preemption_needs_the_scheduler_token_and_changes_nothing_without_it(core: tuple) -> None:
    proc, token, job_token, _ = core
    channel, stub = scheduler_stub(proc)
    request = scheduler_pb2.SignalPreemptionRequest(
        job="train", worker_ids=["w0"], deadline_unix=time.time() + 30, reason="spot reclaim"
    )
    before = scheduler_effects(proc)
    for metadata, code in (
        (None, grpc.StatusCode.UNAUTHENTICATED),
        ([("authorization", "Bearer wrong-token-xxxxxxxxxx")], grpc.StatusCode.PERMISSION_DENIED),
        ([("authorization", f"Bearer {job_token}")], grpc.StatusCode.PERMISSION_DENIED),
    ):
        with pytest.raises(grpc.RpcError) as err:
            stub.SignalPreemption(request, metadata=metadata, timeout=5)
        assert err.value.code() == code, err.value.details()
    assert scheduler_effects(proc) == before
    assert proc.states("train")["w0"] == "RUNNING"

    response = stub.SignalPreemption(request, metadata=[("authorization", f"Bearer {token}")], timeout=5)
    wait_until(lambda: proc.states("train")["w0"] == "PREEMPTING", 5, "w0 PREEMPTING in REST")
    event = next(e for e in events(proc) if e["seq"] == response.event_seq)
    assert event["kind"] == "worker_preempting" and event["worker_id"] == "w0"
    assert "spot reclaim" in event["detail"]
    channel.close()


@pytest.mark.timeout(60)
def test_scheduler_rejects_bad_values_with_reasons(core: tuple) -> None:
    proc, token, _, _ = core
    channel, stub = scheduler_stub(proc)
    auth = [("authorization", f"Bearer {token}")]
    before = scheduler_effects(proc)
    cases = [
        (
            scheduler_pb2.SignalPreemptionRequest(
                job="nope", worker_ids=["w0"], deadline_unix=time.time() + 9
            ),
            grpc.StatusCode.NOT_FOUND,
            "unknown job 'nope'",
        ),
        (
            scheduler_pb2.SignalPreemptionRequest(
                job="train", worker_ids=["ghost"], deadline_unix=time.time() + 9
            ),
            grpc.StatusCode.NOT_FOUND,  # an unknown worker, like an unknown job
            "no worker 'ghost'",
        ),
        (
            scheduler_pb2.SignalPreemptionRequest(
                job="train", worker_ids=["w1"], deadline_unix=time.time() - 9
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "not in the future",
        ),
        (
            scheduler_pb2.SignalPreemptionRequest(job="train", worker_ids=[], deadline_unix=time.time() + 9),
            grpc.StatusCode.INVALID_ARGUMENT,
            "worker_ids is empty",
        ),
        (
            scheduler_pb2.SignalPreemptionRequest(
                job="train", worker_ids=["w1", "w1"], deadline_unix=time.time() + 9
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "duplicates",
        ),
    ]
    for request, code, text in cases:
        with pytest.raises(grpc.RpcError) as err:
            stub.SignalPreemption(request, metadata=auth, timeout=5)
        assert err.value.code() == code and text in err.value.details(), err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        stub.ReclaimResources(
            scheduler_pb2.ReclaimResourcesRequest(job="train", devices=0, deadline_unix=time.time() + 9),
            metadata=auth,
            timeout=5,
        )
    assert (
        err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "devices must be >= 1" in err.value.details()
    )
    assert scheduler_effects(proc) == before
    channel.close()


@pytest.mark.timeout(60)
def test_malformed_grpc_bytes_get_invalid_argument(core: tuple) -> None:
    proc, token, job_token, agents = core
    channel = grpc.insecure_channel(proc.grpc_address)
    raw = channel.unary_unary(
        "/elaswave.v1.SchedulerService/GetJobState",
        request_serializer=lambda b: b,
        response_deserializer=lambda b: b,
    )
    with pytest.raises(grpc.RpcError) as err:
        raw(b"\xff\xff\xff\xff\x0f", metadata=[("authorization", f"Bearer {token}")], timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "malformed elaswave.v1.GetJobStateRequest" in err.value.details()

    stream = channel.stream_stream(
        "/elaswave.v1.AgentService/Connect", request_serializer=lambda b: b, response_deserializer=lambda b: b
    )
    with pytest.raises(grpc.RpcError) as err:
        list(
            stream(
                iter([b"\x0a\x05garbage-not-proto\xff"]),
                metadata=[("authorization", f"Bearer {job_token}")],
                timeout=5,
            )
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    # A well-formed stream that does not start with register is refused with the reason.
    connect = channel.stream_stream(
        "/elaswave.v1.AgentService/Connect",
        request_serializer=agent_pb2.ConnectRequest.SerializeToString,
        response_deserializer=agent_pb2.ConnectResponse.FromString,
    )
    with pytest.raises(grpc.RpcError) as err:
        list(
            connect(
                iter([agent_pb2.ConnectRequest(heartbeat=agent_pb2.Heartbeat(seq=1))]),
                metadata=[("authorization", f"Bearer {job_token}")],
                timeout=5,
            )
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "first message must be register" in err.value.details()

    register = agent_pb2.ConnectRequest(
        register=agent_pb2.Register(job="train", worker_id="bad id!", host="h")
    )
    with pytest.raises(grpc.RpcError) as err:
        list(connect(iter([register]), metadata=[("authorization", f"Bearer {job_token}")], timeout=5))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "worker_id" in err.value.details()

    register = agent_pb2.ConnectRequest(register=agent_pb2.Register(job="train", worker_id="w9", host="h"))
    with pytest.raises(grpc.RpcError) as err:
        list(connect(iter([register]), metadata=[("authorization", "Bearer not-the-job-token")], timeout=5))
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "w9" not in proc.states("train")

    # Acks speak for one worker: they carry its own credential, which its agent was given (w1's:
    # w0 was preempted and has left by now).
    w1_auth = [("authorization", f"Bearer {agents[1].worker_token_file.read_text()}")]
    ack = channel.unary_unary(
        "/elaswave.v1.ExecutorService/AckPlanPhase",
        request_serializer=executor_pb2.AckPlanPhaseRequest.SerializeToString,
        response_deserializer=executor_pb2.AckPlanPhaseResponse.FromString,
    )
    with pytest.raises(grpc.RpcError) as err:
        ack(
            executor_pb2.AckPlanPhaseRequest(
                job="train", worker_id="w1", epoch=5, phase=executor_pb2.PLAN_PHASE_APPLIED
            ),
            metadata=w1_auth,
            timeout=5,
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "never published" in err.value.details()
    # A FAILED ack must say why and of which kind (the kind decides the next plan's mode).
    with pytest.raises(grpc.RpcError) as err:
        ack(
            executor_pb2.AckPlanPhaseRequest(
                job="train", worker_id="w1", epoch=0, phase=executor_pb2.PLAN_PHASE_FAILED, failure_reason="x"
            ),
            metadata=w1_auth,
            timeout=5,
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "failure" in err.value.details()
    channel.close()


@pytest.mark.timeout(60)
def test_rest_rejects_malformed_bodies_and_unknown_jobs_with_4xx(core: tuple) -> None:
    proc, token, _, _ = core
    auth = {"Authorization": f"Bearer {token}"}

    def job_names() -> list[str]:
        return [j["name"] for j in proc.http.get("/api/v1/jobs").json()["jobs"]]

    before = job_names()
    assert proc.http.get("/api/v1/jobs/nope").status_code == 404
    assert proc.http.get("/api/v1/jobs/nope").json()["detail"] == "unknown job 'nope'"
    bad_bodies = [
        b"{not json",
        b"[]",
        b'{"name": ""}',
        b'{"name": "x", "expected_workers": -1}',
        b'{"name": "x", "surprise": 1}',
        b'{"name": "x", "layout": {"num_layers": "many"}}',
    ]
    for body in bad_bodies:
        response = proc.http.post(
            "/api/v1/jobs", content=body, headers={**auth, "content-type": "application/json"}
        )
        assert 400 <= response.status_code < 500, (body, response.status_code, response.text)
        assert response.json()["detail"], body
    assert proc.http.post("/api/v1/jobs", json={"name": "x"}).status_code == 401
    assert (
        proc.http.post(
            "/api/v1/jobs", json={"name": "x"}, headers={"Authorization": "Bearer wrong"}
        ).status_code
        == 403
    )
    assert proc.http.post("/api/v1/jobs", json={"name": "train"}, headers=auth).status_code == 409
    preempt = proc.http.post(
        "/api/v1/jobs/train/preempt", json={"worker_ids": ["w1"], "deadline_unix": 1.0}, headers=auth
    )
    assert preempt.status_code == 422 and "not in the future" in json.dumps(preempt.json()["detail"])
    assert proc.http.get("/api/v1/jobs/train/events?limit=0").status_code == 422
    assert job_names() == before == ["train"]
    assert proc.job("train")["members_by_state"].get("PREEMPTING", 0) <= 1  # only w0, from the test above


@pytest.mark.timeout(60)
def test_health_reflection_openapi_and_metrics(core: tuple) -> None:
    proc, _, _, _ = core
    channel = grpc.insecure_channel(proc.grpc_address)
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "elaswave.v1.AgentService", "elaswave.v1.SchedulerService"):
        status = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status
        assert status == health_pb2.HealthCheckResponse.SERVING, service
    reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
    responses = reflection.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
    )
    names = {s.name for r in responses for s in r.list_services_response.service}
    assert {
        "elaswave.v1.AgentService",
        "elaswave.v1.ExecutorService",
        "elaswave.v1.SchedulerService",
        "grpc.health.v1.Health",
    } <= names
    channel.close()
    schema = proc.http.get("/openapi.json").json()
    assert {"/api/v1/jobs", "/api/v1/jobs/{job}", "/api/v1/jobs/{job}/events"} <= set(schema["paths"])
    metrics = proc.http.get("/metrics").text
    assert 'elaswave_agent_reports_total{kind="heartbeat"}' in metrics
    assert "elaswave_core_is_leader 1.0" in metrics


@pytest.mark.timeout(30)
def test_core_refuses_to_start_without_a_scheduler_token(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "ELASWAVE_SCHEDULER_TOKEN"}
    result = subprocess.run(
        [sys.executable, "-m", "elaswave.cli", "core", "--grpc-port", "0", "--http-port", "0"],
        env=env,
        capture_output=True,
        text=True,
        timeout=20,
    )
    assert result.returncode == 2
    assert "scheduler_token is required" in result.stderr
    result = subprocess.run(
        [sys.executable, "-m", "elaswave.cli", "core", "--grpc-port", "70000"],
        env={**env, "ELASWAVE_SCHEDULER_TOKEN": new_token()},
        capture_output=True,
        text=True,
        timeout=20,
    )
    assert result.returncode == 2 and "grpc_port" in result.stderr
