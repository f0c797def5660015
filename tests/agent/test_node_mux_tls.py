"""A node multiplexer reaches a Core that serves only mTLS (issue 24, item 5): with the CA bundle
and a client certificate its agents register through it; without them every agent's stream fails
with UNAVAILABLE, as a plaintext agent's own would (it reconnects with its backoff)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from agent.config import parse_address
from agent.node_mux import NodeMux
from tests.core.procs import CoreProcess, create_job, new_token
from tests.core.test_mtls import make_pki
from wire import core_tls
from wire.v1 import agent_pb2, agent_pb2_grpc

pytestmark = pytest.mark.multiproc


@pytest.fixture
def mtls_core(tmp_path: Path) -> Iterator[tuple[CoreProcess, str, Path]]:
    make_pki(tmp_path)
    token = new_token()
    env = {
        "ELASWAVE_TLS_CERT": str(tmp_path / "core.crt"),
        "ELASWAVE_TLS_KEY": str(tmp_path / "core.key"),
        "ELASWAVE_TLS_CLIENT_CA": str(tmp_path / "ca.crt"),
    }
    core = CoreProcess(tmp_path, "mux-tls", "memory://", token, extra_env=env)
    try:
        core.wait_leader()
        yield core, create_job(core, token, "train"), tmp_path
    finally:
        core.stop()


async def register_through(mux: NodeMux, job_token: str, worker_id: str) -> agent_pb2.ConnectResponse:
    server = grpc.aio.server()
    agent_pb2_grpc.add_AgentServiceServicer_to_server(mux, server)
    port = server.add_insecure_port("127.0.0.1:0")  # the agents on the node: loopback
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as conn:
            call = agent_pb2_grpc.AgentServiceStub(conn).Connect(
                metadata=[("authorization", f"Bearer {job_token}")]
            )
            register = agent_pb2.Register(
                job="train", worker_id=worker_id, host="n", rank=-1, heartbeat_interval_ms=200
            )
            await call.write(agent_pb2.ConnectRequest(register=register))
            try:
                return await asyncio.wait_for(call.read(), 10)
            finally:
                call.cancel()
    finally:
        await server.stop(None)
        await mux.close()


@pytest.mark.timeout(60)
def test_the_node_multiplexer_reaches_an_mtls_core_with_its_certificate_only(
    mtls_core: tuple[CoreProcess, str, Path],
) -> None:
    core, job_token, pki = mtls_core
    address = [parse_address(core.grpc_address, "core")]
    tls = core_tls.CoreTls(pki / "ca.crt", pki / "client.crt", pki / "client.key").check()
    answer = asyncio.run(register_through(NodeMux(address, 0.005, tls), job_token, "m0"))
    assert answer.ack.worker_token
    assert set(core.states("train")) == {"m0"}  # registered (then gone: the test hung up)

    with pytest.raises(grpc.aio.AioRpcError) as plain:
        asyncio.run(register_through(NodeMux(address, 0.005), job_token, "m1"))
    assert plain.value.code() == grpc.StatusCode.UNAVAILABLE
    no_cert = core_tls.CoreTls(pki / "ca.crt")
    with pytest.raises(grpc.aio.AioRpcError) as anonymous:
        asyncio.run(register_through(NodeMux(address, 0.005, no_cert), job_token, "m2"))
    assert anonymous.value.code() == grpc.StatusCode.UNAVAILABLE
    assert set(core.states("train")) == {"m0"}  # neither reached the Core


def test_incomplete_tls_settings_are_refused_with_what_is_missing(tmp_path: Path) -> None:
    ca = tmp_path / "ca.crt"
    ca.write_text("not checked here")
    with pytest.raises(core_tls.TlsConfigError, match="need \\$ELASWAVE_CORE_TLS_CA"):
        core_tls.from_env({core_tls.CERT_ENV: "c.pem", core_tls.KEY_ENV: "k.pem"})
    with pytest.raises(core_tls.TlsConfigError, match="go together"):
        core_tls.from_env({core_tls.CA_ENV: str(ca), core_tls.CERT_ENV: "c.pem"})
    with pytest.raises(core_tls.TlsConfigError, match="is not a readable file"):
        core_tls.from_env({core_tls.CA_ENV: str(tmp_path / "missing.crt")})
    assert core_tls.from_env({}) is None
    assert core_tls.from_env({core_tls.CA_ENV: str(ca)}) == core_tls.CoreTls(ca)
