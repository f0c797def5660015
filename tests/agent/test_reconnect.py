"""The agent's stream survives Core restarts and finds the leader among standbys (real gRPC)."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import pytest

from tests.agent.harness import RecordingCore, base_args, sleeper_command

pytestmark = pytest.mark.multiproc


@pytest.mark.timeout(40)
def test_reconnects_and_reregisters_after_core_restart_on_same_port(core, run_agent, tmp_path: Path):
    agent = run_agent(base_args(tmp_path, core.address) + sleeper_command(tmp_path))
    first = core.wait_kind("register")[0].request.register
    core.wait_kind("heartbeat", count=2)
    core.stop()
    time.sleep(1.5)  # several failed attempts: backoff grows towards its cap
    core.start()  # same port
    second = core.wait_kind("register", count=2, timeout=10)[1]
    assert second.stream == 2 and second.request.register == first
    received = core.wait_for(lambda rs: any(r.kind == "heartbeat" and r.stream == 2 for r in rs), timeout=5)
    first_seqs = [r.request.heartbeat.seq for r in received if r.kind == "heartbeat" and r.stream == 1]
    second_seq = next(r.request.heartbeat.seq for r in received if r.kind == "heartbeat" and r.stream == 2)
    # Heartbeats keep counting across sessions: the Core can tell a gap from a restart.
    assert second_seq > max(first_seqs)
    assert agent.proc.poll() is None

    core.stop()  # again: the backoff must start from 50 ms, not where it left off
    time.sleep(0.5)
    core.start()
    core.wait_for(lambda rs: any(r.kind == "heartbeat" and r.stream == 3 for r in rs), timeout=10)
    lines = agent.log.splitlines()
    assert sum("core_registered" in line for line in lines) == 3
    second_session = next(i for i, line in enumerate(lines) if "sessions=2" in line)
    delays = [float(line.split("delay_ms=")[1].split()[0]) for line in lines if "core_reconnect_wait" in line]
    after_reset = [
        float(line.split("delay_ms=")[1].split()[0])
        for line in lines[second_session:]
        if "core_reconnect_wait" in line
    ]
    print(f"\nreconnect delays (ms): {delays}")
    first_outage = delays[: len(delays) - len(after_reset)]
    assert len(first_outage) >= 3 and len(after_reset) >= 1
    for outage in (first_outage, after_reset):
        for attempt, delay in enumerate(outage):
            ceiling = min(2000.0, 50.0 * 2**attempt)  # doubles from 50 ms to the 2 s cap
            assert ceiling / 2 - 0.1 <= delay <= ceiling + 0.1, (attempt, delay)


@pytest.mark.timeout(40)
def test_critical_reports_replayed_to_the_next_core(run_agent, tmp_path: Path):
    """A PreemptionNotice written to a Core that then dies reaches the Core that takes over, first."""
    old = RecordingCore().start()
    new = RecordingCore().start()
    try:
        notice = tmp_path / "notice"
        agent = run_agent(
            base_args(tmp_path, f"{old.address},{new.address}", "w0", "--notice-file", str(notice))
            + sleeper_command(tmp_path)
        )
        old.wait_kind("heartbeat")
        notice.write_text("")
        old.wait_kind("preemption")
        old.stop()
        replay = new.wait_kind("preemption", timeout=10)[0]
        assert replay.request.preemption.source == "notice-file"
        assert [r.kind for r in new.received[:2]] == ["register", "preemption"]
        assert agent.proc.poll() is None
    finally:
        old.close()
        new.close()


@pytest.mark.timeout(40)
@pytest.mark.parametrize("code", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.FAILED_PRECONDITION])
def test_standby_refusal_moves_to_next_address(run_agent, tmp_path: Path, code):
    standby = RecordingCore(refuse_code=code, refuse_message="not leader").start()
    leader = RecordingCore().start()
    try:
        run_agent(base_args(tmp_path, f"{standby.address},{leader.address}") + sleeper_command(tmp_path))
        leader.wait_kind("heartbeat", timeout=10)
        assert standby.of_kind("register") and not standby.of_kind("heartbeat")
    finally:
        standby.close()
        leader.close()


@pytest.mark.timeout(40)
def test_standby_leader_hint_is_followed_even_outside_the_list(run_agent, tmp_path: Path):
    leader = RecordingCore().start()
    standby = RecordingCore(
        refuse_code=grpc.StatusCode.FAILED_PRECONDITION,
        refuse_message=f"not leader; leader is {leader.address}",
    ).start()
    try:
        agent = run_agent(base_args(tmp_path, standby.address) + sleeper_command(tmp_path))
        leader.wait_kind("heartbeat", timeout=10)
        assert len(standby.of_kind("register")) == 1
        assert f"leader_hint={leader.address}" in agent.log
    finally:
        standby.close()
        leader.close()
