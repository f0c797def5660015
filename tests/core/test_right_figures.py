"""Right figures (issue 27, item 5): a plan's MTTR counts from the change that caused it, and a
preemption is a departure, never a loss, in the plan's headline, the member's fields and metrics.

A real Core process (gRPC and REST on port 0) with four real agent streams (RawAgent) and
executor acknowledgements over gRPC.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from planners.layout import make_uniform_layout
from tests.core.procs import CoreProcess, create_job, new_token, wait_until
from tests.core.test_plan_flow import RawAgent
from wire.v1 import agent_pb2, executor_pb2, executor_pb2_grpc

LAYOUT = make_uniform_layout(num_layers=4, num_stages=2, dp=2, global_batch=8, num_micro_batches=2)
QUIET_S = 1.5  # between the already handled departure and the loss that causes the next plan


@pytest.fixture
def core(tmp_path: Path) -> Iterator[tuple[CoreProcess, str]]:
    token = new_token()
    # A long heartbeat timeout: only the closed stream below is a loss.
    proc = CoreProcess(tmp_path, "core", "memory://", token, heartbeat_timeout_s=30.0, lease_ttl_s=30.0)
    proc.wait_leader()
    yield proc, token
    proc.stop()


def _resume(core: CoreProcess, agents: dict[int, RawAgent], ranks: list[int], epoch: int) -> None:
    with grpc.insecure_channel(core.grpc_address) as channel:
        executor = executor_pb2_grpc.ExecutorServiceStub(channel)
        for rank in ranks:
            for phase in (
                executor_pb2.PLAN_PHASE_PAUSED,
                executor_pb2.PLAN_PHASE_APPLIED,
                executor_pb2.PLAN_PHASE_RESUMED,
            ):
                executor.AckPlanPhase(
                    executor_pb2.AckPlanPhaseRequest(
                        job="train", worker_id=f"w{rank}", epoch=epoch, phase=phase, phase_time_s=0.01
                    ),
                    metadata=agents[rank].auth,
                    timeout=5,
                )


def _plans(core: CoreProcess) -> list[dict[str, Any]]:
    return core.http.get("/api/v1/dashboard/jobs/train").json()["plans"]


@pytest.mark.multiproc
@pytest.mark.timeout(90)
def test_mttr_counts_from_the_plans_cause_and_a_preemption_is_a_departure(
    core: tuple[CoreProcess, str],
) -> None:
    proc, token = core
    job_token = create_job(proc, token, "train", layout=json.loads(LAYOUT.to_json()))
    agents = {}
    for rank in LAYOUT.ranks():
        stage = LAYOUT.stage_of_rank(rank)
        dp = LAYOUT.stages[stage].dp_index(rank)
        agents[rank] = RawAgent(proc.grpc_address, job_token, f"w{rank}", rank, stage, dp)
        agents[rank].step(0, stage, dp)
    try:
        wait_until(
            lambda: proc.job("train")["members_by_state"] == {"RUNNING": 4}, 15, "four running workers"
        )
        body = {"worker_ids": ["w3"], "deadline_unix": time.time() + 30, "reason": "spot reclaim"}
        preempted = proc.http.post(
            "/api/v1/jobs/train/preempt", json=body, headers={"Authorization": f"Bearer {token}"}
        )
        assert preempted.status_code == 202, preempted.text
        wait_until(lambda: proc.job("train")["plan_epoch"] == 1, 10, "the plan for the preemption")
        _resume(proc, agents, [0, 1, 2], 1)
        wait_until(lambda: proc.job("train")["phase"] == "RUNNING", 10, "epoch 1 applied")
        # The preempted worker leaves cleanly: an event already planned for (no new plan).
        agents[3].outgoing.put(agent_pb2.ConnectRequest(leave=agent_pb2.Leave(reason="preempted")))
        wait_until(lambda: proc.states("train").get("w3") == "LEFT", 10, "w3 LEFT")
        time.sleep(QUIET_S)
        agents[2].vanish()  # a real loss, long after that departure
        wait_until(lambda: proc.job("train")["plan_epoch"] == 2, 15, "the plan for the loss")
        _resume(proc, agents, [0, 1], 2)
        rows = wait_until(
            lambda: (r := _plans(proc)) and len(r) == 2 and "resume" in r[1]["phases_s"] and r,
            10,
            "MTTR rows",
        )
        first, second = rows
        # The plan for the loss counts from the loss, not from the departure QUIET_S before.
        assert second["triggers"][0] == "worker_lost w2", second
        assert second["phases_s"]["plan"] < QUIET_S / 2 and second["mttr_s"] < QUIET_S, second
        # A preemption is "departed", never "lost": headline, member fields, metrics.
        assert "departed ranks [3]" in first["detail"] and "lost ranks" not in first["detail"], first
        assert "lost ranks [2]" in second["detail"], second
        w3 = next(m for m in proc.job("train")["members"] if m["worker_id"] == "w3")
        assert w3["state"] == "LEFT" and w3["lost_reason"] == "" and w3["state_reason"] == "preempted"
        metrics = proc.http.get("/metrics").text
        assert 'elaswave_departures_total{kind="preempted"} 1.0' in metrics
        assert 'elaswave_departures_total{kind="left"} 0.0' in metrics  # counted once, as preempted
        lost_paths = re.findall(r'elaswave_failures_detected_total\{path="([^"]+)"\} 1\.0', metrics)
        assert lost_paths == ["stream_closed"], lost_paths  # w2 only
    finally:
        for agent in agents.values():
            agent.close()
