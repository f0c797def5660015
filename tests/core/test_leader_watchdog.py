"""A leader whose event loop stops turning gives its lease up, and its agents move on.

The defect: the election keepalive runs in its own thread, so a leader whose event loop was held
(a CPU-bound call on it) kept renewing its lease; the standby never took over and agents stayed
attached to a Core that accepted their bytes and answered nothing. Here the leader's loop is held
for real (a blocking call scheduled on it) while its gRPC server and keepalive thread run on; the
standby must lead within the lease TTL + 1 s, and a real agent must register with it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from core_service.config import load_settings
from tests.core.core_thread import CoreThread
from tests.core.procs import AgentProcess, wait_until

pytestmark = [pytest.mark.etcd, pytest.mark.multiproc, pytest.mark.serial]

SCHEDULER_TOKEN = "scheduler-token-0123456789"
LEADER_TTL_S = 2.0
FREEZE_S = 8.0


def core(core_id: str, registry_url: str) -> CoreThread:
    settings = load_settings(
        core_id=core_id,
        grpc_port=0,
        http_port=0,
        registry_url=registry_url,
        scheduler_token=SCHEDULER_TOKEN,
        leader_ttl_s=LEADER_TTL_S,
        heartbeat_timeout_s=2.0,
        lease_ttl_s=2.0,
    )
    return CoreThread(settings)


@pytest.fixture
def pair(etcd_registry_url: str) -> Iterator[tuple[CoreThread, CoreThread]]:
    leader = core("core-a", etcd_registry_url)
    assert leader.run(leader.core.wait_leader(15), 20)
    standby = core("core-b", etcd_registry_url)
    yield leader, standby
    standby.stop()
    leader.stop()


@pytest.mark.timeout(90)
def test_a_leader_with_a_frozen_loop_is_replaced_and_its_agents_move(
    pair: tuple[CoreThread, CoreThread], tmp_path: Path
) -> None:
    leader, standby = pair
    with httpx.Client(base_url=leader.http_url, timeout=5) as http:
        created = http.post(
            "/api/v1/jobs", json={"name": "train"}, headers={"Authorization": f"Bearer {SCHEDULER_TOKEN}"}
        )
    assert created.status_code == 201, created.text
    cores = f"{leader.grpc_address},{standby.grpc_address}"
    agent = AgentProcess(tmp_path, "train", "w0", cores, created.json()["token"])
    try:
        members = leader.core.table.get("train").members
        wait_until(lambda: "w0" in members and members["w0"].state.value == "RUNNING", 20, "w0 running")
        leader.run(leader.core.wait_durable(), 10)  # the member is stored: the standby will know it
        assert not standby.core.leads

        frozen_at = time.monotonic()
        leader.freeze(FREEZE_S)
        wait_until(lambda: standby.core.leads, LEADER_TTL_S + 1.0, "the standby to lead")
        took_over_s = time.monotonic() - frozen_at
        assert took_over_s <= LEADER_TTL_S + 1.0
        # The frozen leader does not answer as one any more, even before its loop runs again.
        assert not leader.core.leads

        # The agent's stream to the frozen leader stays open but silent: it moves on by itself,
        # and its worker keeps its identity (its own credential) on the new leader.
        def kinds() -> list[str]:
            return [e.kind for e in standby.core.table.get("train").events]

        wait_until(lambda: "worker_reconnected" in kinds(), 10, "w0 to reconnect to the new leader")
        assert time.monotonic() - frozen_at < FREEZE_S, "the agent waited for the loop to come back"
        assert ("train", "w0") in standby.core.membership.sessions
        member = standby.core.table.get("train").members["w0"]
        assert member.state.value in ("JOINING", "RUNNING") and "worker_lost" not in kinds()
        step_downs = "elaswave_leader_watchdog_step_downs_total"
        assert leader.core.metrics.registry.get_sample_value(step_downs) == 1
        assert standby.core.metrics.registry.get_sample_value(step_downs) == 0
    finally:
        agent.stop()
