"""Every job can end (issue 27, item 4): FAILED when every worker is gone and no plan is possible,
STOPPED on request (REST DELETE and gRPC EndJob, the same token rule), progress kept across a
takeover.

Real Core processes with gRPC and REST on port 0; the failover runs two Cores on a real etcd
(tests/etcd_server.py), the leader SIGKILLed while every agent vanishes with it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from planners.layout import make_uniform_layout
from tests.core.procs import CoreProcess, create_job, new_token, wait_until
from tests.core.test_plan_flow import RawAgent
from wire.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc

LAYOUT = make_uniform_layout(num_layers=4, num_stages=2, dp=2, global_batch=8, num_micro_batches=2)
FAST_PROGRESS = {"ELASWAVE_PROGRESS_PERSIST_S": "0.2"}


def _agents(core: CoreProcess, job_token: str) -> dict[int, RawAgent]:
    agents = {}
    for rank in LAYOUT.ranks():
        stage = LAYOUT.stage_of_rank(rank)
        agents[rank] = RawAgent(
            core.grpc_address, job_token, f"w{rank}", rank, stage, LAYOUT.stages[stage].dp_index(rank)
        )
    return agents


def _step_all(agents: dict[int, RawAgent], step: int) -> None:
    for rank, agent in agents.items():
        stage = LAYOUT.stage_of_rank(rank)
        agent.step(step, stage, LAYOUT.stages[stage].dp_index(rank))


def _steps(core: CoreProcess, job: str) -> dict[str, int]:
    return {m["worker_id"]: (m.get("last_step") or {}).get("step", -1) for m in core.job(job)["members"]}


@pytest.fixture
def pair(tmp_path: Path, etcd_registry_url: str) -> Iterator[dict[str, Any]]:
    token = new_token()
    leader = CoreProcess(tmp_path, "core-a", etcd_registry_url, token, FAST_PROGRESS)
    leader.wait_leader()
    standby = CoreProcess(tmp_path, "core-b", etcd_registry_url, token, FAST_PROGRESS)
    state: dict[str, Any] = {"token": token, "cores": [leader, standby], "agents": []}
    yield state
    for agent in state["agents"]:
        agent.close()
    for core in state["cores"]:
        core.stop()


@pytest.mark.etcd
@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_a_failover_that_loses_every_worker_ends_the_job_failed_with_its_progress(pair: dict) -> None:
    leader, standby = pair["cores"]
    job_token = create_job(leader, pair["token"], "train", layout=json.loads(LAYOUT.to_json()))
    agents = _agents(leader, job_token)
    pair["agents"].extend(agents.values())
    _step_all(agents, 5)
    wait_until(lambda: set(_steps(leader, "train").values()) == {5}, 15, "every worker at step 5")
    time.sleep(0.5)  # past progress_persist_s: the next report is stored
    _step_all(agents, 113)
    wait_until(lambda: set(_steps(leader, "train").values()) == {113}, 15, "every worker at step 113")
    time.sleep(0.5)  # the registry writes are queued in order; let them land
    leader.kill()
    for agent in agents.values():  # their node went with the leader's
        agent.vanish()
    standby.wait_leader(timeout_s=20)
    job = wait_until(
        lambda: (j := standby.job("train"))["phase"] == "FAILED" and j,
        30,
        "the new leader to end the job FAILED",
    )
    assert "every worker is gone and no plan is possible" in job["end_reason"]
    assert "every stage would lose all of its ranks" in job["end_reason"]
    assert job["members_by_state"] == {"LOST": 4}
    # Progress survived the takeover: each member shows the step it had reached.
    assert set(_steps(standby, "train").values()) == {113}
    events = standby.http.get("/api/v1/jobs/train/events", params={"limit": 10_000}).json()["events"]
    failed = [e for e in events if e["kind"] == "job_failed"]
    assert len(failed) == 1 and "latest checkpoint" in failed[0]["detail"]
    assert "latest_checkpoint" in failed[0]["data"]
    # Terminal: a worker may not register again, and nothing is planned.
    with pytest.raises(grpc.RpcError) as refused:
        RawAgent(standby.grpc_address, job_token, "w9", -1, 0, 0)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "is FAILED" in (refused.value.details() or "")


@pytest.fixture
def core(tmp_path: Path) -> Iterator[tuple[CoreProcess, str]]:
    token = new_token()
    proc = CoreProcess(tmp_path, "core", "memory://", token)
    proc.wait_leader()
    yield proc, token
    proc.stop()


@pytest.mark.multiproc
@pytest.mark.timeout(60)
def test_delete_and_end_job_stop_any_job_with_the_scheduler_token(core: tuple[CoreProcess, str]) -> None:
    proc, token = core
    admin = {"Authorization": f"Bearer {token}"}
    job_token = create_job(proc, token, "train", layout=json.loads(LAYOUT.to_json()))
    agents = _agents(proc, job_token)
    try:
        _step_all(agents, 3)
        wait_until(lambda: set(_steps(proc, "train").values()) == {3}, 15, "every worker at step 3")
        url = f"http://127.0.0.1:{proc.http_port}/api/v1/jobs/train"
        assert httpx.delete(url, timeout=5).status_code == 401
        assert (
            httpx.delete(url, headers={"Authorization": "Bearer " + "x" * 32}, timeout=5).status_code == 403
        )
        assert httpx.delete(url + "x", headers=admin, timeout=5).status_code == 404
        ended = httpx.delete(url, params={"reason": "maintenance"}, headers=admin, timeout=5)
        assert ended.status_code == 200, ended.text
        body = ended.json()
        assert body["phase"] == "STOPPED" and body["stopping_worker_ids"] == ["w0", "w1", "w2", "w3"]
        job = proc.job("train")
        assert job["phase"] == "STOPPED" and job["end_reason"] == "ended on request (maintenance)"
        kinds = [e["kind"] for e in proc.http.get("/api/v1/jobs/train/events").json()["events"]]
        assert kinds.index("checkpoint_requested") < kinds.index("job_stopped")
        again = httpx.delete(url, headers=admin, timeout=5)  # answered as it is
        assert again.json()["phase"] == "STOPPED" and again.json()["stopping_worker_ids"] == []
    finally:
        for agent in agents.values():
            agent.close()
    # The gRPC twin, same rules: the scheduler token, NOT_FOUND for no such job.
    create_job(proc, token, "other")
    with grpc.insecure_channel(proc.grpc_address) as channel:
        scheduler = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        with pytest.raises(grpc.RpcError) as denied:
            scheduler.EndJob(scheduler_pb2.EndJobRequest(job="other"), timeout=5)
        assert denied.value.code() == grpc.StatusCode.UNAUTHENTICATED
        auth = [("authorization", f"Bearer {token}")]
        with pytest.raises(grpc.RpcError) as missing:
            scheduler.EndJob(scheduler_pb2.EndJobRequest(job="nope"), metadata=auth, timeout=5)
        assert missing.value.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.PERMISSION_DENIED)
        answer = scheduler.EndJob(
            scheduler_pb2.EndJobRequest(job="other", reason="done"), metadata=auth, timeout=5
        )
        assert answer.phase == common_pb2.JOB_PHASE_STOPPED and not answer.stopping_worker_ids
        state = scheduler.GetJobState(scheduler_pb2.GetJobStateRequest(job="other"), metadata=auth, timeout=5)
        assert state.phase == common_pb2.JOB_PHASE_STOPPED and state.end_reason == "ended on request (done)"
