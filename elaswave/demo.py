"""`elaswave demo`: the control plane end to end on one machine, on embedded defaults.

A Core with in-memory membership, a job created through the REST API, a few agents each
launching a (dummy) worker, then one worker is killed with SIGKILL and the Core is seen to
declare it lost. Every process is real; everything listens on loopback ports picked at random.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "demo", help="run the end-to-end demo on this machine",
        description="Start a Core (in-memory membership), create a job, start agents with dummy "
        "workers, kill one worker with SIGKILL and show the Core detecting it. Takes ~10 s.",
    )
    parser.add_argument("--workers", type=int, default=3, help="number of agents/workers (default 3)")
    parser.add_argument("--timeout", type=float, default=60.0, help="give up after this many seconds")
    parser.set_defaults(func=run)


class Demo:
    def __init__(self, workdir: Path, workers: int, timeout_s: float) -> None:
        self.workdir = workdir
        self.workers = workers
        self.deadline = time.monotonic() + timeout_s
        self.scheduler_token = secrets.token_urlsafe(24)
        self.procs: list[subprocess.Popen[bytes]] = []
        self.http: httpx.Client | None = None

    def start_core(self) -> dict[str, Any]:
        ready = self.workdir / "core.json"
        env = dict(os.environ, ELASWAVE_SCHEDULER_TOKEN=self.scheduler_token)
        cmd = [sys.executable, "-m", "elaswave.cli", "core", "--grpc-port", "0", "--http-port", "0",
               "--ready-file", str(ready), "--log-level", "WARNING"]
        self.procs.append(subprocess.Popen(cmd, env=env))
        while not ready.exists():
            self._check_time("the Core to start")
            time.sleep(0.05)
        info = json.loads(ready.read_text())
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{info['http_port']}", timeout=5.0)
        while self.http.get("/healthz").json()["role"] != "leader":
            self._check_time("the Core to lead")
            time.sleep(0.05)
        return info

    def create_job(self) -> str:
        assert self.http is not None
        response = self.http.post("/api/v1/jobs", json={"name": "demo", "expected_workers": self.workers},
                                  headers={"Authorization": f"Bearer {self.scheduler_token}"})
        response.raise_for_status()
        return response.json()["token"]

    def start_agents(self, grpc_port: int, job_token: str) -> None:
        env = dict(os.environ, ELASWAVE_JOB_TOKEN=job_token)
        for i in range(self.workers):
            cmd = [sys.executable, "-m", "elaswave.cli", "agent", "--job", "demo", "--worker-id", f"worker-{i}",
                   "--stage", "0", "--dp-rank", str(i), "--core", f"127.0.0.1:{grpc_port}",
                   "--metrics-socket", str(self.workdir / f"worker-{i}.sock"), "--log-level", "WARNING",
                   "--", sys.executable, "-m", "elaswave.dummy_worker", "--stage", "0", "--dp-rank", str(i)]
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
            raise TimeoutError(f"demo timed out waiting for {what}")

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()


def _states(job: dict[str, Any]) -> dict[str, str]:
    return {m["worker_id"]: m["state"] for m in job["members"]}


def run(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="elaswave-demo-") as tmp:
        demo = Demo(Path(tmp), args.workers, args.timeout)
        try:
            return _run(demo)
        finally:
            demo.stop()


def _run(demo: Demo) -> int:
    info = demo.start_core()
    print(f"[demo] Core up: gRPC 127.0.0.1:{info['grpc_port']}, REST http://127.0.0.1:{info['http_port']}/api/v1/jobs")
    token = demo.create_job()
    print("[demo] job 'demo' created through POST /api/v1/jobs")
    demo.start_agents(info["grpc_port"], token)
    job = demo.wait_for("every worker to run", lambda j: len(j["members"]) == demo.workers
                        and all(s == "RUNNING" for s in _states(j).values()))
    print(f"[demo] {demo.workers} agents registered, workers stepping: {_states(job)}")
    victim = job["members"][-1]
    print(f"[demo] kill -9 worker pid {victim['pid']} ({victim['worker_id']})")
    killed_at = time.monotonic()
    os.kill(victim["pid"], signal.SIGKILL)
    job = demo.wait_for("the Core to see the kill", lambda j: _states(j)[victim["worker_id"]] == "LOST")
    seen_after = time.monotonic() - killed_at
    lost = next(m for m in job["members"] if m["worker_id"] == victim["worker_id"])
    print(f"[demo] Core marked {victim['worker_id']} LOST after {seen_after * 1000:.0f} ms: {lost['lost_reason']}")
    print(f"[demo] members now: {_states(job)}")
    assert demo.http is not None
    events = demo.http.get("/api/v1/jobs/demo/events").json()["events"]
    print("[demo] events:")
    for event in events:
        print(f"    #{event['seq']:<3} {event['kind']:<18} {event['worker_id']:<10} {event['detail']}")
    return 0
