"""Real Core and agent processes for the control-plane tests."""

from __future__ import annotations

import json
import os
import secrets
import signal
import ssl
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypedDict

import httpx

DEFAULT_WAIT_S = 20.0


def wait_until(predicate: Callable[[], Any], timeout_s: float, what: str, interval_s: float = 0.01) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(interval_s)


def log_once_core_answers_again(agent: AgentProcess, timeout_s: float = 30.0) -> str:
    """`agent`'s log once it has heard its Core again after a silence (`core_answers_again`)."""
    wait_until(
        lambda: "core_answers_again" in agent.log_path.read_text(),
        timeout_s,
        f"{agent.worker_id} to hear the Core again",
    )
    return agent.log_path.read_text()


class CoreTimeouts(TypedDict, total=False):
    """The timeout keywords of `CoreProcess` (seconds)."""

    heartbeat_timeout_s: float
    lease_ttl_s: float
    leader_ttl_s: float


class CoreProcess:
    """`elaswave core` in its own process, on free loopback ports."""

    def __init__(
        self,
        tmp: Path,
        name: str,
        registry_url: str,
        scheduler_token: str,
        extra_env: dict[str, str] | None = None,
        extra_args: list[str] | None = None,
        *,
        heartbeat_timeout_s: float = 2.0,
        lease_ttl_s: float = 2.0,
        leader_ttl_s: float = 2.0,
        https_ca: Path | None = None,
    ) -> None:
        """`https_ca`: the Core serves REST over HTTPS (its `http_tls_*` in `extra_env`) with a
        certificate this CA signed; the test's REST client verifies it."""
        self.ready_file = tmp / f"{name}.ready.json"
        self.log_path = tmp / f"{name}.log"
        env = dict(os.environ, ELASWAVE_SCHEDULER_TOKEN=scheduler_token, **(extra_env or {}))
        cmd = [
            sys.executable,
            "-m",
            "elaswave.cli",
            "core",
            "--grpc-port",
            "0",
            "--http-port",
            "0",
            "--registry",
            registry_url,
            "--core-id",
            name,
            "--ready-file",
            str(self.ready_file),
            "--heartbeat-timeout",
            str(heartbeat_timeout_s),
            "--lease-ttl",
            str(lease_ttl_s),
            "--leader-ttl",
            str(leader_ttl_s),
            *(extra_args or []),
        ]
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        info = wait_until(self._ready, DEFAULT_WAIT_S, f"core {name} to bind its ports")
        self.grpc_port: int = info["grpc_port"]
        self.http_port: int = info["http_port"]
        self.grpc_address = f"127.0.0.1:{self.grpc_port}"
        verify: ssl.SSLContext | bool = True
        scheme = "http"
        if https_ca is not None:
            scheme, verify = "https", ssl.create_default_context(cafile=str(https_ca))
        self.http = httpx.Client(
            base_url=f"{scheme}://127.0.0.1:{self.http_port}", timeout=5.0, verify=verify
        )
        wait_until(self.role, DEFAULT_WAIT_S, f"core {name} to answer /healthz")

    def _ready(self) -> dict[str, Any] | None:
        if self.proc.poll() is not None:
            raise AssertionError(f"core exited with {self.proc.returncode}:\n{self.log()}")
        return json.loads(self.ready_file.read_text()) if self.ready_file.exists() else None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def metrics(self) -> str:
        """The Core's Prometheus exposition, as scraped from /metrics."""
        response = self.http.get("/metrics")
        response.raise_for_status()
        return response.text

    def metric(self, name: str, **labels: str) -> float:
        """One sample of /metrics whose labels include `labels`; 0 when not created yet."""
        from prometheus_client.parser import text_string_to_metric_families

        for family in text_string_to_metric_families(self.metrics()):
            for s in family.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                    return s.value
        return 0.0

    def role(self) -> str | None:
        try:
            return self.http.get("/healthz").json()["role"]
        except httpx.HTTPError:
            return None

    def wait_leader(self, timeout_s: float = DEFAULT_WAIT_S) -> None:
        wait_until(lambda: self.role() == "leader", timeout_s, "core to lead")

    def job(self, name: str) -> dict[str, Any]:
        response = self.http.get(f"/api/v1/jobs/{name}")
        response.raise_for_status()
        return response.json()

    def states(self, job: str) -> dict[str, str]:
        return {m["worker_id"]: m["state"] for m in self.job(job)["members"]}

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.http.close()
        self._log.close()


class AgentProcess:
    """`elaswave agent` launching a dummy worker."""

    def __init__(
        self,
        tmp: Path,
        job: str,
        worker_id: str,
        core_addresses: str,
        job_token: str,
        *,
        rank: int = -1,
        stage: int = 0,
        dp_rank: int = 0,
        etcd: str | None = None,
        step_time_s: float = 0.1,
        heartbeat_interval_s: float = 0.25,
        lease_ttl_s: int = 2,
    ) -> None:
        self.worker_id = worker_id
        self.log_path = tmp / f"agent-{worker_id}.log"
        # Where the agent writes its worker's credential (agent.config control_path + suffix).
        self.worker_token_file = tmp / f"{worker_id}.control.json.worker-token"
        env = dict(os.environ, ELASWAVE_JOB_TOKEN=job_token)
        cmd = [
            sys.executable,
            "-m",
            "elaswave.cli",
            "agent",
            "--job",
            job,
            "--worker-id",
            worker_id,
            "--stage",
            str(stage),
            "--dp-rank",
            str(dp_rank),
            "--core",
            core_addresses,
            "--metrics-socket",
            str(tmp / f"{worker_id}.sock"),
            "--heartbeat-interval",
            str(heartbeat_interval_s),
        ]
        if rank >= 0:
            cmd += ["--rank", str(rank)]
        if etcd:
            cmd += ["--etcd", etcd, "--lease-ttl", str(lease_ttl_s)]
        cmd += [
            "--",
            sys.executable,
            "-m",
            "harness.dummy_worker",
            "--step-time",
            str(step_time_s),
            "--stage",
            str(stage),
            "--dp-rank",
            str(dp_rank),
        ]
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def signal(self, sig: signal.Signals) -> None:
        self.proc.send_signal(sig)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._log.close()


def new_token() -> str:
    return secrets.token_urlsafe(24)


def create_job(core: CoreProcess, scheduler_token: str, name: str, **body: Any) -> str:
    response = core.http.post(
        "/api/v1/jobs", json={"name": name, **body}, headers={"Authorization": f"Bearer {scheduler_token}"}
    )
    assert response.status_code == 201, response.text
    return response.json()["token"]
