"""A leading Core that stalls while it still leads loses nobody, though its agents know a standby.

An agent that knows another Core (a standby, for failover) used to drop a silent stream after its
silence bound (3 s) and move on; a leader whose process was only paused for longer than that, but
kept its lease, then read each dropped stream as its worker's failure when it ran again (the
window named in docs/architecture.md). Now the agent keeps the silent stream and asks the other
Cores first (make-before-break): it moves only once one of them accepts its registration (a
standby that took over); one that answers "not leader; leader is <this one>" means wait.

Real Cores on a real etcd, a long leader lease (20 s) so that the leader keeps leading through
its stall, and the stall injected for real: SIGSTOP on the leader, SIGCONT after."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from tests.core.procs import (
    AgentProcess,
    CoreProcess,
    CoreTimeouts,
    create_job,
    log_once_core_answers_again,
    new_token,
    wait_until,
)

pytestmark = [pytest.mark.multiproc, pytest.mark.etcd]

STALL_S = 8.0  # past the agents' 3 s silence bound, well inside the 20 s leader lease
AGENTS = 3


@pytest.mark.timeout(150)
def test_a_leader_stalled_past_the_silence_bound_keeps_its_agents_that_know_a_standby(
    tmp_path: Path, etcd_registry_url: str
) -> None:
    token = new_token()
    knobs: CoreTimeouts = {"heartbeat_timeout_s": 2.0, "leader_ttl_s": 20.0}
    leader = CoreProcess(tmp_path, "core-a", etcd_registry_url, token, **knobs)
    agents: list[AgentProcess] = []
    standby: CoreProcess | None = None
    try:
        leader.wait_leader()
        standby = CoreProcess(tmp_path, "core-b", etcd_registry_url, token, **knobs)
        wait_until(lambda: standby.role() == "standby", 30, "core-b to stand by")
        job_token = create_job(leader, token, "train", expected_workers=AGENTS)
        both = f"{leader.grpc_address},{standby.grpc_address}"
        agents = [AgentProcess(tmp_path, "train", f"w{i}", both, job_token) for i in range(AGENTS)]
        wanted = {f"w{i}": "RUNNING" for i in range(AGENTS)}
        wait_until(lambda: leader.states("train") == wanted, 60, "the workers running")

        leader.proc.send_signal(signal.SIGSTOP)
        try:
            time.sleep(STALL_S)
        finally:
            leader.proc.send_signal(signal.SIGCONT)

        # Each agent asked the standby, was told the stalled Core still leads, kept its stream...
        for agent in agents:
            log = log_once_core_answers_again(agent)
            assert "core_silent_still_leading" in log and "sessions=2" not in log, log
            assert f"leader_hint={leader.grpc_address}" in log, log  # the standby named the stalled leader
        # ...and the leader, running again, judged nobody for its own pause.
        time.sleep(1.0)
        assert leader.role() == "leader" and leader.states("train") == wanted, leader.log()
        events = leader.http.get("/api/v1/jobs/train/events").json()["events"]
        assert [e for e in events if e["kind"] == "worker_lost"] == [], events
        assert leader.metric("elaswave_failures_detected_total", path="stream_closed") == 0, leader.log()
    finally:
        for agent in agents:
            agent.stop()
        if standby is not None:
            standby.stop()
        leader.stop()
