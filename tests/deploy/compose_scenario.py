"""The compose deployment for real (`make compose-test`, after `make images`; not collected by
`make test`, which has no container engine to assume): deploy/compose/compose.yaml under podman,
from the images built from this checkout. etcd, two Cores electing through it and three worker
nodes whose launchers (`elaswave run --core`) train the GPT example as one job (PP=2 x DP=3).

While the job trains, one worker container is stopped (SIGTERM: its node is preempted, the job
re-plans without it) and another is killed (SIGKILL: its workers are lost and the job recovers in
place on the last node); the job completes and its final checkpoint equals the one-process run of
the same script. Then the leading Core's container is killed and the standby leads, and a Core
that hangs is reported unhealthy by its HEALTHCHECK. Every service listens on 127.0.0.1 only
(host network). The Core kill comes after the job, as it did when a Core failover ended `run
--core` jobs; a failover in the middle of a job is proved on processes (tests/core_failover/, the
soak: `make soak-short`).
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from elaswave.launcher_monitor import EXIT_LEFT_RUNNING_JOB
from harness.chaos import MAX_FINAL_STATE_REL_DIFF, compare_final_state
from tests.deploy.engine import (
    Compose,
    exit_code,
    health_check,
    host_pid,
    inspect,
    last_health_output,
    podman,
    wait_for,
    wait_healthy,
)

VERSION = os.environ.get("ELASWAVE_VERSION", "0.1.0")
WORKER_IMAGE = f"localhost/elaswave-worker:{VERSION}"
WORKERS, STEPS, CHECKPOINT_EVERY = 3, int(os.environ.get("ELASWAVE_COMPOSE_STEPS", "1000")), 10
SCRIPT = "/opt/elaswave-examples/examples/gpt/train.py"
UID = 10001  # every image's user


@dataclass
class Deployment:
    compose: Compose
    token: str
    ports: dict[str, int]
    checkpoints: Path
    workdir: Path
    workers_started: float = 0.0  # time.monotonic() when the worker containers were started

    def core(self, name: str) -> httpx.Client:
        port = self.ports[f"CORE_{name[-1].upper()}_HTTP_PORT"]
        headers = {"Authorization": f"Bearer {self.token}"}
        return httpx.Client(base_url=f"http://127.0.0.1:{port}", headers=headers, timeout=10)

    def container(self, service: str) -> str:
        (name,) = self.compose.containers(service)
        return name


def free_ports(names: list[str]) -> dict[str, int]:
    sockets = [socket.socket() for _ in names]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = {name: s.getsockname()[1] for name, s in zip(names, sockets, strict=True)}
    for s in sockets:
        s.close()
    return ports


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    workdir = tmp_path_factory.mktemp("compose")
    checkpoints = workdir / "checkpoints"
    checkpoints.mkdir()
    os.chown(checkpoints, UID, UID)  # the workers' user writes there (a bind mount)
    ports = free_ports(
        ["ETCD_CLIENT_PORT", "ETCD_PEER_PORT"]
        + [f"CORE_{c}_{p}_PORT" for c in "AB" for p in ("HTTP", "GRPC")]
    )
    token = secrets.token_urlsafe(24)
    env = {
        "ELASWAVE_SCHEDULER_TOKEN": token,
        "ETCD_IMAGE": "localhost/elaswave-etcd:3.4",
        "WORKERS": str(WORKERS),
        "STEPS": str(STEPS),
        "CHECKPOINT_EVERY": str(CHECKPOINT_EVERY),
        "ELASWAVE_CHECKPOINTS": str(checkpoints),
        **{name: str(port) for name, port in ports.items()},
    }
    # scripts/compose-test.sh removes whatever carries this project's label, come what may.
    project = os.environ.get("ELASWAVE_COMPOSE_PROJECT") or f"elaswave-ci-{secrets.token_hex(3)}"
    compose = Compose(project, env)
    deployment = Deployment(compose, token, ports, checkpoints, workdir)
    try:
        started = time.monotonic()
        for service in ("etcd", "core-a", "core-b"):  # each once the one before is healthy
            (container,) = compose.up(service)
            wait_healthy(container)
        deployment.workers_started = time.monotonic()
        compose.up("worker")
        print(f"compose: etcd and two healthy Cores up in {time.monotonic() - started:.0f} s")
        yield deployment
    finally:
        compose.save_logs(Path(os.environ.get("ELASWAVE_ARTIFACT_DIR", workdir)) / "compose-logs")
        compose.down()


def test_every_container_runs_as_its_images_non_root_user(deployment: Deployment) -> None:
    names = deployment.compose.containers()
    assert len(names) == 3 + WORKERS, names
    for name in names:
        assert inspect(name)["Config"]["User"] == f"{UID}:{UID}", name
        users = _process_users(name)
        assert users and set(users) == {str(UID)}, (name, users)


def _process_users(name: str, readings: int = 5) -> list[str]:
    """The host user of every process in container `name`, init included. `podman top` shows
    "?" for a process that exited while it read the list (a health check's exec, say): read
    again until a listing has none, at most `readings` times (then the last, "?" and all)."""
    users: list[str] = []
    for _ in range(readings):
        users = podman("top", name, "huser").stdout.split()[1:]
        if "?" not in users:
            break
        time.sleep(0.2)
    return users


def job(deployment: Deployment) -> dict[str, Any]:
    with deployment.core("core-a") as http:
        response = http.get("/api/v1/jobs/gpt")
    return dict(response.json()) if response.status_code == 200 else {}


def events(deployment: Deployment) -> list[dict[str, Any]]:
    with deployment.core("core-a") as http:
        return list(http.get("/api/v1/jobs/gpt/events", params={"limit": 10_000}).json()["events"])


def steps_by_worker(deployment: Deployment) -> dict[str, int]:
    return {
        m["worker_id"]: int((m.get("last_step") or {}).get("step", -1))
        for m in job(deployment).get("members", [])
        if m["state"] not in ("LEFT", "LOST")
    }


def node_of(container: str) -> tuple[int, list[int]]:
    """The node index the Core gave this container's launcher, and the ranks it runs."""
    record = json.loads(podman("exec", container, "cat", "/var/lib/elaswave/run/nodes.json").stdout)
    this = int(record["this_node"])
    return this, [r for r, n in enumerate(record["rank_node"]) if n == this]


@pytest.fixture
def one_process(deployment: Deployment) -> Iterator[tuple[str, Path]]:
    """The fault-free run of the same script in one process, in the worker image, started now
    (it trains while the job does): its container and its checkpoint directory."""
    reference = deployment.workdir / "reference"
    reference.mkdir()
    os.chown(reference, UID, UID)
    name = f"{deployment.compose.project}-one-process"
    podman(
        "run", "--detach", "--name", name, "--init", "--network", "none", "-v", f"{reference}:/ref",
        "--label", f"com.docker.compose.project={deployment.compose.project}",
        "--entrypoint", "/opt/elaswave/bin/python", WORKER_IMAGE, SCRIPT, "--steps", str(STEPS),
        "--checkpoint-dir", "/ref", "--checkpoint-every", str(CHECKPOINT_EVERY),
    )  # fmt: skip
    try:
        yield name, reference
    finally:
        podman("rm", "--force", "--time", "0", name, check=False)


def test_the_job_survives_a_preemption_and_a_lost_node_and_ends_like_one_process(
    deployment: Deployment, one_process: tuple[str, Path]
) -> None:
    workers = deployment.compose.containers("worker")
    wait_for(
        "all six workers to commit step 2",
        lambda: len(s := steps_by_worker(deployment)) == 2 * WORKERS and min(s.values()) >= 2,
        timeout_s=300,
        every_s=2,
    )
    print(
        f"compose: all six workers trained step 2 {time.monotonic() - deployment.workers_started:.0f} s after start"
    )
    nodes = {c: node_of(c) for c in workers}
    by_node = {index: c for c, (index, _) in nodes.items()}  # node index -> its container
    ranks = {index: node_ranks for index, node_ranks in nodes.values()}
    members = {int(m["rank"]): m["worker_id"] for m in job(deployment)["members"]}
    for name in workers:
        assert health_check(name) == "healthy", last_health_output(name)  # its launcher runs agents
    pids = {m["worker_id"]: m["pid"] for m in job(deployment)["members"]}

    preempted, lost, survivor = by_node[2], by_node[1], by_node[0]
    podman("stop", "--time", "60", preempted, timeout_s=120)  # SIGTERM, as a node is taken away
    # The launcher's documented code for "this node's workers left a job that goes on" (docs/api.md).
    assert exit_code(preempted, 60) == EXIT_LEFT_RUNNING_JOB
    at = max(steps_by_worker(deployment).values())
    wait_for(
        "the others to train 3 steps on", lambda: min(steps_by_worker(deployment).values()) >= at + 3, 180
    )
    podman("kill", lost)  # SIGKILL: the node is lost
    lost_at = max(steps_by_worker(deployment).values())
    assert lost_at < STEPS - 5, (
        f"the job was at step {lost_at} of {STEPS} already: raise ELASWAVE_COMPOSE_STEPS"
    )
    assert exit_code(survivor, 600) == 0, podman("logs", survivor, check=False).stdout[-3000:]

    log = podman("logs", survivor).stdout + podman("logs", survivor).stderr
    assert f"job 'gpt' finished: {STEPS}/{STEPS} steps" in log, log[-3000:]
    seen = events(deployment)
    preempted_ids = {members[r] for r in ranks[2]}
    lost_ids = {members[r] for r in ranks[1]}
    marked = {e["worker_id"] for e in seen if e["kind"] == "worker_preempting" and "sigterm" in e["detail"]}
    left = {
        e["worker_id"] for e in seen if e["kind"] == "worker_left" and "exited with code 0" in e["detail"]
    }
    lost_seen = {e["worker_id"] for e in seen if e["kind"] == "worker_lost"}
    assert preempted_ids <= marked and preempted_ids <= left, [(e["kind"], e["worker_id"]) for e in seen]
    assert lost_seen == lost_ids, [(e["kind"], e["worker_id"], e["detail"]) for e in seen]
    assert any(e["kind"] == "job_completed" for e in seen)
    final = job(deployment)
    survivors = {members[r] for r in ranks[0]}
    # Recovered in place: the last node's workers are the processes that started the job.
    assert {m["worker_id"]: m["pid"] for m in final["members"] if m["worker_id"] in survivors} == {
        w: pids[w] for w in survivors
    }

    reference, reference_dir = one_process
    assert exit_code(reference, 900) == 0, podman("logs", reference, check=False).stderr[-3000:]
    diff, why = compare_final_state(deployment.checkpoints, reference_dir)
    assert not why, why
    assert diff <= MAX_FINAL_STATE_REL_DIFF, f"final state differs from the one-process run's by {diff:.2e}"
    print(f"compose: job of {STEPS} steps, final state vs one process: max relative difference {diff:.2e}")


def role(deployment: Deployment, core: str) -> str:
    try:
        with deployment.core(core) as http:
            return str(http.get("/healthz").json().get("role", ""))
    except (httpx.HTTPError, ValueError):
        return ""


def test_the_standby_leads_when_the_leading_cores_container_is_killed(deployment: Deployment) -> None:
    assert (role(deployment, "core-a"), role(deployment, "core-b")) == ("leader", "standby")
    with deployment.core("core-b") as http:
        assert http.get("/readyz").status_code == 503  # a leader-only Service routes to core-a
    killed = time.monotonic()
    podman("kill", deployment.container("core-a"))
    wait_for("core-b to lead", lambda: role(deployment, "core-b") == "leader", timeout_s=60)
    print(f"compose: core-b leads {time.monotonic() - killed:.1f} s after core-a's container was killed")
    with deployment.core("core-b") as http:
        assert http.get("/readyz").status_code == 200
        jobs = http.get("/api/v1/jobs").json()["jobs"]
    assert [j["name"] for j in jobs] == ["gpt"]  # reloaded from etcd
    assert health_check(deployment.container("core-b")) == "healthy"


def test_a_hung_core_is_reported_unhealthy_by_the_engine(deployment: Deployment) -> None:
    """The Core's HEALTHCHECK (/healthz and gRPC health within 3 s) fails three times in a row on a
    Core that no longer answers: the engine marks its container unhealthy."""
    core_b = deployment.container("core-b")
    assert health_check(core_b) == "healthy"
    pid = host_pid(core_b, "elaswave core")
    os.kill(pid, signal.SIGSTOP)
    try:
        wait_for(f"{core_b} to be unhealthy", lambda: health_check(core_b) == "unhealthy", timeout_s=90)
    finally:
        os.kill(pid, signal.SIGCONT)
    wait_healthy(core_b, timeout_s=60)  # and healthy again once it answers
