"""Where to go (issue 27, item 6): a standby names the leader's REST address to REST clients and
its gRPC address to gRPC clients; a taken port stops the Core with one line naming the setting.

Two real Core processes on a real etcd (tests/etcd_server.py), gRPC and REST on port 0.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from tests.core.procs import CoreProcess, new_token
from tests.test_launcher import _env
from wire.v1 import scheduler_pb2, scheduler_pb2_grpc


@pytest.fixture
def pair(tmp_path: Path, etcd_registry_url: str) -> Iterator[tuple[CoreProcess, CoreProcess, str]]:
    token = new_token()
    leader = CoreProcess(tmp_path, "core-a", etcd_registry_url, token)
    leader.wait_leader()
    standby = CoreProcess(tmp_path, "core-b", etcd_registry_url, token)
    try:
        yield leader, standby, token
    finally:
        standby.stop()
        leader.stop()


@pytest.mark.etcd
@pytest.mark.multiproc
@pytest.mark.timeout(60)
def test_a_standby_names_the_leaders_address_for_each_api(pair: tuple[CoreProcess, CoreProcess, str]) -> None:
    leader, standby, token = pair
    rest_url = f"http://127.0.0.1:{leader.http_port}"
    answer = standby.http.get("/api/v1/jobs")
    assert answer.status_code == 503 and answer.json()["detail"] == f"not leader; leader is {rest_url}"
    assert standby.http.get("/healthz").json()["leader"] == rest_url
    assert standby.http.get("/readyz").json()["detail"] == f"not leader; leader is {rest_url}"
    with grpc.insecure_channel(standby.grpc_address) as channel:
        scheduler = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            scheduler.GetJobState(
                scheduler_pb2.GetJobStateRequest(job="x"),
                metadata=[("authorization", f"Bearer {token}")],
                timeout=5,
            )
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert refused.value.details() == f"not leader; leader is {leader.grpc_address}"


@pytest.mark.multiproc
@pytest.mark.timeout(60)
@pytest.mark.parametrize(("flag", "setting"), [("--http-port", "http_port"), ("--grpc-port", "grpc_port")])
def test_a_taken_port_stops_the_core_with_one_line_naming_the_setting(flag: str, setting: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        other = "--grpc-port" if flag == "--http-port" else "--http-port"
        run = subprocess.run(
            [sys.executable, "-m", "elaswave.cli", "core", "--dev", flag, str(port), other, "0"],
            capture_output=True,
            text=True,
            timeout=45,
            env=_env(),
        )
    assert run.returncode == 1, run.stderr
    ours = [line for line in run.stderr.splitlines() if line.startswith("elaswave core: cannot listen")]
    assert len(ours) == 1, run.stderr
    assert f"127.0.0.1:{port} ({setting}: {flag} or $ELASWAVE_{setting.upper()})" in ours[0]
    assert "Traceback" not in run.stderr and "Event loop is closed" not in run.stderr
