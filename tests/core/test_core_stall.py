"""A Core whose whole process stalls past the agents' silence bound loses nobody.

A loaded machine or a long pause can stop the Core's process for longer than an agent waits
for an answer (`AgentConfig.silence_bound_s`, 3 s). An agent that knows no other Core must not
drop its stream then: the Core, once it runs again, reads a stream that closed without a Leave
as a fail-stop signal, so every worker of the job was marked LOST for the Core's own pause (seen
in CI: one 3.1 s stall, nine workers lost, the job restarted twice). Nor may the liveness leases
the Core holds for its agents, which lapse during its own stall, count against the workers. A
worker that really dies during the stall is still found: its stream closed for real.

The stall is injected for real: SIGSTOP on the Core's process, SIGCONT after. One agent reaches
the Core through a node multiplexer (its only "Core"), whose channel closing reads the same."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.core.procs import (
    AgentProcess,
    CoreProcess,
    create_job,
    log_once_core_answers_again,
    new_token,
    wait_until,
)

pytestmark = [pytest.mark.multiproc]

STALL_S = 4.5  # past the agents' 3 s silence bound, with room for a loaded machine
AGENTS = 4  # w3's agent is killed during the stall


def _start_mux(tmp_path: Path, core: CoreProcess) -> tuple[subprocess.Popen, str]:
    """`python -m agent.node_mux` in front of `core`; returns it and the address it listens on."""
    with socket.socket() as probe:  # a free port (the multiplexer has no port-0 report)
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    log_path = tmp_path / "mux.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "agent.node_mux",
                "--core",
                core.grpc_address,
                "--listen",
                f"127.0.0.1:{port}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    wait_until(lambda: "node multiplexer on" in log_path.read_text(), 30, "the mux to listen")
    return proc, f"127.0.0.1:{port}"


@pytest.mark.timeout(120)
def test_a_core_stalled_past_the_silence_bound_loses_no_worker(tmp_path: Path) -> None:
    token = new_token()
    core = CoreProcess(tmp_path, "core", "memory://", token, heartbeat_timeout_s=2.0)
    agents: list[AgentProcess] = []
    mux: subprocess.Popen | None = None
    try:
        core.wait_leader()
        job_token = create_job(core, token, "train", expected_workers=AGENTS)
        mux, mux_address = _start_mux(tmp_path, core)
        agents = [
            AgentProcess(tmp_path, "train", f"w{i}", mux_address if i == 0 else core.grpc_address, job_token)
            for i in range(AGENTS)
        ]
        wanted = {f"w{i}": "RUNNING" for i in range(AGENTS)}
        wait_until(lambda: core.states("train") == wanted, 60, "the workers running")

        core.proc.send_signal(signal.SIGSTOP)
        try:
            time.sleep(1.0)
            agents[3].signal(signal.SIGKILL)  # its stream closes while the Core is stopped
            agents[3].proc.wait(timeout=10)
            time.sleep(STALL_S - 1.0)
        finally:
            core.proc.send_signal(signal.SIGCONT)

        # Every surviving agent noticed the silence, kept its stream and heard the Core again...
        for agent in agents[:3]:
            log = log_once_core_answers_again(agent)
            assert "core_silent_waiting" in log and "sessions=2" not in log, log
        # ...the dead one is LOST: its stream closed when its process died...
        wanted["w3"] = "LOST"
        wait_until(lambda: core.states("train") == wanted, 10, f"w3 LOST, the others {wanted}")
        # ...and nobody else was judged for the pause, neither then nor after.
        time.sleep(1.0)
        assert core.states("train") == wanted, core.log()
        assert core.metric("elaswave_failures_detected_total", path="stream_closed") == 1, core.log()
        for path in ("heartbeat", "lease_expired", "process_exit"):
            assert core.metric("elaswave_failures_detected_total", path=path) == 0, (path, core.log())
        events = core.http.get("/api/v1/jobs/train/events").json()["events"]
        assert [e["worker_id"] for e in events if e["kind"] == "worker_lost"] == ["w3"]
        assert [e for e in events if e["kind"] in ("worker_reconnected", "worker_rejoined")] == []
        # (The leases the Core held for the survivors lapsed in its stall; whichever came first,
        # the lapse's event or a heartbeat's refresh, granted them again: lease_expired is 0.)
    finally:
        for agent in agents:
            agent.stop()
        if mux is not None:
            mux.terminate()
            mux.wait(timeout=10)
        core.stop()


@pytest.mark.timeout(120)
def test_an_agent_registering_while_the_core_is_stalled_waits_for_its_ack(tmp_path: Path) -> None:
    """An agent whose Register reaches a lone Core that is stopped for longer than the register
    timeout (5 s) keeps the stream until the Core answers: dropping it made the Core, once it ran
    again, register the worker and then read the dropped stream as its failure (a spare marked
    LOST while it joined, in a test run on a loaded machine)."""
    token = new_token()
    core = CoreProcess(tmp_path, "core", "memory://", token, heartbeat_timeout_s=2.0)
    agents: list[AgentProcess] = []
    try:
        core.wait_leader()
        job_token = create_job(core, token, "train", expected_workers=2)
        agents.append(AgentProcess(tmp_path, "train", "w0", core.grpc_address, job_token))
        wait_until(lambda: core.states("train") == {"w0": "RUNNING"}, 60, "w0 running")

        core.proc.send_signal(signal.SIGSTOP)
        try:
            late = AgentProcess(tmp_path, "train", "w1", core.grpc_address, job_token)
            agents.append(late)
            wait_until(lambda: "agent_started" in late.log_path.read_text(), 30, "w1's agent to start")
            time.sleep(6.5)  # its Register unanswered past the 5 s register timeout
        finally:
            core.proc.send_signal(signal.SIGCONT)

        wanted = {"w0": "RUNNING", "w1": "RUNNING"}
        wait_until(lambda: core.states("train") == wanted, 30, f"both running: {wanted}")
        time.sleep(1.0)
        assert core.states("train") == wanted, core.log()
        log = late.log_path.read_text()
        assert "core_registered" in log and "core_stream_failed" not in log and "sessions=2" not in log, log
        events = core.http.get("/api/v1/jobs/train/events").json()["events"]
        assert [e for e in events if e["kind"] == "worker_lost"] == [], events
        assert core.metric("elaswave_failures_detected_total", path="stream_closed") == 0, core.log()
    finally:
        for agent in agents:
            agent.stop()
        core.stop()
