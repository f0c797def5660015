"""Detection paths on the embedded (in-memory) Core: fail-slow from step-time outliers, and a
SIGTERM to an agent turning into a preemption report followed by a clean leave."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.core.procs import AgentProcess, CoreProcess, create_job, new_token, wait_until

pytestmark = pytest.mark.multiproc


@pytest.mark.timeout(90)
def test_straggler_is_flagged_slow_and_sigterm_becomes_preemption(tmp_path: Path) -> None:
    token = new_token()
    core = CoreProcess(
        tmp_path,
        "detect",
        "memory://",
        token,
        extra_env={"ELASWAVE_FAILSLOW__TRIGGER_STEPS": "3", "ELASWAVE_FAILSLOW__RATIO": "2.0"},
    )
    agents: list[AgentProcess] = []
    try:
        core.wait_leader()
        job_token = create_job(core, token, "train")
        # Same stage, three peers; w2 takes 6x longer per step.
        for i, step_time in enumerate((0.05, 0.05, 0.3)):
            agents.append(
                AgentProcess(
                    tmp_path,
                    "train",
                    f"w{i}",
                    core.grpc_address,
                    job_token,
                    stage=0,
                    dp_rank=i,
                    step_time_s=step_time,
                )
            )
        wait_until(lambda: core.states("train").get("w2") == "SLOW", 30, "w2 flagged SLOW")
        slow = next(m for m in core.job("train")["members"] if m["worker_id"] == "w2")
        assert "peer median" in slow["state_reason"]
        assert core.states("train")["w0"] == "RUNNING" and core.states("train")["w1"] == "RUNNING"

        agents[0].signal(signal.SIGTERM)
        wait_until(lambda: core.states("train")["w0"] in ("PREEMPTING", "LOST", "LEFT"), 10, "w0 preempting")
        kinds = [
            (e["kind"], e["worker_id"]) for e in core.http.get("/api/v1/jobs/train/events").json()["events"]
        ]
        assert ("worker_preempting", "w0") in kinds
        preempting = next(
            e
            for e in core.http.get("/api/v1/jobs/train/events").json()["events"]
            if e["kind"] == "worker_preempting"
        )
        assert "sigterm" in preempting["detail"]
        # The agent forwards SIGTERM to its worker, which exits; the Core keeps the worker's fate.
        wait_until(lambda: core.states("train")["w0"] in ("LOST", "LEFT"), 40, "w0 gone after preemption")
    finally:
        for agent in agents:
            agent.stop()
        core.stop()
