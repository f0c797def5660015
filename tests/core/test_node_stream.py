"""ConnectNode: a node multiplexer's one stream carries many agents' Connect streams, each under
Connect's rules (docs/control-plane.md, "Fan-in").

Against a real Core: every channel is checked with its own credentials (a wrong job token ends
only that channel; a live worker's id on a second channel without its worker token is refused,
not a takeover); echoes come back on the right channel; a channel that ends without a Leave is
a fail-stop for its worker, a Leave is a clean departure, and the stream's end is a fail-stop
for every channel still open. The same through the multiplexer (agent/node_mux.py) with a plain
Connect client.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import grpc
import grpc.aio
import pytest

from agent.config import parse_address
from agent.node_link import ChannelEnded, NodeChannel, NodeLink
from agent.node_mux import NodeMux
from tests.core.procs import CoreProcess, create_job, new_token, wait_until
from wire.v1 import agent_pb2, agent_pb2_grpc

pytestmark = pytest.mark.multiproc


@pytest.fixture
def core(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[CoreProcess, str]]:
    token = new_token()
    proc = CoreProcess(tmp_path_factory.mktemp("node"), "node", "memory://", token)
    proc.wait_leader()
    yield proc, create_job(proc, token, "train")
    proc.stop()


def register(worker_id: str) -> agent_pb2.Register:
    return agent_pb2.Register(
        job="train", worker_id=worker_id, host="node-a", rank=-1, heartbeat_interval_ms=200
    )


async def beat(channels: list[NodeChannel]) -> None:
    """Heartbeats every 200 ms on each channel still open, as agents do (their liveness leases
    are refreshed on heartbeats)."""
    while True:
        for channel in channels:
            channel.write(agent_pb2.ConnectRequest(heartbeat=agent_pb2.Heartbeat(seq=1)))
        await asyncio.sleep(0.2)


async def ended(channel: NodeChannel) -> ChannelEnded:
    with pytest.raises(ChannelEnded) as info:
        while True:
            await asyncio.wait_for(channel.read(), 5)
    return info.value


@pytest.mark.timeout(60)
def test_each_channel_is_one_agent_stream_with_its_own_credentials(core: tuple[CoreProcess, str]) -> None:
    proc, job_token = core

    async def scenario() -> None:
        async with grpc.aio.insecure_channel(proc.grpc_address) as conn:
            link = NodeLink(conn, linger_s=0.005)
            w0, w1 = link.open(register("w0"), job_token), link.open(register("w1"), job_token)
            forged = link.open(register("w9"), "not-the-job-token")
            acks = [(await asyncio.wait_for(c.read(), 5)).ack for c in (w0, w1)]
            beating = asyncio.ensure_future(beat([w0, w1]))
            assert (
                all(len(a.worker_token) >= 24 for a in acks) and acks[0].worker_token != acks[1].worker_token
            )
            assert (await ended(forged)).code == grpc.StatusCode.PERMISSION_DENIED
            # w0's id from another channel, without w0's own credential: refused, w0 untouched.
            taker = link.open(register("w0"), job_token)
            assert (await ended(taker)).code == grpc.StatusCode.ALREADY_EXISTS

            w1.write(agent_pb2.ConnectRequest(heartbeat=agent_pb2.Heartbeat(seq=7, echo=True)))
            assert (await asyncio.wait_for(w1.read(), 5)).echo.seq == 7
            w1.write(agent_pb2.ConnectRequest())  # no body: refused on its own, the channel goes on
            assert (await asyncio.wait_for(w1.read(), 5)).rejected.report == "empty"
            assert proc.states("train") == {"w0": "JOINING", "w1": "JOINING"}

            w1.end()  # w1's agent vanished: its worker is lost, w0 is not
            await asyncio.to_thread(wait_until, lambda: proc.states("train")["w1"] == "LOST", 5, "w1 lost")
            lost = [
                e
                for e in proc.http.get("/api/v1/jobs/train/events").json()["events"]
                if e["kind"] == "worker_lost"
            ]
            assert [(e["worker_id"], e["detail"]) for e in lost] == [
                ("w1", "agent stream closed without leave")
            ]

            w0.write(agent_pb2.ConnectRequest(leave=agent_pb2.Leave(reason="done")))
            assert (await ended(w0)).code == grpc.StatusCode.OK
            assert proc.states("train") == {"w0": "LEFT", "w1": "LOST"}

            # w1 rejoins (a fresh credential: the old one ended with the member), then the node's
            # stream ends: every channel still open on it is lost.
            again = link.open(register("w1"), job_token)
            assert (await asyncio.wait_for(again.read(), 5)).ack.worker_token not in (
                "",
                acks[1].worker_token,
            )
            beating.cancel()
            await link.close()
            await asyncio.to_thread(
                wait_until, lambda: proc.states("train")["w1"] == "LOST", 5, "w1 lost with the stream"
            )

    asyncio.run(scenario())


@pytest.mark.timeout(60)
def test_agents_reach_the_core_through_the_node_multiplexer(core: tuple[CoreProcess, str]) -> None:
    proc, job_token = core

    async def scenario() -> None:
        mux = NodeMux([parse_address(proc.grpc_address, "core")], linger_s=0.005)
        server = grpc.aio.server()
        agent_pb2_grpc.add_AgentServiceServicer_to_server(mux, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as conn:
                auth = [("authorization", f"Bearer {job_token}")]
                stubs = [agent_pb2_grpc.AgentServiceStub(conn) for _ in range(2)]
                calls = [s.Connect(metadata=auth) for s in stubs]
                for worker_id, call in zip(("m0", "m1"), calls, strict=True):
                    await call.write(agent_pb2.ConnectRequest(register=register(worker_id)))
                    assert (await asyncio.wait_for(call.read(), 5)).ack.worker_token
                await calls[0].write(
                    agent_pb2.ConnectRequest(heartbeat=agent_pb2.Heartbeat(seq=1, echo=True))
                )
                assert (await asyncio.wait_for(calls[0].read(), 5)).echo.seq == 1
                calls[1].cancel()  # an agent that vanishes without a Leave
                await asyncio.to_thread(
                    wait_until, lambda: proc.states("train").get("m1") == "LOST", 5, "m1 lost"
                )
                assert proc.states("train")["m0"] == "JOINING"
                bad = stubs[0].Connect(metadata=[("authorization", "Bearer wrong")])
                await bad.write(agent_pb2.ConnectRequest(register=register("m2")))
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await asyncio.wait_for(bad.read(), 5)
                assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
                calls[0].cancel()
        finally:
            await server.stop(None)
            await mux.close()

    asyncio.run(scenario())
