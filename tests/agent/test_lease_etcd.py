"""The agent's own liveness lease in a real etcd (the session ``etcd_server`` fixture)."""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import etcd3
import pytest

from tests.agent.harness import base_args, sleeper_command, wait_worker_ready

pytestmark = [pytest.mark.etcd, pytest.mark.multiproc]

TTL_S = 2  # etcd's minimum lease TTL with its default 100 ms heartbeat is 2 s


@pytest.fixture
def etcd_client(etcd_server) -> Iterator[etcd3.Etcd3Client]:
    host, port = etcd_server.endpoint.rsplit(":", 1)
    client = etcd3.client(host=host, port=int(port), timeout=5)
    yield client
    client.close()


def _wait_key(client: etcd3.Etcd3Client, key: str, present: bool, timeout: float) -> float:
    """Seconds until the key is (or is no longer) there; AssertionError after ``timeout``."""
    started = time.monotonic()
    while (client.get(key)[0] is not None) != present:
        assert time.monotonic() - started < timeout, f"{key} still {'absent' if present else 'present'}"
        time.sleep(0.05)
    return time.monotonic() - started


@pytest.mark.timeout(40)
def test_alive_key_lives_with_the_agent_is_recreated_after_a_stall_and_expires_after_kill9(
    core, run_agent, etcd_server, etcd_client, tmp_path: Path
):
    job = f"lease-{uuid.uuid4().hex[:8]}"
    key = f"/elaswave/jobs/{job}/alive/w0"
    args = base_args(tmp_path, core.address, "w0", "--etcd", etcd_server.endpoint, "--lease-ttl", str(TTL_S))
    args[args.index("testjob")] = job
    agent = run_agent(args + sleeper_command(tmp_path))
    register = core.wait_kind("register")[0].request.register
    assert register.holds_own_lease
    _wait_key(etcd_client, key, present=True, timeout=10)
    value, meta = etcd_client.get(key)
    record = json.loads(value)
    assert (record["host"], record["pid"], record["agent_pid"]) == (
        register.host,
        register.pid,
        agent.proc.pid,
    )
    assert record["agent_start_unix"] <= time.time()
    first_lease = meta.lease_id

    time.sleep(TTL_S * 1.5)  # refreshed every TTL/3: still there well past one TTL
    assert etcd_client.get(key)[1].lease_id == first_lease

    agent.signal(signal.SIGSTOP)  # a stall longer than the TTL: etcd drops the key
    try:
        _wait_key(etcd_client, key, present=False, timeout=TTL_S + 3)
    finally:
        agent.signal(signal.SIGCONT)
    _wait_key(etcd_client, key, present=True, timeout=TTL_S + 3)
    assert etcd_client.get(key)[1].lease_id != first_lease  # a new lease, the key rewritten
    assert "etcd_lease_expired" in agent.log

    os.kill(agent.proc.pid, signal.SIGKILL)
    agent.wait()
    gone_after = _wait_key(etcd_client, key, present=False, timeout=TTL_S + 3)
    print(f"\nalive key gone {gone_after:.2f} s after kill -9 of the agent (TTL {TTL_S} s)")
    assert gone_after <= TTL_S + 1.0


@pytest.mark.timeout(30)
def test_clean_shutdown_revokes_the_lease_at_once(core, run_agent, etcd_server, etcd_client, tmp_path: Path):
    job = f"lease-{uuid.uuid4().hex[:8]}"
    key = f"/elaswave/jobs/{job}/alive/w1"
    args = base_args(tmp_path, core.address, "w1", "--etcd", etcd_server.endpoint, "--etcd-prefix", "/ew2")
    args[args.index("testjob")] = job
    agent = run_agent(args + sleeper_command(tmp_path))
    key = key.replace("/elaswave/", "/ew2/")
    _wait_key(etcd_client, key, present=True, timeout=10)
    wait_worker_ready(tmp_path)
    agent.signal(signal.SIGINT)
    assert agent.wait() == 0
    assert etcd_client.get(key)[0] is None  # revoked, not left to expire
    assert "etcd_lease_revoked" in agent.log
