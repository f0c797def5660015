"""Leader election on both backends, and a real SIGKILLed leader process on etcd."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from core_service.registry import EtcdRegistry, FenceLost, LeaderElection, Registry, holder_of
from tests.registry.helpers import EXPIRY_SLACK_S, lease_ttl

pytestmark = pytest.mark.timeout(60)

KEY = "/elaswave/core/leader"
REPO_ROOT = Path(__file__).resolve().parents[2]


def test_single_candidate_leads_and_is_recorded(registry: Registry) -> None:
    election = LeaderElection(registry, KEY, "core-a", lease_ttl(registry))
    assert election.leader_id() is None
    assert election.campaign(timeout_s=5) is True
    assert election.is_leader
    assert election.leader_id() == "core-a"
    assert election.campaign(timeout_s=0) is True, "campaigning again while leading is a no-op"
    election.resign()
    assert not election.is_leader
    assert registry.get(KEY) is None


def test_each_term_has_its_own_fence(registry: Registry) -> None:
    # A write left over from an earlier term of the same Core must not pass a later term's fence.
    election = LeaderElection(registry, KEY, "core-a", lease_ttl(registry))
    assert election.campaign(timeout_s=5)
    first = election.fence
    registry.put_fenced(first, "/elaswave/jobs/j/members/w0", b"term 1")
    election.resign()
    with pytest.raises(FenceLost):
        registry.put_fenced(election.fence, "/elaswave/jobs/j/members/w0", b"not leading")
    assert election.campaign(timeout_s=5)
    second = election.fence
    assert second != first and election.leader_id() == "core-a"
    with pytest.raises(FenceLost):
        registry.put_fenced(first, "/elaswave/jobs/j/members/w0", b"late write of term 1")
    registry.put_fenced(second, "/elaswave/jobs/j/members/w0", b"term 2")
    assert registry.get("/elaswave/jobs/j/members/w0") == b"term 2"
    election.resign()


def test_standby_cannot_win_while_the_leader_refreshes(registry: Registry) -> None:
    ttl = lease_ttl(registry)
    leader = LeaderElection(registry, KEY, "core-a", ttl)
    standby = LeaderElection(registry, KEY, "core-b", ttl)
    assert leader.campaign(timeout_s=5)
    # Campaign for longer than the TTL: only the keepalive thread keeps the leader's key alive.
    assert standby.campaign(timeout_s=ttl * 1.5) is False
    assert leader.is_leader and not standby.is_leader
    assert standby.leader_id() == "core-a"
    leader.resign()


def test_standby_takes_over_immediately_after_resign(registry: Registry) -> None:
    # A TTL far beyond the campaign timeout: only the revocation in resign() can let the standby in.
    leader = LeaderElection(registry, KEY, "core-a", ttl_s=60)
    standby = LeaderElection(registry, KEY, "core-b", ttl_s=60)
    assert leader.campaign(timeout_s=5)
    won: list[bool] = []
    campaigner = threading.Thread(target=lambda: won.append(standby.campaign(timeout_s=10)))
    campaigner.start()
    time.sleep(0.3)  # let the standby start watching
    leader.resign()
    campaigner.join(timeout=30)
    assert won == [True]
    assert standby.leader_id() == "core-b"
    standby.resign()


def test_standby_takes_over_when_the_leader_stops_refreshing(registry: Registry) -> None:
    ttl = lease_ttl(registry)
    leader = LeaderElection(registry, KEY, "core-a", ttl)
    standby = LeaderElection(registry, KEY, "core-b", ttl)
    assert leader.campaign(timeout_s=5)
    leader.abandon()  # the keepalive stops, the lease is not revoked: a crash as seen from outside
    assert not leader.is_leader
    stored = registry.get(KEY)
    assert stored is not None and holder_of(stored) == "core-a"
    assert standby.campaign(timeout_s=ttl + EXPIRY_SLACK_S + 0.5)
    assert standby.leader_id() == "core-b"
    standby.resign()


def test_on_lost_fires_when_the_lease_is_revoked_behind_the_leaders_back(registry: Registry) -> None:
    lost = threading.Event()
    election = LeaderElection(registry, KEY, "core-a", lease_ttl(registry), on_lost=lost.set)
    assert election.campaign(timeout_s=5)
    lease = election.lease_id
    assert lease is not None
    registry.revoke_lease(lease)
    assert lost.wait(timeout=lease_ttl(registry) + 2)
    assert not election.is_leader
    assert election.lease_id is None
    assert registry.get(KEY) is None


def test_on_lost_fires_when_another_candidate_owns_the_key(registry: Registry) -> None:
    lost = threading.Event()
    election = LeaderElection(registry, KEY, "core-a", lease_ttl(registry), on_lost=lost.set)
    assert election.campaign(timeout_s=5)
    registry.put(KEY, b"operator-override")
    assert lost.wait(timeout=lease_ttl(registry) + 2)
    assert not election.is_leader


def test_bad_arguments_are_refused(registry: Registry) -> None:
    with pytest.raises(ValueError, match="candidate_id"):
        LeaderElection(registry, KEY, "", 2.0)
    with pytest.raises(ValueError, match="ttl_s"):
        LeaderElection(registry, KEY, "core-a", 0)
    with pytest.raises(ValueError, match="non-empty"):
        LeaderElection(registry, "", "core-a", 2.0)
    with pytest.raises(ValueError, match="timeout_s"):
        LeaderElection(registry, KEY, "core-a", 2.0).campaign(timeout_s=-1)


@pytest.mark.etcd
@pytest.mark.multiproc
@pytest.mark.timeout(60)
def test_standby_takes_over_from_a_sigkilled_leader_process(
    etcd_registry: EtcdRegistry, etcd_registry_url: str
) -> None:
    registry, registry_url = etcd_registry, etcd_registry_url
    ttl = lease_ttl(registry)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    leader = subprocess.Popen(
        [sys.executable, "-m", "tests.registry.leader_process", registry_url, KEY, "core-proc", str(ttl)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=REPO_ROOT,
        env=env,
        text=True,
    )
    try:
        line = _read_line(leader, timeout_s=30)
        assert line == "LEADER", (
            f"leader process said {line!r}; stderr: {leader.stderr.read() if leader.stderr else ''}"
        )
        standby = LeaderElection(registry, KEY, "core-b", ttl)
        assert standby.campaign(timeout_s=ttl) is False, "the live leader process must keep its lease"
        assert standby.leader_id() == "core-proc"
        leader.send_signal(signal.SIGKILL)
        leader.wait(timeout=10)
        assert standby.campaign(timeout_s=ttl + EXPIRY_SLACK_S + 0.5)
        assert standby.leader_id() == "core-b"
        standby.resign()
    finally:
        if leader.poll() is None:
            leader.kill()
        leader.wait(timeout=10)
        for stream in (leader.stdout, leader.stderr):
            if stream is not None:
                stream.close()


def _read_line(proc: subprocess.Popen[str], timeout_s: float) -> str:
    """First stdout line of ``proc``, bounded in time (a reader thread, since pipes block)."""
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.append(proc.stdout.readline() if proc.stdout else ""))
    reader.daemon = True
    reader.start()
    reader.join(timeout=timeout_s)
    return lines[0].strip() if lines else ""
