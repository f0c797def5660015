"""docker/preemptible.py, the worker image's entrypoint: the first SIGTERM preempts the node's
agents (the launcher is left to end when they are gone), a SIGTERM before any agent runs or a
second one stops the launcher itself."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.core.procs import wait_until

pytestmark = pytest.mark.multiproc

ROOT = Path(__file__).resolve().parents[2]
FAKE = Path(__file__).with_name("fake_node.py")


def start(out: Path, agents: int = 2, delay_s: float = 0.0, linger_s: float = 0.0) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable,
        str(ROOT / "docker/preemptible.py"),
        sys.executable,
        str(FAKE),
        "launcher",
        str(agents),
        str(out),
        str(delay_s),
        str(linger_s),
    ]
    return subprocess.Popen(cmd)


def lines(out: Path) -> list[str]:
    return out.read_text().splitlines() if out.exists() else []


@pytest.mark.timeout(30)
def test_sigterm_preempts_every_agent_and_the_launcher_ends_on_its_own(tmp_path: Path) -> None:
    out = tmp_path / "log"
    node = start(out)
    try:
        wait_until(lambda: {"agent 0 ready", "agent 1 ready"} <= set(lines(out)), 10, "the agents")
        node.send_signal(signal.SIGTERM)
        assert node.wait(timeout=10) == 0
    finally:
        node.kill()
    seen = lines(out)
    assert sorted(s for s in seen if s.endswith("SIGTERM") and s.startswith("agent ")) == [
        "agent 0 SIGTERM",
        "agent 1 SIGTERM",
    ]
    assert seen[-1] == "launcher done" and not any(s.startswith("launcher SIG") for s in seen)


@pytest.mark.timeout(30)
def test_sigterm_while_joining_and_a_second_sigterm_stop_the_launcher(tmp_path: Path) -> None:
    out = tmp_path / "joining"
    node = start(out, delay_s=30.0)  # still "joining": no agent yet
    try:
        wait_until(lambda: "launcher ready" in lines(out), 10, "the launcher")
        node.send_signal(signal.SIGTERM)
        assert node.wait(timeout=10) == 3
    finally:
        node.kill()
    assert lines(out) == ["launcher ready", "launcher SIGTERM"]


@pytest.mark.timeout(30)
def test_a_second_sigterm_during_the_preemption_stops_the_launcher(tmp_path: Path) -> None:
    out = tmp_path / "twice"
    node = start(out, agents=1, linger_s=1.5)
    try:
        wait_until(lambda: "agent 0 ready" in lines(out), 10, "the agent")
        node.send_signal(signal.SIGTERM)
        wait_until(lambda: "agent 0 SIGTERM" in lines(out), 10, "the preemption")
        node.send_signal(signal.SIGTERM)
        wait_until(lambda: "launcher SIGTERM" in lines(out), 10, "the launcher's stop")
        node.wait(timeout=10)
    finally:
        node.kill()
    assert [s for s in lines(out) if "SIGTERM" in s] == ["agent 0 SIGTERM", "launcher SIGTERM"]


def worker_health(root: int) -> tuple[int, str]:
    env = {**os.environ, "ELASWAVE_HEALTH_ROOT_PID": str(root)}
    done = subprocess.run(
        [sys.executable, str(ROOT / "docker/healthcheck.py"), "worker"],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    return done.returncode, done.stderr.strip()


@pytest.mark.timeout(30)
def test_the_worker_healthcheck_wants_agents_under_the_entrypoint(tmp_path: Path) -> None:
    joining = start(tmp_path / "joining", delay_s=30.0)
    running = start(tmp_path / "running")
    try:
        wait_until(lambda: "launcher ready" in lines(tmp_path / "joining"), 10, "a joining launcher")
        wait_until(
            lambda: {"agent 0 ready", "agent 1 ready"} <= set(lines(tmp_path / "running")), 10, "agents"
        )
        assert worker_health(running.pid) == (0, "")
        assert worker_health(joining.pid) == (
            1,
            "unhealthy: the launcher runs no agent (still joining the job, or the job ended)",
        )
    finally:
        for node in (joining, running):
            node.send_signal(signal.SIGTERM)
            node.wait(timeout=10)
    assert worker_health(running.pid)[0] == 1  # gone
