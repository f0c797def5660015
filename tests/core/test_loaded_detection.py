"""No false losses on a loaded machine (issue 24, item 3): a real Core on etcd and real agents,
the CPUs held busy by 8 CPU-burning processes for a minute, with a heartbeat floor only ~3
heartbeat intervals long. Late heartbeats are noted (the stream and lease are alive), no worker is
LOST; then a real kill -9 of a worker is still detected in under a second.

ELASWAVE_LOAD_TEST_S sets how long the load is held (default 60 s; the issue's soak is 300)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.core.procs import AgentProcess, CoreProcess, create_job, new_token, wait_until

pytestmark = [pytest.mark.etcd, pytest.mark.multiproc, pytest.mark.serial]

LOAD_S = float(os.environ.get("ELASWAVE_LOAD_TEST_S", "60"))
BURNERS = 8
HEARTBEAT_FLOOR_S = 0.4  # the agents beat every 0.25 s; loaded, gaps reach 0.6 s (tests/core/recorded)


@contextlib.contextmanager
def burning(n: int) -> Iterator[list[subprocess.Popen]]:
    """`n` CPU-bound processes for the duration of the block, killed at its end."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield procs
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait(timeout=10)


def lost_event_time(core: CoreProcess, worker: str) -> float | None:
    events = core.http.get("/api/v1/jobs/train/events").json()["events"]
    return next(
        (e["time_unix"] for e in events if e["kind"] == "worker_lost" and e["worker_id"] == worker), None
    )


@pytest.mark.timeout(LOAD_S + 120)
def test_loaded_machine_has_no_false_losses_and_kill_9_is_still_found_within_1s(
    tmp_path: Path, etcd_registry_url: str
) -> None:
    token = new_token()
    core = CoreProcess(tmp_path, "core", etcd_registry_url, token, heartbeat_timeout_s=HEARTBEAT_FLOOR_S)
    agents: list[AgentProcess] = []
    try:
        core.wait_leader()
        job_token = create_job(core, token, "train", expected_workers=4)
        etcd = etcd_registry_url.removeprefix("etcd://")
        # Two agents hold their own etcd lease, two rely on the lease the Core holds for them.
        agents = [
            AgentProcess(
                tmp_path, "train", f"w{i}", core.grpc_address, job_token, etcd=etcd if i < 2 else None
            )
            for i in range(4)
        ]
        wait_until(
            lambda: set(core.states("train").values()) == {"RUNNING"} and len(core.states("train")) == 4,
            60,
            "four running workers",
        )
        with burning(BURNERS) as burners:
            held_until = time.monotonic() + LOAD_S
            load = 0.0
            while time.monotonic() < held_until:
                states = core.states("train")
                assert set(states.values()) == {"RUNNING"}, f"false loss under load: {states}\n{core.log()}"
                load = max(load, os.getloadavg()[0])
                time.sleep(1.0)
            late = core.metric("elaswave_heartbeats_late_total")
            for path in ("heartbeat", "lease_expired", "stream_closed", "process_exit"):
                assert core.metric("elaswave_failures_detected_total", path=path) == 0, path
            print(
                f"{LOAD_S:.0f} s with {len(burners)} burners: peak load average {load:.1f}, {late:.0f} late notes"
            )

            # Still loaded: a real kill -9 of a worker is found by its agent and reaches the Core fast.
            victim = next(m for m in core.job("train")["members"] if m["worker_id"] == "w3")
            killed = time.time()
            os.kill(victim["pid"], signal.SIGKILL)
            seen = wait_until(lambda: lost_event_time(core, "w3"), 10, "w3's loss recorded")
        detected_s = seen - killed
        print(f"kill -9 under load recorded by the Core after {detected_s * 1000:.0f} ms")
        assert detected_s < 1.0, detected_s
        member = next(m for m in core.job("train")["members"] if m["worker_id"] == "w3")
        assert member["lost_reason"] == "worker process killed by signal 9"
        assert {w: s for w, s in core.states("train").items() if w != "w3"} == {
            "w0": "RUNNING",
            "w1": "RUNNING",
            "w2": "RUNNING",
        }
    finally:
        for agent in agents:
            agent.stop()
        core.stop()
