"""A job's stores in the registry, and the launcher's REST client following the leading Core.

Two real Cores on one real etcd: the job's store list, given at creation and replaced through
`PUT /api/v1/jobs/{job}/stores`, is what the standby serves once it leads (the leader is
SIGKILLed); `elaswave.core_rest.CoreClient` given both addresses reaches the leader whichever it
tries first, and after the failover too.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from elaswave.core_rest import CoreClient
from tests.core.procs import CoreProcess, create_job, new_token

pytestmark = [pytest.mark.multiproc, pytest.mark.etcd]


@pytest.fixture
def cores(tmp_path: Path, etcd_registry_url: str) -> Iterator[tuple[CoreProcess, CoreProcess, str]]:
    token = new_token()
    first = CoreProcess(tmp_path, "core-a", etcd_registry_url, token, extra_args=["--advertise", "127.0.0.1"])
    first.wait_leader(timeout_s=30)
    second = CoreProcess(
        tmp_path, "core-b", etcd_registry_url, token, extra_args=["--advertise", "127.0.0.1"]
    )
    try:
        yield first, second, token
    finally:
        second.stop()
        first.stop()


@pytest.mark.timeout(120)
def test_the_stores_a_job_lists_survive_a_failover_and_the_client_follows_the_leader(
    cores: tuple[CoreProcess, CoreProcess, str],
) -> None:
    first, second, token = cores
    auth = {"Authorization": f"Bearer {token}"}
    create_job(first, token, "j", stores=["10.0.0.1:2000", "10.0.0.2:2000"])
    urls = [f"http://127.0.0.1:{c.http_port}" for c in (second, first)]  # the standby first
    with CoreClient(urls, timeout=5.0) as client:
        assert client.get("/api/v1/jobs/j").json()["stores"] == ["10.0.0.1:2000", "10.0.0.2:2000"]
        assert str(client.base_url).rstrip("/") == urls[1]  # followed the standby's leader hint
        bad = client.put("/api/v1/jobs/j/stores", json={"stores": ["nowhere"]}, headers=auth)
        assert bad.status_code == 422 and "is not HOST:PORT" in bad.text
        assert (
            client.put("/api/v1/jobs/nope/stores", json={"stores": ["h:1"]}, headers=auth).status_code == 404
        )
        moved = client.put(
            "/api/v1/jobs/j/stores", json={"stores": ["10.0.0.2:2000", "10.0.0.3:7"]}, headers=auth
        )
        assert moved.status_code == 200, moved.text
        first.kill()
        second.wait_leader(timeout_s=30)
        job = client.get("/api/v1/jobs/j").json()  # the dead Core refuses: the next one answers
        assert str(client.base_url).rstrip("/") == urls[0]
    assert job["stores"] == ["10.0.0.2:2000", "10.0.0.3:7"]
    changed = [
        e for e in second.http.get("/api/v1/jobs/j/events").json()["events"] if e["kind"] == "stores_changed"
    ]
    assert [e["detail"] for e in changed] == ["10.0.0.2:2000, 10.0.0.3:7"]
