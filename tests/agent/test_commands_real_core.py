"""Core commands end to end: a real Core process, a real agent process launching the real dummy
worker, commands sent through the Core's REST API (POST /api/v1/jobs/{job}/workers/{w}/commands),
and the result read back from the Core (GET /api/v1/jobs/{job}) and the worker's control file."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from tests.agent.harness import AgentProcess
from tests.core.procs import CoreProcess, create_job, new_token, wait_until
from wire.local_protocol import ControlReader

pytestmark = pytest.mark.multiproc

NOMINAL_MHZ = 1400


@pytest.fixture(scope="module")
def real_core(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[CoreProcess, str]]:
    """One Core for the module. Heartbeat timeout and lease TTL are long so that the report_now
    test can run an agent with a 10 s heartbeat interval; the other agents beat every 0.25 s."""
    token = new_token()
    core = CoreProcess(
        tmp_path_factory.mktemp("core"),
        "cmd",
        "memory://",
        token,
        extra_args=["--heartbeat-timeout", "30", "--lease-ttl", "30"],
    )
    try:
        core.wait_leader()
        yield core, token
    finally:
        core.stop()


@pytest.fixture
def agents(tmp_path: Path) -> Iterator[list[AgentProcess]]:
    started: list[AgentProcess] = []
    yield started
    for agent in started:
        agent.stop()


def _start_agent(
    agents: list[AgentProcess],
    tmp_path: Path,
    core: CoreProcess,
    job: str,
    job_token: str,
    *extra: str,
    step_time_s: float = 0.05,
    heartbeat_s: float = 0.25,
) -> AgentProcess:
    args = [
        "--job",
        job,
        "--worker-id",
        "w0",
        "--core",
        core.grpc_address,
        "--metrics-socket",
        str(tmp_path / "w0.sock"),
        "--control-file",
        str(tmp_path / "w0.control.json"),
        "--heartbeat-interval",
        str(heartbeat_s),
        "--probe-interval",
        "60",
        *extra,
        "--",
        sys.executable,
        "-m",
        "harness.dummy_worker",
        "--step-time",
        str(step_time_s),
    ]
    agent = AgentProcess(args, tmp_path / "agent.log", {"ELASWAVE_JOB_TOKEN": job_token})
    agents.append(agent)
    return agent


def _member(core: CoreProcess, job: str) -> dict[str, Any]:
    members = core.job(job)["members"]
    return members[0] if members else {}


def _command(core: CoreProcess, token: str, job: str, body: dict[str, Any]) -> httpx.Response:
    response = core.http.post(
        f"/api/v1/jobs/{job}/workers/w0/commands", json=body, headers={"Authorization": f"Bearer {token}"}
    )
    assert response.status_code == 202, response.text
    return response


def _events(core: CoreProcess, job: str) -> list[dict[str, Any]]:
    return core.http.get(f"/api/v1/jobs/{job}/events").json()["events"]


@pytest.mark.timeout(60)
def test_drain_stops_worker_at_a_step_boundary_and_leaves_cleanly(real_core, agents, tmp_path: Path):
    core, token = real_core
    job_token = create_job(core, token, "drainjob")
    agent = _start_agent(
        agents, tmp_path, core, "drainjob", job_token, "--drain-grace", "20", step_time_s=0.3
    )
    wait_until(lambda: _member(core, "drainjob").get("state") == "RUNNING", 20, "w0 running")
    worker = psutil.Process(_member(core, "drainjob")["pid"])
    assert worker.ppid() == agent.proc.pid

    deadline = time.time() + 30
    _command(
        core, token, "drainjob", {"command": "drain", "reason": "maintenance", "deadline_unix": deadline}
    )
    _command(core, token, "drainjob", {"command": "drain", "reason": "again", "deadline_unix": deadline})

    wait_until(lambda: _member(core, "drainjob")["state"] == "LEFT", 20, "w0 LEFT after drain")
    assert agent.wait(10) == 0  # the worker exited 0 at its step boundary, the agent with it
    assert not psutil.pid_exists(worker.pid)
    log = agent.log
    assert "stopped by drain (maintenance)" in log  # the worker read the notice, no signal needed
    assert " agent drain_sigterm " not in log and log.count(" agent drain_repeated ") == 1
    member = _member(core, "drainjob")
    assert member["state_reason"].startswith("drained (maintenance): worker ")
    assert "exited with code 0" in member["state_reason"]
    assert "draining: maintenance" in member["probes"]["process"]["detail"]
    events = _events(core, "drainjob")
    kinds = [e["kind"] for e in events]
    assert "worker_left" in kinds and "worker_lost" not in kinds
    # Whatever the Core planned, no plan or decision counted the worker as a failure.
    for event in events:
        assert not any(str(c).startswith("worker_lost") for c in event["data"].get("changes", [])), event
    failures = [
        line
        for line in core.http.get("/metrics").text.splitlines()
        if line.startswith("elaswave_failures_detected_total{")
    ]
    assert all(line.endswith(" 0.0") for line in failures), failures


def _step_times_after(core: CoreProcess, job: str, first_step: int, count: int) -> list[float]:
    """Step times the Core saw for ``count`` distinct steps numbered >= ``first_step``."""
    seen: dict[int, float] = {}

    def collect() -> bool:
        last = _member(core, job).get("last_step")
        if last and last["step"] >= first_step:
            seen[last["step"]] = last["step_time_s"]
        return len(seen) >= count

    wait_until(collect, 20, f"{count} steps after step {first_step}", interval_s=0.02)
    return list(seen.values())


@pytest.mark.timeout(60)
def test_set_frequency_with_simulated_controller_reaches_worker_and_core(real_core, agents, tmp_path: Path):
    core, token = real_core
    job_token = create_job(core, token, "freqjob")
    agent = _start_agent(
        agents,
        tmp_path,
        core,
        "freqjob",
        job_token,
        "--frequency-controller",
        "simulated",
        "--clock-range",
        f"800:{NOMINAL_MHZ}:1650",
        step_time_s=0.1,
    )
    wait_until(lambda: _member(core, "freqjob").get("state") == "RUNNING", 20, "w0 running")
    assert "frequency_controller controller=simulated" in agent.log
    device = lambda: _member(core, "freqjob")["probes"].get("device", {}).get("detail", "")  # noqa: E731
    wait_until(lambda: "clock controller simulated at 1400 MHz" in device(), 10, "controller in device probe")
    reader = ControlReader(tmp_path / "w0.control.json")
    assert reader.factor == 1.0

    _command(core, token, "freqjob", {"command": "set_frequency", "frequency_mhz": 800})
    wait_until(
        lambda: "SetFrequency 800 MHz applied: simulated 800 MHz (factor 0.5714 of nominal 1400)" in device(),
        10,
        "applied frequency in the Core's view",
    )
    assert "clock controller simulated at 800 MHz" in device()
    assert reader.factor == pytest.approx(800 / NOMINAL_MHZ)
    # The worker read the factor: every step now sleeps 0.1 / (800/1400) = 0.175 s at least.
    first = _member(core, "freqjob")["last_step"]["step"] + 2
    assert min(_step_times_after(core, "freqjob", first, 3)) >= 0.1 * NOMINAL_MHZ / 800

    state = reader.poll()
    assert state is not None  # the worker has read the 800 MHz control file
    seq = state.seq
    _command(core, token, "freqjob", {"command": "set_frequency", "frequency_mhz": 2000})
    wait_until(lambda: "SetFrequency 2000 MHz refused" in device(), 10, "refusal in the Core's view")
    assert (
        "SetFrequency 2000 MHz refused: 2000 MHz is outside the simulated range 800..1650 MHz; "
        "clock unchanged"
    ) in device()
    assert "clock controller simulated at 800 MHz" in device()
    state = reader.poll()
    assert state is not None
    assert (state.seq, reader.factor) == (seq, pytest.approx(800 / NOMINAL_MHZ))  # nothing changed

    _command(core, token, "freqjob", {"command": "set_frequency", "frequency_mhz": 0})
    wait_until(lambda: "SetFrequency 0 MHz (restore default) applied" in device(), 10, "restored")
    assert reader.factor == 1.0
    assert _member(core, "freqjob")["state"] == "RUNNING"


@pytest.mark.timeout(60)
def test_report_now_advances_last_report_well_before_the_next_heartbeat(real_core, agents, tmp_path: Path):
    core, token = real_core
    job_token = create_job(core, token, "nowjob")
    _start_agent(agents, tmp_path, core, "nowjob", job_token, heartbeat_s=10.0)
    wait_until(lambda: _member(core, "nowjob").get("probes", {}).get("host"), 20, "first report")
    before = _member(core, "nowjob")
    time.sleep(0.5)  # the first heartbeat is out; the next one is due 10 s after it
    asked = time.time()
    _command(core, token, "nowjob", {"command": "report_now"})

    def reported() -> dict[str, Any] | None:
        m = _member(core, "nowjob")
        fresh = {name for name, probe in m["probes"].items() if probe["at"] >= asked}
        return m if m["last_heartbeat_unix"] >= asked and {"host", "process", "device"} <= fresh else None

    after = wait_until(reported, 5, "heartbeat and every probe after report_now")
    # Not the periodic heartbeat, which is due 10 s after the one before.
    assert (
        before["last_heartbeat_unix"]
        < asked
        <= after["last_heartbeat_unix"]
        < before["last_heartbeat_unix"] + 9.0
    )
    assert after["memory"]["host_total_bytes"] == psutil.virtual_memory().total
    assert after["state"] in ("JOINING", "RUNNING")
