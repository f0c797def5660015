"""The agent as a real process against a real gRPC AgentService: registration, worker exit,
step metrics, preemption, shutdown and Core commands."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from agent.devices import DeviceSet
from tests.agent.harness import RecordingCore, base_args, sleeper_command, wait_worker_ready
from wire.local_protocol import EXIT_CODE_UNKNOWN, StepMetricsClient
from wire.v1 import agent_pb2

pytestmark = pytest.mark.multiproc


def _kinds(core: RecordingCore) -> list[str]:
    return [r.kind for r in core.received]


@pytest.mark.timeout(30)
def test_register_carries_identity_token_and_heartbeats_then_sigint_leaves(core, run_agent, tmp_path: Path):
    token_file = tmp_path / "token"
    token_file.write_text("tok-123\n")
    agent = run_agent(
        base_args(
            tmp_path,
            core.address,
            "w0",
            "--stage",
            "1",
            "--dp-rank",
            "2",
            "--rank",
            "5",
            "--job-token-file",
            str(token_file),
        )
        + sleeper_command(tmp_path)
    )
    register = core.wait_kind("register")[0].request.register
    worker = psutil.Process(register.pid)
    assert worker.ppid() == agent.proc.pid and worker.cmdline()[-1].endswith("worker.py")
    assert (register.job, register.worker_id, register.host) == ("testjob", "w0", socket.gethostname())
    assert (register.stage, register.dp_rank, register.rank, register.heartbeat_interval_ms) == (1, 2, 5, 100)
    assert not register.holds_own_lease
    assert list(register.devices) == DeviceSet.discover().devices  # on CPU: one "cpu" device, host memory
    assert core.streams[0].metadata["authorization"] == "Bearer tok-123"
    beats = core.wait_kind("heartbeat", count=3)
    assert [b.request.heartbeat.seq for b in beats[:3]] == [1, 2, 3]
    assert "tok-123" not in " ".join(psutil.Process(agent.proc.pid).cmdline())

    wait_worker_ready(tmp_path)
    agent.signal(signal.SIGINT)
    assert agent.wait() == 0  # the worker ended by our SIGTERM after it handled it with exit 0
    assert (tmp_path / "term.txt").read_text() == "SIGTERM"
    # The agent stopped its own worker, which exited 0: a clean departure, never a failure report.
    assert "worker_exit" not in _kinds(core)
    assert _kinds(core)[-1] == "leave"
    assert core.of_kind("leave")[0].request.leave.reason == "SIGINT"
    assert (
        not psutil.pid_exists(register.pid) or psutil.Process(register.pid).status() == psutil.STATUS_ZOMBIE
    )


@pytest.mark.timeout(30)
def test_token_from_environment(core, run_agent, tmp_path: Path):
    run_agent(
        base_args(tmp_path, core.address) + sleeper_command(tmp_path), env={"ELASWAVE_JOB_TOKEN": "envtok"}
    )
    core.wait_kind("register")
    assert core.streams[0].metadata["authorization"] == "Bearer envtok"


@pytest.mark.timeout(30)
def test_worker_kill9_is_reported_as_signal_exit(core, run_agent, tmp_path: Path):
    agent = run_agent(base_args(tmp_path, core.address) + sleeper_command(tmp_path))
    pid = core.wait_kind("register")[0].request.register.pid
    core.wait_kind("heartbeat")
    killed_at = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    exit_report = core.wait_kind("worker_exit")[0]
    print(f"\nworker kill -9 -> WorkerExit at the Core: {(exit_report.at - killed_at) * 1000:.1f} ms")
    assert exit_report.request.worker_exit.exit_code == -9
    assert "SIGKILL" in exit_report.request.worker_exit.detail
    assert agent.wait() == 128 + 9
    assert _kinds(core)[-1] == "leave"


@pytest.mark.timeout(30)
@pytest.mark.parametrize("how", ["finished", "left", "failed"])
def test_worker_that_finishes_or_leaves_departs_and_one_that_fails_reports_its_exit(
    core, run_agent, tmp_path: Path, how: str
):
    ready = tmp_path / "go"
    # "finished": the worker says its work is complete (wire.local_protocol.mark_finished), then exits 0.
    say_done = (
        "from wire.local_protocol import mark_finished; assert mark_finished()\n" if how == "finished" else ""
    )
    code = 3 if how == "failed" else 0
    worker = [
        sys.executable,
        "-c",
        f"import pathlib, sys, time\nwhile not pathlib.Path({str(ready)!r}).exists(): time.sleep(0.02)\n"
        f"{say_done}sys.exit({code})",
    ]
    agent = run_agent(base_args(tmp_path, core.address, "w0") + ["--", *worker])
    pid = core.wait_kind("register")[0].request.register.pid
    core.wait_kind("heartbeat")
    ready.write_text("go")
    assert agent.wait() == code  # the agent exits with its worker's status
    assert _kinds(core)[-1] == "leave"
    leave = core.of_kind("leave")[0].request.leave
    if how == "failed":
        assert [r.request.worker_exit.exit_code for r in core.of_kind("worker_exit")] == [3]
        assert (leave.reason, leave.finished) == (f"worker {pid} exited with code 3", False)
        return
    # Exit 0 is a departure (the Core records LEFT), not a fail-stop (LOST); only a worker that
    # said so finished its work (nothing for the Core to re-plan).
    assert not core.of_kind("worker_exit")
    if how == "finished":
        assert (leave.reason, leave.finished) == (
            f"worker {pid} finished its work (exited with code 0)",
            True,
        )
    else:
        assert (leave.reason, leave.finished) == (f"worker {pid} left (exited with code 0)", False)


@pytest.mark.timeout(30)
def test_launched_worker_dies_with_a_killed_agent(core, run_agent, tmp_path: Path):
    agent = run_agent(base_args(tmp_path, core.address) + sleeper_command(tmp_path))
    worker = psutil.Process(core.wait_kind("register")[0].request.register.pid)
    agent.signal(signal.SIGKILL)
    agent.wait()
    # The Core sees the stream close without Leave and treats the worker as lost: it must be.
    gone, _ = psutil.wait_procs([worker], timeout=10)
    assert gone == [worker] and worker.returncode in (None, -9)  # reaped by init, or by us


@pytest.mark.timeout(30)
def test_foreign_pid_kill9_reports_exit_code_from_zombie(core, run_agent, tmp_path: Path):
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        agent = run_agent(base_args(tmp_path, core.address, "w0", "--pid", str(worker.pid)))
        assert core.wait_kind("register")[0].request.register.pid == worker.pid
        worker.send_signal(signal.SIGKILL)
        report = core.wait_kind("worker_exit")[0].request.worker_exit
        # We (the parent) have not reaped it yet, so the agent reads the status of the zombie.
        assert (report.exit_code, report.exit_code != EXIT_CODE_UNKNOWN) == (-9, True)
        assert agent.wait() == 137
    finally:
        worker.kill()
        worker.wait()


@pytest.mark.timeout(30)
def test_step_metrics_forwarded_and_malformed_lines_rejected(core, run_agent, tmp_path: Path):
    agent = run_agent(base_args(tmp_path, core.address) + sleeper_command(tmp_path))
    core.wait_kind("register")
    sock_path = tmp_path / "w0.sock"
    raw = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    bad = [
        b"not json\n",
        b'{"step": 1}\n',
        b"[1, 2]\n",
        b'{"step": -1, "step_time_s": 1, "compute_time_s": 1, '
        b'"loss": 1, "samples": 1, "stage": 0, "dp_rank": 0}\n',
        b"\xff\xfe\n",
    ]
    sent: list[dict[str, Any]] = [
        dict(
            step=s,
            step_time_s=0.5 + s,
            compute_time_s=0.25,
            loss=2.0 / (s + 1),
            samples=8,
            stage=0,
            dp_rank=1,
        )
        for s in range(3)
    ]
    with StepMetricsClient(sock_path) as client:
        assert client.send(**sent[0])
        for line in bad:
            raw.sendto(line, str(sock_path))
        # Two records in one datagram, one of them with an unknown loss.
        raw.sendto(
            (json.dumps(sent[1]) + "\n" + json.dumps({**sent[2], "loss": None}) + "\n").encode(),
            str(sock_path),
        )
    steps = [r.request.step for r in core.wait_kind("step", count=3)]
    assert [(m.step, m.step_time_s, m.compute_time_s, m.samples, m.stage, m.dp_rank) for m in steps] == [
        (d["step"], d["step_time_s"], d["compute_time_s"], d["samples"], d["stage"], d["dp_rank"])
        for d in sent
    ]
    assert [m.loss for m in steps[:2]] == [sent[0]["loss"], sent[1]["loss"]] and math.isnan(steps[2].loss)
    assert agent.proc.poll() is None
    log = agent.log
    assert log.count("step_metrics_rejected") == len(bad)
    for reason in ("not JSON", "missing field(s)", "expected a JSON object", "step must be >= 0"):
        assert reason in log


@pytest.mark.timeout(30)
def test_sigterm_reports_preemption_forwards_sigterm_and_leaves(core, run_agent, tmp_path: Path):
    agent = run_agent(base_args(tmp_path, core.address, "w0", "--grace", "5") + sleeper_command(tmp_path))
    core.wait_kind("heartbeat")
    wait_worker_ready(tmp_path)
    sent_at = time.time()
    agent.signal(signal.SIGTERM)
    assert agent.wait() == 0
    assert (tmp_path / "term.txt").read_text() == "SIGTERM"
    # A worker that stops cleanly (exit 0) after the notice is a planned departure: no WorkerExit,
    # which the Core would record as a failure (LOST) rather than LEFT.
    critical = [r for r in core.received if r.kind in ("preemption", "worker_exit", "leave")]
    assert [r.kind for r in critical] == ["preemption", "leave"]
    preemption = critical[0].request.preemption
    assert preemption.source == "sigterm"
    assert sent_at + 5 - 1 <= preemption.deadline_unix <= time.time() + 5
    assert (
        "preempted" in critical[1].request.leave.reason
        and "exited with code 0" in critical[1].request.leave.reason
    )
    # The worker saw the reported preemption in its control file when SIGTERM reached it.
    drain = json.loads((tmp_path / "control_at_term.json").read_text())["drain"]
    assert (drain["reason"], drain["deadline_unix"]) == ("preempted (SIGTERM)", preemption.deadline_unix)


@pytest.mark.timeout(30)
def test_sigterm_kills_worker_that_ignores_it_after_grace(core, run_agent, tmp_path: Path):
    agent = run_agent(
        base_args(tmp_path, core.address, "w0", "--grace", "1")
        + sleeper_command(tmp_path, ignore_sigterm=True)
    )
    core.wait_kind("heartbeat")
    wait_worker_ready(tmp_path)
    agent.signal(signal.SIGTERM)
    assert agent.wait() == 137
    assert core.of_kind("worker_exit")[0].request.worker_exit.exit_code == -9
    assert _kinds(core)[-1] == "leave"


@pytest.mark.timeout(30)
def test_notice_file_reports_deadline_from_file(core, run_agent, tmp_path: Path):
    notice = tmp_path / "notice"
    agent = run_agent(
        base_args(tmp_path, core.address, "w0", "--notice-file", str(notice)) + sleeper_command(tmp_path)
    )
    core.wait_kind("heartbeat")
    assert not core.of_kind("preemption")
    notice.write_text("1900000000.5\n")
    report = core.wait_kind("preemption")[0].request.preemption
    assert (report.source, report.deadline_unix) == ("notice-file", 1900000000.5)
    assert agent.proc.poll() is None  # a notice is a warning, the worker keeps running


@pytest.mark.timeout(30)
def test_report_now_sends_memory_and_probes_at_once(core, run_agent, tmp_path: Path):
    listener = socket.create_server(("127.0.0.1", 0))
    peer = f"127.0.0.1:{listener.getsockname()[1]}"
    try:
        run_agent(base_args(tmp_path, core.address, "w0", "--peer", peer) + sleeper_command(tmp_path))
        register = core.wait_kind("register")[0].request.register
        core.wait_kind("memory")  # the startup report; the next periodic one is 60 s away
        core.wait_kind("heartbeat", count=2)
        before = len(core.received)
        core.send_command(agent_pb2.ConnectResponse(report_now=agent_pb2.ReportNow()))
        core.wait_for(lambda rs: any(r.kind == "memory" for r in rs[before:]), timeout=5)
        after = core.wait_for(lambda rs: sum(r.kind == "probe" for r in rs[before:]) >= 4, timeout=5)[before:]
    finally:
        listener.close()
    memory = next(r.request.memory for r in after if r.kind == "memory")
    assert memory.host_total_bytes == psutil.virtual_memory().total
    assert 0 < memory.host_used_bytes < memory.host_total_bytes
    assert 0 < memory.worker_rss_bytes < 2**32
    assert list(memory.device_total_bytes) == [d.memory_bytes for d in register.devices]
    assert len(memory.device_used_bytes) == len(register.devices)
    probes = {p.kind: p for p in (r.request.probe for r in after if r.kind == "probe")}
    assert (
        probes[agent_pb2.PROBE_KIND_PROCESS].healthy
        and f"pid {register.pid} alive" in probes[agent_pb2.PROBE_KIND_PROCESS].detail
    )
    assert (
        probes[agent_pb2.PROBE_KIND_INTERCONNECT].healthy
        and peer in probes[agent_pb2.PROBE_KIND_INTERCONNECT].detail
    )
    assert agent_pb2.PROBE_KIND_HOST in probes and agent_pb2.PROBE_KIND_DEVICE in probes


def _probe_details(core: RecordingCore, since: int = 0) -> list[str]:
    return [r.request.probe.detail for r in core.received[since:] if r.kind == "probe"]


@pytest.mark.timeout(30)
def test_set_frequency_without_controller_is_reported_not_applied(core, run_agent, tmp_path: Path):
    agent = run_agent(
        base_args(tmp_path, core.address, "w0", "--frequency-controller", "none") + sleeper_command(tmp_path)
    )
    core.wait_kind("heartbeat")
    log = agent.wait_log("frequency_controller")
    assert "controller=none" in log and "disabled by --frequency-controller none" in log
    before = len(core.received)
    core.send_command(agent_pb2.ConnectResponse(set_frequency=agent_pb2.SetFrequency(mhz=1200)))
    core.wait_for(lambda rs: any("SetFrequency" in d for d in _probe_details(core, before)), timeout=5)
    assert (
        "SetFrequency 1200 MHz not applied: no clock controller (disabled by --frequency-controller none)"
        in " ".join(_probe_details(core, before))
    )
    control = json.loads((tmp_path / "w0.control.json").read_text())
    assert (control["frequency"], control["drain"]) == (None, None)
    assert agent.proc.poll() is None


@pytest.mark.timeout(30)
def test_drain_sigterms_a_worker_that_ignores_the_notice_once_and_leaves_cleanly(
    core, run_agent, tmp_path: Path
):
    # The sleeper does not read the control file: after --drain-grace it gets SIGTERM and exits 0.
    agent = run_agent(
        base_args(tmp_path, core.address, "w0", "--drain-grace", "1", "--grace", "5")
        + sleeper_command(tmp_path)
    )
    core.wait_kind("heartbeat")
    wait_worker_ready(tmp_path)
    pid = core.of_kind("register")[0].request.register.pid
    drain = agent_pb2.Drain(reason="maintenance", deadline_unix=time.time() + 30)
    core.send_command(agent_pb2.ConnectResponse(drain=drain))
    core.send_command(agent_pb2.ConnectResponse(drain=drain))  # idempotent
    core.wait_for(lambda rs: any("draining: maintenance" in d for d in _probe_details(core)), timeout=5)
    notice = json.loads((tmp_path / "w0.control.json").read_text())
    assert notice["drain"]["reason"] == "maintenance"
    assert notice["drain"]["deadline_unix"] == drain.deadline_unix
    assert agent.wait() == 0
    assert (tmp_path / "term.txt").read_text() == "SIGTERM"
    log = agent.log
    assert log.count(" agent drain_sigterm ") == 1 and log.count(" agent drain_repeated ") == 1
    assert not core.of_kind("worker_exit")  # a drained worker leaving is not a failure report
    leave = core.of_kind("leave")[0].request.leave
    assert leave.reason == f"drained (maintenance): worker {pid} exited with code 0"
    assert _kinds(core)[-1] == "leave"


@pytest.mark.timeout(30)
def test_drain_kills_a_worker_that_ignores_sigterm_after_grace(core, run_agent, tmp_path: Path):
    agent = run_agent(
        base_args(tmp_path, core.address, "w0", "--drain-grace", "0.2", "--grace", "1")
        + sleeper_command(tmp_path, ignore_sigterm=True)
    )
    core.wait_kind("heartbeat")
    wait_worker_ready(tmp_path)
    core.send_command(agent_pb2.ConnectResponse(drain=agent_pb2.Drain(reason="reclaim", deadline_unix=0)))
    assert agent.wait() == 137  # the agent exits with its worker's status
    assert "worker_kill_after_grace" in agent.log
    assert not core.of_kind("worker_exit")
    assert "killed by signal 9 (SIGKILL)" in core.of_kind("leave")[0].request.leave.reason


@pytest.mark.timeout(30)
def test_report_now_sends_a_heartbeat_at_once_and_the_last_step_again(core, run_agent, tmp_path: Path):
    run_agent(
        base_args(tmp_path, core.address, "w0") + ["--heartbeat-interval", "30"] + sleeper_command(tmp_path)
    )
    core.wait_kind("heartbeat")
    core.wait_kind("memory")
    with StepMetricsClient(tmp_path / "w0.sock") as client:
        assert client.send(
            step=7, step_time_s=0.5, compute_time_s=0.25, loss=1.0, samples=8, stage=0, dp_rank=0
        )
    core.wait_kind("step")
    before = len(core.received)
    core.send_command(agent_pb2.ConnectResponse(report_now=agent_pb2.ReportNow()))
    after = core.wait_for(lambda rs: any(r.kind == "step" for r in rs[before:]), timeout=5)[before:]
    kinds = [r.kind for r in after]
    assert kinds[0] == "heartbeat" and after[0].request.heartbeat.seq == 2  # ahead of the 30 s interval
    assert {"memory", "probe"} <= set(kinds)
    resent = next(r.request.step for r in after if r.kind == "step")
    assert (resent.step, resent.step_time_s, resent.loss) == (7, 0.5, 1.0)


@pytest.mark.timeout(20)
def test_explicit_frequency_controller_that_cannot_run_is_a_start_error(run_agent, tmp_path: Path):
    if importlib.util.find_spec("pynvml") is not None and shutil.which("npu-smi") is not None:
        pytest.skip("both NVML and npu-smi are usable on this host")
    if importlib.util.find_spec("pynvml") is None:
        agent = run_agent(
            base_args(tmp_path, "127.0.0.1:1", "w0", "--frequency-controller", "nvml")
            + sleeper_command(tmp_path)
        )
        assert agent.wait() == 2
        assert "--frequency-controller nvml: pynvml is not installed" in agent.log
    if shutil.which("npu-smi") is None:
        agent = run_agent(
            base_args(tmp_path, "127.0.0.1:1", "w1", "--frequency-controller", "npu-smi")
            + sleeper_command(tmp_path)
        )
        assert agent.wait() == 2
        assert "--frequency-controller npu-smi: npu-smi is not on PATH" in agent.log
    assert not (tmp_path / "ready.txt").exists()  # no worker was launched


@pytest.mark.timeout(20)
def test_bad_flags_exit_2_with_a_clear_message(run_agent, tmp_path: Path):
    agent = run_agent(["--job", "j", "--worker-id", "w", "--core", "nohostport"])
    assert agent.wait() == 2
    assert "--core: expected host:port, got 'nohostport'" in agent.log
    missing = run_agent(["--job", "j", "--worker-id", "w", "--core", "127.0.0.1:1", "--pid", "999999999"])
    assert missing.wait() == 2
    assert "no running process with pid 999999999" in missing.log
