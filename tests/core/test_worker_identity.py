"""A worker's credential is its own: issued at registration, bound to its worker id.

The defects reproduced: with the shared job token, (1) a live worker's identity was taken over
from another host (the real worker was then declared LOST while its agent kept heartbeating),
(2) any number of new worker ids registered into a job that expects two, (3) any holder of the
job token could acknowledge plans or report failures as any worker; and gRPC said whether a job
exists before checking the token.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import grpc
import pytest

from planners.layout import make_uniform_layout
from tests.core.procs import CoreProcess, create_job, new_token, wait_until
from tests.core.test_plan_flow import RawAgent
from wire.v1 import agent_pb2, agent_pb2_grpc, executor_pb2, executor_pb2_grpc

pytestmark = pytest.mark.multiproc

LAYOUT = make_uniform_layout(num_layers=4, num_stages=1, dp=2, global_batch=8, num_micro_batches=2)


@pytest.fixture
def core(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[CoreProcess, str]]:
    token = new_token()
    proc = CoreProcess(tmp_path_factory.mktemp("identity"), "identity", "memory://", token)
    proc.wait_leader()
    job_token = create_job(
        proc, token, "train", layout=json.loads(LAYOUT.to_json()), expected_workers=2, spare_workers=1
    )
    yield proc, job_token
    proc.stop()


def register(
    proc: CoreProcess, job: str, worker_id: str, metadata: list[tuple[str, str]]
) -> agent_pb2.RegisterAck:
    """One registration on a fresh stream from host "elsewhere": the ack, or grpc.RpcError."""
    with grpc.insecure_channel(proc.grpc_address) as channel:
        reg = agent_pb2.Register(
            job=job, worker_id=worker_id, host="elsewhere", rank=-1, heartbeat_interval_ms=200
        )
        call = agent_pb2_grpc.AgentServiceStub(channel).Connect(
            iter([agent_pb2.ConnectRequest(register=reg)]), metadata=metadata, timeout=5
        )
        try:
            return next(call).ack
        finally:
            call.cancel()


def rpc_code(fn: object, *args: object, **kwargs: object) -> grpc.StatusCode:
    try:
        fn(*args, **kwargs)  # type: ignore[operator]
    except grpc.RpcError as err:
        return err.code()
    return grpc.StatusCode.OK


@pytest.mark.timeout(60)
def test_a_live_identity_cannot_be_taken_and_the_job_cannot_grow_past_its_limit(
    core: tuple[CoreProcess, str],
) -> None:
    proc, job_token = core
    auth = [("authorization", f"Bearer {job_token}")]
    agents = [RawAgent(proc.grpc_address, job_token, f"w{rank}", rank, 0, rank) for rank in (0, 1)]
    spare = RawAgent(proc.grpc_address, job_token, "w2", -1, -1, -1)
    tokens = [a.ack.worker_token for a in (*agents, spare)]
    assert all(len(t) >= 24 for t in tokens) and len(set(tokens)) == 3
    for rank, agent in enumerate(agents):
        agent.step(0, 0, rank)
    wait_until(lambda: len(proc.states("train")) == 3, 10, "three members")
    before = proc.job("train")

    # Expected 2 + 1 spare: a fourth worker is refused, and nothing changes.
    with pytest.raises(grpc.RpcError) as err:
        register(proc, "train", "w3", auth)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "limit" in err.value.details()

    # A live worker's id, registered from elsewhere with the job token (or another worker's
    # credential), is refused; the real worker keeps its stream, host and state.
    for metadata in (auth, [*auth, ("x-elaswave-worker-token", tokens[1])]):
        with pytest.raises(grpc.RpcError) as err:
            register(proc, "train", "w0", metadata)
        assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS, err.value.details()

    def identities(job: dict) -> list[tuple[str, str, int]]:
        return [(m["worker_id"], m["host"], m["pid"]) for m in job["members"]]

    after = proc.job("train")
    assert identities(after) == identities(before)
    assert all(m["state"] != "LOST" for m in after["members"])
    assert "worker_reconnected" not in [
        e["kind"] for e in proc.http.get("/api/v1/jobs/train/events").json()["events"]
    ]
    assert proc.metric("elaswave_agent_streams") == 3

    # Its own credential re-registers it (a reconnect), and the credential stays the same.
    again = register(proc, "train", "w2", [*auth, ("x-elaswave-worker-token", tokens[2])])
    assert again.worker_token == tokens[2]
    for agent in (*agents, spare):
        agent.close()


@pytest.mark.timeout(60)
def test_acks_and_failure_reports_only_from_the_worker_itself(core: tuple[CoreProcess, str]) -> None:
    proc, job_token = core
    agents = [RawAgent(proc.grpc_address, job_token, f"w{rank}", rank, 0, rank) for rank in (0, 1)]
    job_auth = [("authorization", f"Bearer {job_token}")]
    with grpc.insecure_channel(proc.grpc_address) as channel:
        executor = executor_pb2_grpc.ExecutorServiceStub(channel)
        report = executor_pb2.ReportPeerFailureRequest(
            job="train", worker_id="w0", peer_rank=-1, step=3, operation="all_reduce", error="reset"
        )
        ack = executor_pb2.AckPlanPhaseRequest(
            job="train", worker_id="w0", epoch=0, phase=executor_pb2.PLAN_PHASE_RECEIVED
        )
        stores = executor_pb2.GetJobStoresRequest(job="train", worker_id="w0")
        methods = {"report": executor.ReportPeerFailure, "ack": executor.AckPlanPhase}
        for name, request in (("report", report), ("ack", ack), ("stores", stores)):
            method = methods.get(name, executor.GetJobStores)
            assert (
                rpc_code(method, request, metadata=job_auth, timeout=5) == grpc.StatusCode.PERMISSION_DENIED
            )
            assert (
                rpc_code(method, request, metadata=agents[1].auth, timeout=5)
                == grpc.StatusCode.PERMISSION_DENIED
            )
            assert rpc_code(method, request, timeout=5) == grpc.StatusCode.UNAUTHENTICATED
        assert proc.job("train")["plan_epoch"] == 0
        # A job whose launcher reports no stores: the worker itself hears the (empty) list.
        assert list(executor.GetJobStores(stores, metadata=agents[0].auth, timeout=5).stores) == []
        # w0 itself, naming no peer (-1): the step is replayed on the same layout.
        answer = executor.ReportPeerFailure(report, metadata=agents[0].auth, timeout=5)
        assert not answer.peer_marked_lost and answer.peer_worker_id == ""
        wait_until(lambda: proc.job("train")["plan_epoch"] == 1, 10, "the replay plan")
        # Reading plans needs only the job's token.
        plans = executor.SubscribePlans(
            executor_pb2.SubscribePlansRequest(job="train", worker_id="w0"), metadata=job_auth, timeout=10
        )
        assert next(plans).plan.epoch == 1
        plans.cancel()
    for agent in agents:
        agent.close()


@pytest.mark.timeout(60)
def test_the_token_is_checked_before_the_job_is_looked_up(core: tuple[CoreProcess, str]) -> None:
    proc, _ = core
    wrong = [("authorization", "Bearer wrong-token-0123456789")]
    answers = {}
    for job in ("train", "no-such-job"):
        with pytest.raises(grpc.RpcError) as err:
            register(proc, job, "w9", wrong)
        answers[job] = (err.value.code(), err.value.details().replace(job, "JOB"))
        with grpc.insecure_channel(proc.grpc_address) as channel:
            plans = executor_pb2_grpc.ExecutorServiceStub(channel).SubscribePlans(
                executor_pb2.SubscribePlansRequest(job=job, worker_id="w9"), metadata=wrong, timeout=5
            )
            with pytest.raises(grpc.RpcError) as err:
                next(plans)
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert answers["train"] == answers["no-such-job"]
    assert answers["train"][0] == grpc.StatusCode.PERMISSION_DENIED
