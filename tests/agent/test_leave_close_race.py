"""A Core that closes the stream the moment it has stored a Leave (as the real Core does) may beat
the agent's writer back from its write. That close is the delivery, not a broken stream: the link
must not reconnect and register a departed worker again (the Core would log `worker_rejoined`, a
restart that never happened). Real gRPC, one agent link in this process."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from agent.config import AgentConfig, parse_address
from agent.core_link import CommandHandlers, CoreLink
from tests.agent.harness import RecordingCore
from wire.v1 import agent_pb2


class LateWriterLink(CoreLink):
    """The writer resumes 300 ms after its Leave went out: the Core's close arrives first."""

    async def _write(self, call: grpc.aio.StreamStreamCall, request: agent_pb2.ConnectRequest) -> None:
        await super()._write(call, request)
        if request.WhichOneof("body") == "leave":
            await asyncio.sleep(0.3)


async def _noop(*_: object) -> None:
    return None


@pytest.mark.timeout(30)
def test_a_close_that_beats_the_leave_write_back_is_a_delivery_not_a_reconnect() -> None:
    core = RecordingCore(close_on_leave=True).start()
    try:
        config = AgentConfig(
            job="demo",
            worker_id="w0",
            cores=(parse_address(core.address, "--core"),),
            worker_pid=1,
            leave_timeout_s=5.0,
        )
        handlers = CommandHandlers(report_now=_noop, drain=_noop, set_frequency=_noop)
        link = LateWriterLink(config, lambda: agent_pb2.Register(job="demo", worker_id="w0"), handlers)

        async def scenario() -> bool:
            runner = asyncio.create_task(link.run())
            while link.sessions < 1:
                await asyncio.sleep(0.01)
            delivered = await link.leave("worker exited")
            await asyncio.sleep(0.5)  # time for a wrong reconnect to register again
            await asyncio.wait_for(runner, 5.0)
            return delivered

        assert asyncio.run(scenario()) is True
        assert [r.kind for r in core.received if r.kind != "heartbeat"] == ["register", "leave"]
        assert len(core.streams) == 1
    finally:
        core.close()
