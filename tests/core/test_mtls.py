"""gRPC with mutual TLS, configured through the Core's settings: a client with a certificate
signed by the configured CA gets in; one without a certificate does not."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.core.procs import CoreProcess, new_token
from wire.v1 import scheduler_pb2, scheduler_pb2_grpc

pytestmark = pytest.mark.multiproc


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=30)


def make_pki(tmp: Path) -> None:
    if shutil.which("openssl") is None:
        pytest.fail("openssl is needed to create test certificates (apt-get install openssl)")
    openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
        "-days",
        "2",
        "-subj",
        "/CN=elaswave-test-ca",
        cwd=tmp,
    )
    (tmp / "san.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name in ("core", "client"):
        openssl(
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            f"{name}.key",
            "-out",
            f"{name}.csr",
            "-subj",
            f"/CN=elaswave-{name}",
            cwd=tmp,
        )
        openssl(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            f"{name}.crt",
            "-days",
            "2",
            "-extfile",
            "san.cnf",
            cwd=tmp,
        )


@pytest.mark.timeout(60)
def test_mtls_admits_certified_clients_only(tmp_path: Path) -> None:
    make_pki(tmp_path)
    token = new_token()
    env = {
        "ELASWAVE_TLS_CERT": str(tmp_path / "core.crt"),
        "ELASWAVE_TLS_KEY": str(tmp_path / "core.key"),
        "ELASWAVE_TLS_CLIENT_CA": str(tmp_path / "ca.crt"),
    }
    core = CoreProcess(tmp_path, "tls", "memory://", token, extra_env=env)
    try:
        core.wait_leader()
        ca = (tmp_path / "ca.crt").read_bytes()
        good = grpc.ssl_channel_credentials(
            ca, (tmp_path / "client.key").read_bytes(), (tmp_path / "client.crt").read_bytes()
        )
        with grpc.secure_channel(core.grpc_address, good) as channel:
            status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert status.status == health_pb2.HealthCheckResponse.SERVING
            stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
            with pytest.raises(grpc.RpcError) as err:
                stub.GetJobState(
                    scheduler_pb2.GetJobStateRequest(job="none"),
                    metadata=[("authorization", f"Bearer {token}")],
                    timeout=5,
                )
            assert err.value.code() == grpc.StatusCode.NOT_FOUND  # authenticated, then the job is unknown
        no_cert = grpc.ssl_channel_credentials(ca)
        with grpc.secure_channel(core.grpc_address, no_cert) as channel, pytest.raises(grpc.RpcError) as err:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        with grpc.insecure_channel(core.grpc_address) as channel, pytest.raises(grpc.RpcError):
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    finally:
        core.stop()
