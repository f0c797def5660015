"""A real etcd, real Cores and real agent processes: the detection paths of docs/architecture.md ("The Core's decisions") and the
Core's leader failover, observed through the REST API."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Unpack

import pytest

from tests.core.procs import AgentProcess, CoreProcess, CoreTimeouts, create_job, new_token, wait_until

pytestmark = [pytest.mark.etcd, pytest.mark.multiproc]


@contextlib.contextmanager
def running_cluster(tmp_path: Path, etcd_url: str, **core_settings: Unpack[CoreTimeouts]) -> Iterator[dict]:
    """A leading Core on `etcd_url` (`core_settings`: CoreProcess timeouts); every agent and Core
    the test adds to the dict is stopped afterwards."""
    token = new_token()
    core = CoreProcess(tmp_path, "core-a", etcd_url, token, **core_settings)
    started: dict = {
        "core": core,
        "token": token,
        "tmp": tmp_path,
        "etcd": etcd_url,
        "agents": [],
        "cores": [core],
    }
    try:
        core.wait_leader()
        yield started
    finally:
        for agent in started["agents"]:
            agent.stop()
        for c in started["cores"]:
            c.stop()


@pytest.fixture
def cluster(tmp_path: Path, etcd_registry_url: str) -> Iterator[dict]:
    with running_cluster(tmp_path, etcd_registry_url) as started:
        yield started


def start_agents(
    cluster: dict, n: int, cores: str, job_token: str, *, own_lease: bool = True, lease_ttl_s: int = 2
) -> list[AgentProcess]:
    """`own_lease`: the agent holds its liveness lease in etcd itself; otherwise the Core does."""
    etcd = cluster["etcd"].removeprefix("etcd://") if own_lease else None
    agents = [
        AgentProcess(
            cluster["tmp"],
            "train",
            f"w{i}",
            cores,
            job_token,
            rank=i,
            dp_rank=i,
            etcd=etcd,
            lease_ttl_s=lease_ttl_s,
        )
        for i in range(n)
    ]
    cluster["agents"].extend(agents)
    return agents


def all_running(core: CoreProcess, n: int) -> bool:
    states = core.states("train")
    return len(states) == n and all(s == "RUNNING" for s in states.values())


@pytest.mark.timeout(60)
def test_worker_kill_is_visible_in_rest_within_one_second(cluster: dict) -> None:
    core: CoreProcess = cluster["core"]
    job_token = create_job(core, cluster["token"], "train", expected_workers=3)
    start_agents(cluster, 3, core.grpc_address, job_token)
    wait_until(lambda: all_running(core, 3), 30, "three running workers")
    victim = core.job("train")["members"][1]
    killed = time.monotonic()
    os.kill(victim["pid"], signal.SIGKILL)
    wait_until(lambda: core.states("train")["w1"] == "LOST", 1.0, "w1 LOST within 1 s of kill -9")
    print(f"worker kill seen by the Core after {(time.monotonic() - killed) * 1000:.0f} ms")
    member = next(m for m in core.job("train")["members"] if m["worker_id"] == "w1")
    assert member["lost_reason"] == "worker process killed by signal 9"
    assert core.states("train") == {"w0": "RUNNING", "w1": "LOST", "w2": "RUNNING"}


@pytest.mark.timeout(60)
def test_agent_sigkill_and_hung_agent_detected_within_lease_ttl(cluster: dict) -> None:
    import etcd3

    core: CoreProcess = cluster["core"]
    job_token = create_job(core, cluster["token"], "train")
    agents = start_agents(cluster, 3, core.grpc_address, job_token)
    wait_until(lambda: all_running(core, 3), 30, "three running workers")
    host, port = cluster["etcd"].removeprefix("etcd://").rsplit(":", 1)
    etcd = etcd3.client(host=host, port=int(port), timeout=5)
    alive = "/elaswave/jobs/train/alive/"
    assert sorted(m.key.decode() for _, m in etcd.get_prefix(alive)) == [
        alive + w for w in ("w0", "w1", "w2")
    ]
    ttl = 2.0

    # SIGKILL: no Leave, no clean close. The kernel closes the socket (fast path); the lease expires too.
    killed = time.monotonic()
    agents[0].signal(signal.SIGKILL)
    wait_until(lambda: core.states("train")["w0"] == "LOST", ttl + 1, "w0 LOST within TTL + 1 s")
    wait_until(lambda: etcd.get(alive + "w0")[0] is None, ttl + 1, "w0's lease to expire in etcd")
    print(f"agent SIGKILL detected after {(time.monotonic() - killed) * 1000:.0f} ms")

    # SIGSTOP: the stream stays open and nothing is sent; only the lease/heartbeat paths can see it.
    stopped = time.monotonic()
    agents[1].signal(signal.SIGSTOP)
    wait_until(lambda: core.states("train")["w1"] == "LOST", ttl + 1, "hung w1 LOST within TTL + 1 s")
    print(f"hung agent detected after {(time.monotonic() - stopped) * 1000:.0f} ms")
    reason = next(m for m in core.job("train")["members"] if m["worker_id"] == "w1")["lost_reason"]
    assert reason.startswith(("no heartbeat", "liveness lease expired"))
    assert core.states("train")["w2"] == "RUNNING"
    etcd.close()


@pytest.mark.serial  # asserts detection within half a heartbeat timeout
@pytest.mark.timeout(60)
def test_hung_agent_is_detected_by_its_own_lease_expiring(tmp_path: Path, etcd_registry_url: str) -> None:
    # Heartbeats would take 10 s to notice; the agents' own 2 s leases must be what detects the hang.
    heartbeat_timeout_s, agent_ttl_s = 10.0, 2
    with running_cluster(
        tmp_path, etcd_registry_url, heartbeat_timeout_s=heartbeat_timeout_s, lease_ttl_s=heartbeat_timeout_s
    ) as cluster:
        core: CoreProcess = cluster["core"]
        job_token = create_job(core, cluster["token"], "train")
        agents = start_agents(cluster, 2, core.grpc_address, job_token, lease_ttl_s=agent_ttl_s)
        wait_until(lambda: all_running(core, 2), 30, "two running workers")
        assert all(m["holds_own_lease"] for m in core.job("train")["members"])

        # SIGSTOP: the stream stays open and silent; the agent stops refreshing its lease.
        stopped = time.monotonic()
        agents[0].signal(signal.SIGSTOP)
        wait_until(
            lambda: core.states("train")["w0"] == "LOST", agent_ttl_s + 1, "hung w0 LOST within TTL + 1 s"
        )
        detected_s = time.monotonic() - stopped
        print(f"hung agent detected by lease expiry after {detected_s * 1000:.0f} ms")
        member = next(m for m in core.job("train")["members"] if m["worker_id"] == "w0")
        assert member["lost_reason"] == "liveness lease expired"
        assert detected_s < heartbeat_timeout_s / 2  # not even the heartbeat nudge had fired
        assert core.metric("elaswave_failures_detected_total", path="lease_expired") == 1
        assert core.metric("elaswave_failures_detected_total", path="heartbeat") == 0
        assert core.states("train")["w1"] == "RUNNING"
        agents[0].signal(signal.SIGCONT)  # lets stop() end it with SIGINT rather than a kill


@pytest.mark.timeout(90)
def test_leader_core_killed_standby_takes_over_with_membership_intact(cluster: dict) -> None:
    leader: CoreProcess = cluster["core"]
    standby = CoreProcess(cluster["tmp"], "core-b", cluster["etcd"], cluster["token"])
    cluster["cores"].append(standby)
    assert standby.role() == "standby"
    job_token = create_job(leader, cluster["token"], "train", expected_workers=3)
    cores = f"{leader.grpc_address},{standby.grpc_address}"
    start_agents(cluster, 3, cores, job_token)
    wait_until(lambda: all_running(leader, 3), 30, "three running workers")
    before = leader.job("train")
    pids = {m["worker_id"]: m["pid"] for m in before["members"]}

    leader.kill()
    standby.wait_leader(timeout_s=10)
    # Every agent reconnects to the new leader; nobody was declared lost on the way.
    wait_until(
        lambda: (
            len(
                [
                    e
                    for e in standby.http.get("/api/v1/jobs/train/events").json()["events"]
                    if e["kind"] == "worker_reconnected"
                ]
            )
            >= 3
        ),
        20,
        "three agents to reconnect",
    )
    # A member the dead leader stored as JOINING (killed before its move to RUNNING was stored)
    # is RUNNING again at its next step report.
    wait_until(lambda: all_running(standby, 3), 5, "three running workers on the new leader")
    after = standby.job("train")
    assert {m["worker_id"]: m["state"] for m in after["members"]} == {
        "w0": "RUNNING",
        "w1": "RUNNING",
        "w2": "RUNNING",
    }
    assert {m["worker_id"]: m["pid"] for m in after["members"]} == pids
    kinds = [e["kind"] for e in standby.http.get("/api/v1/jobs/train/events").json()["events"]]
    assert "worker_lost" not in kinds
    # The event history written by the dead leader is still there, in order.
    old_events = [
        (e["seq"], e["kind"]) for e in standby.http.get("/api/v1/jobs/train/events").json()["events"]
    ][: before["last_event_seq"]]
    assert [seq for seq, _ in old_events] == list(range(1, before["last_event_seq"] + 1))
    # And the new leader still detects failures.
    os.kill(pids["w2"], signal.SIGKILL)
    wait_until(lambda: standby.states("train")["w2"] == "LOST", 2, "w2 LOST on the new leader")


@pytest.mark.timeout(90)
def test_failover_keeps_workers_whose_lease_the_dead_leader_held(cluster: dict) -> None:
    """Agents without --etcd: the dead leader held their liveness leases, which expire seconds
    after it dies, while the agents may still be backing off. The new leader must not read
    those expiries as lost workers."""
    leader: CoreProcess = cluster["core"]
    standby = CoreProcess(cluster["tmp"], "core-b", cluster["etcd"], cluster["token"])
    cluster["cores"].append(standby)
    job_token = create_job(leader, cluster["token"], "train", expected_workers=3)
    start_agents(cluster, 3, f"{leader.grpc_address},{standby.grpc_address}", job_token, own_lease=False)
    wait_until(lambda: all_running(leader, 3), 30, "three running workers")
    assert not any(m["holds_own_lease"] for m in leader.job("train")["members"])
    host, port = cluster["etcd"].removeprefix("etcd://").rsplit(":", 1)
    import etcd3

    etcd = etcd3.client(host=host, port=int(port), timeout=5)
    alive = "/elaswave/jobs/train/alive/"
    old_leases = {m.key.decode(): m.lease_id for _, m in etcd.get_prefix(alive)}
    assert sorted(old_leases) == [alive + w for w in ("w0", "w1", "w2")]

    leader.kill()
    standby.wait_leader(timeout_s=10)

    def events() -> list[dict]:
        return standby.http.get("/api/v1/jobs/train/events").json()["events"]

    # Reconnected (still a member) or rejoined (declared lost meanwhile: the bug), both count here.
    back = {"worker_reconnected", "worker_rejoined"}
    wait_until(
        lambda: len({e["worker_id"] for e in events() if e["kind"] in back}) == 3,
        20,
        "three agents to reconnect",
    )
    # Every lease the dead leader held has run out by now (TTL 2 s, etcd checks every 0.5 s).
    wait_until(
        lambda: all(etcd.get_lease_info(lease).TTL <= 0 for lease in old_leases.values()),
        10,
        "the dead leader's leases to expire",
    )
    time.sleep(0.5)  # a deletion the watch delivered is handled within this
    assert [(e["worker_id"], e["detail"]) for e in events() if e["kind"] == "worker_lost"] == []
    assert {e["kind"] for e in events() if e["kind"] in back} == {"worker_reconnected"}
    assert standby.states("train") == {"w0": "RUNNING", "w1": "RUNNING", "w2": "RUNNING"}
    # The new leader holds fresh leases for them, and still detects a failure through them.
    new_leases = {m.key.decode(): m.lease_id for _, m in etcd.get_prefix(alive)}
    assert sorted(new_leases) == sorted(old_leases)
    assert not set(new_leases.values()) & set(old_leases.values())
    cluster["agents"][2].signal(signal.SIGKILL)
    wait_until(lambda: standby.states("train")["w2"] == "LOST", 2, "w2 LOST on the new leader")
    etcd.close()
