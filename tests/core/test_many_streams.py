"""Bursts of agent streams: every stream registers and every one that vanishes is declared lost.

Two shapes: hundreds of agents multiplexed over one connection (behind a proxy or a gateway), and
a burst of thousands of connections at once (every agent of a job reconnecting after a leader
failover). Regression for the second: grpc's default hard limit of 3,000 calls not yet picked up
by the server rejected the rest with INTERNAL, which failed most of a 10,000-agent burst."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from tests.core.procs import CoreProcess, create_job, new_token, wait_until
from wire.v1 import agent_pb2, agent_pb2_grpc

pytestmark = pytest.mark.multiproc


async def _requests(worker_id: str, stop: asyncio.Event) -> AsyncIterator[agent_pb2.ConnectRequest]:
    yield agent_pb2.ConnectRequest(
        register=agent_pb2.Register(job="fan", worker_id=worker_id, host="gw", pid=1)
    )
    await stop.wait()


async def _burst(address: str, job_token: str, streams: int, connections: int, core: CoreProcess) -> int:
    """Opens every stream at once; returns how many were acknowledged. Cancels them all at the end."""
    options = [("grpc.use_local_subchannel_pool", 1)]  # one TCP connection per channel
    channels = [grpc.aio.insecure_channel(address, options=options) for _ in range(connections)]
    stop = asyncio.Event()
    stubs = [agent_pb2_grpc.AgentServiceStub(ch) for ch in channels]
    calls = [
        stubs[i % connections].Connect(
            _requests(f"s{i}", stop), metadata=[("authorization", f"Bearer {job_token}")]
        )
        for i in range(streams)
    ]
    try:
        firsts = await asyncio.wait_for(
            asyncio.gather(*(c.read() for c in calls), return_exceptions=True), 60
        )
        members = await asyncio.to_thread(core.states, "fan")
        assert len(members) == streams and "LOST" not in members.values()
        return sum(1 for f in firsts if isinstance(f, agent_pb2.ConnectResponse) and f.HasField("ack"))
    finally:
        stop.set()
        for c in calls:
            c.cancel()  # vanish without a Leave
        for ch in channels:
            await ch.close()


@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    "streams, connections", [(400, 1), (3500, 35)], ids=["400-on-one-connection", "3500-burst"]
)
def test_stream_bursts_register_and_are_declared_lost(tmp_path: Path, streams: int, connections: int) -> None:
    token = new_token()
    # Streams send no heartbeats here: long timeouts, so only a vanished stream makes a member LOST.
    # The job declares no size, so the Core's registration burst must cover the whole burst.
    core = CoreProcess(
        tmp_path,
        "fan",
        "memory://",
        token,
        extra_env={"ELASWAVE_REGISTRATION_BURST": str(streams)},
        extra_args=["--heartbeat-timeout", "120", "--lease-ttl", "120"],
    )
    try:
        core.wait_leader()
        job_token = create_job(core, token, "fan")
        assert asyncio.run(_burst(core.grpc_address, job_token, streams, connections, core)) == streams
        wait_until(lambda: set(core.states("fan").values()) == {"LOST"}, 60, "every vanished stream LOST")
    finally:
        core.stop()
