"""A control plane on this machine for demos and tests: a Core with in-memory membership, a job
created through its REST API, and agents launching workers, all real processes on loopback ports
picked at random. `harness.demo` (the `elaswave demo` command) and the training harnesses build
on it; it imports nothing else of the harness.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

# How long one REST request to the Core may take. Every wait of a run is bounded by its own
# deadline; this only keeps a request from failing the run while the Core's event loop is slow:
# on 2 cores shared with a parallel test suite it once went 4.6 s without turning (a 5 s bound
# failed the warm-spare story in CI with httpx.ReadTimeout).
HTTP_TIMEOUT_S = 30.0


class Demo:
    def __init__(self, workdir: Path, workers: int, timeout_s: float) -> None:
        self.workdir = workdir
        self.workers = workers
        self.timeout_s = timeout_s
        self.deadline = time.monotonic() + timeout_s
        self.scheduler_token = secrets.token_urlsafe(24)
        self.procs: list[subprocess.Popen[bytes]] = []
        self.http: httpx.Client | None = None
        self.core_env: dict[str, str] = {}  # settings for the Core (ELASWAVE_* variables)
        self._diagnosing = False

    def start_core(self) -> dict[str, Any]:
        ready = self.workdir / "core.json"
        env = dict(os.environ, ELASWAVE_SCHEDULER_TOKEN=self.scheduler_token, **self.core_env)
        cmd = [
            sys.executable,
            "-m",
            "elaswave.cli",
            "core",
            "--grpc-port",
            "0",
            "--http-port",
            "0",
            "--ready-file",
            str(ready),
            "--log-level",
            "WARNING",
        ]
        core = subprocess.Popen(cmd, env=env)
        self.procs.append(core)
        while not ready.exists():
            if core.poll() is not None:
                raise RuntimeError(f"the Core exited with status {core.returncode} before it was ready")
            self._check_time("the Core to start")
            time.sleep(0.05)
        info = json.loads(ready.read_text())
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{info['http_port']}", timeout=HTTP_TIMEOUT_S)
        while self.http.get("/healthz").json()["role"] != "leader":
            self._check_time("the Core to lead")
            time.sleep(0.05)
        return info

    def create_job(self) -> str:
        assert self.http is not None
        response = self.http.post(
            "/api/v1/jobs",
            json={"name": "demo", "expected_workers": self.workers},
            headers={"Authorization": f"Bearer {self.scheduler_token}"},
        )
        response.raise_for_status()
        return response.json()["token"]

    def start_agents(self, grpc_port: int, job_token: str) -> None:
        env = dict(os.environ, ELASWAVE_JOB_TOKEN=job_token)
        for i in range(self.workers):
            cmd = [
                sys.executable,
                "-m",
                "elaswave.cli",
                "agent",
                "--job",
                "demo",
                "--worker-id",
                f"worker-{i}",
                "--stage",
                "0",
                "--dp-rank",
                str(i),
                "--core",
                f"127.0.0.1:{grpc_port}",
                "--metrics-socket",
                str(self.workdir / f"worker-{i}.sock"),
                "--log-level",
                "WARNING",
                "--",
                sys.executable,
                "-m",
                "harness.dummy_worker",
                "--stage",
                "0",
                "--dp-rank",
                str(i),
            ]
            self.procs.append(subprocess.Popen(cmd, env=env))

    def job(self) -> dict[str, Any]:
        assert self.http is not None
        return self.http.get("/api/v1/jobs/demo").json()

    def wait_for(self, what: str, predicate: Any) -> dict[str, Any]:
        while True:
            job = self.job()
            if predicate(job):
                return job
            self._check_time(what)
            time.sleep(0.02)

    def _check_time(self, what: str) -> None:
        if time.monotonic() > self.deadline:
            if self._diagnosing:  # a wait inside the diagnosis itself: say only what it waited on
                raise TimeoutError(f"demo timed out waiting for {what}")
            self._diagnosing = True
            raise TimeoutError(f"demo timed out waiting for {what}; {self.diagnosis()}")

    def diagnosis(self) -> str:
        """Where the job stood when a wait gave up: its phase, each member's state and last step,
        and the Core's last events, so that a timeout in CI says what it waited on."""
        if self.http is None:
            return "no Core yet"
        try:
            job = self.job()
            events = self.http.get("/api/v1/jobs/demo/events", params={"limit": 10_000}).json()["events"]
        except (httpx.HTTPError, ValueError, KeyError, TimeoutError) as exc:
            return f"the Core did not answer ({exc})"
        members = ", ".join(
            f"{m['worker_id']}={m['state']}@{(m.get('last_step') or {}).get('step', -1)}"
            for m in job.get("members", [])
        )
        tail = "; ".join(
            f"#{e['seq']} {e['kind']} {e['worker_id']} {e['detail'][:160]}" for e in events[-12:]
        )
        return f"job phase {job.get('phase')}, members {members}; last events: {tail}"

    def stop(self) -> None:
        # Agents first, the Core (started first) last: an agent stopping must still reach the
        # Core to say Leave, or its shutdown reads as a failure and it retries until it gives up.
        stop_processes(self.procs[1:])
        stop_processes(self.procs[:1])


def stop_processes(procs: list[subprocess.Popen[bytes]], grace_s: float = 10.0) -> None:
    """SIGINT every process at once, then SIGKILL whatever still runs after one shared grace:
    a hung job's teardown takes `grace_s`, not `grace_s` per process."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def states(job: dict[str, Any]) -> dict[str, str]:
    return {m["worker_id"]: m["state"] for m in job["members"]}
