"""Transport and access policy: leader hints carry the advertised address, REST can be served
over HTTPS, and REST and gRPC reads follow one `read_access` policy.

The defects reproduced: with `--grpc-host 0.0.0.0` the leader hint agents follow was
`0.0.0.0:50051`; REST had no TLS option; gRPC GetJobState needed the scheduler token while the
same data was open over REST.
"""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from core_service.config import load_settings
from core_service.registry import MemoryRegistry
from tests.core.core_thread import CoreThread
from tests.core.test_mtls import make_pki
from wire.v1 import agent_pb2, agent_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

pytestmark = pytest.mark.multiproc

SCHEDULER_TOKEN = "scheduler-token-0123456789"
ADMIN = {"Authorization": f"Bearer {SCHEDULER_TOKEN}"}


def settings(core_id: str, **knobs: Any) -> Any:
    return load_settings(core_id=core_id, grpc_port=0, http_port=0, scheduler_token=SCHEDULER_TOKEN, **knobs)


@pytest.mark.timeout(60)
def test_standbys_point_at_the_advertised_address_never_a_wildcard() -> None:
    shared = MemoryRegistry()
    leader = CoreThread(settings("a", grpc_host="0.0.0.0", advertise="core-a.example:7000"), registry=shared)
    standby = CoreThread(settings("b", grpc_host="0.0.0.0"), registry=shared)
    try:
        assert leader.run(leader.core.wait_leader(10), 15)
        with grpc.insecure_channel(standby.grpc_address) as channel:
            call = agent_pb2_grpc.AgentServiceStub(channel).Connect(
                iter(
                    [agent_pb2.ConnectRequest(register=agent_pb2.Register(job="j", worker_id="w", host="h"))]
                ),
                timeout=5,
            )
            with pytest.raises(grpc.RpcError) as err:
                next(call)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert err.value.details() == "not leader; leader is core-a.example:7000"
        # Without --advertise, a wildcard bind address is replaced by this host's name.
        hint = standby.core.advertised_grpc()
        assert not hint.startswith("0.0.0.0") and hint.endswith(f":{standby.core.grpc_port}")
        with httpx.Client(base_url=standby.http_url, timeout=5) as http:
            # REST clients are told the leader's REST address (its advertised host, its HTTP port).
            assert http.get("/healthz").json()["leader"] == f"http://core-a.example:{leader.core.http_port}"
    finally:
        standby.stop()
        leader.stop()


@pytest.mark.timeout(60)
def test_rest_over_https(tmp_path: Path) -> None:
    make_pki(tmp_path)
    core = CoreThread(
        settings(
            "tls", dev_mode=True, http_tls_cert=tmp_path / "core.crt", http_tls_key=tmp_path / "core.key"
        )
    )
    try:
        url = f"https://127.0.0.1:{core.core.http_port}"
        trusted = ssl.create_default_context(cafile=str(tmp_path / "ca.crt"))
        with httpx.Client(base_url=url, verify=trusted, timeout=5) as https:
            assert https.get("/healthz").json()["status"] == "ok"
        plain_url = f"http://127.0.0.1:{core.core.http_port}"
        with httpx.Client(base_url=plain_url, timeout=5) as plain, pytest.raises(httpx.HTTPError):
            plain.get("/healthz")
        assert core.core.identity.count('"http": "https://') == 1
    finally:
        core.stop()


def read_both(core: CoreThread, headers: dict[str, str], metadata: list[tuple[str, str]]) -> tuple[int, Any]:
    with httpx.Client(base_url=core.http_url, timeout=5) as http:
        status = http.get("/api/v1/jobs/train", headers=headers).status_code
    with grpc.insecure_channel(core.grpc_address) as channel:
        try:
            scheduler_pb2_grpc.SchedulerServiceStub(channel).GetJobState(
                scheduler_pb2.GetJobStateRequest(job="train"), metadata=metadata, timeout=5
            )
            code = grpc.StatusCode.OK
        except grpc.RpcError as err:
            code = err.code()
    return status, code


@pytest.mark.timeout(60)
@pytest.mark.parametrize("read_access", ["open", "token"])
def test_rest_and_grpc_reads_follow_one_policy(read_access: str) -> None:
    core = CoreThread(settings(f"reads-{read_access}", read_access=read_access))
    try:
        assert core.run(core.core.wait_leader(10), 15)
        with httpx.Client(base_url=core.http_url, timeout=5) as http:
            assert http.post("/api/v1/jobs", json={"name": "train"}, headers=ADMIN).status_code == 201
        token = [("authorization", f"Bearer {SCHEDULER_TOKEN}")]
        assert read_both(core, ADMIN, token) == (200, grpc.StatusCode.OK)
        anonymous = read_both(core, {}, [])
        if read_access == "open":
            assert anonymous == (200, grpc.StatusCode.OK)
        else:
            assert anonymous == (401, grpc.StatusCode.UNAUTHENTICATED)
            wrong = read_both(core, {"Authorization": "Bearer wrong"}, [("authorization", "Bearer wrong")])
            assert wrong == (403, grpc.StatusCode.PERMISSION_DENIED)
    finally:
        core.stop()
