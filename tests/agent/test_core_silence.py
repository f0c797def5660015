"""When an agent gives up on a Core that answers nothing: only when an echo it asked for went
unanswered, however long its own command handlers take (agent/core_link.py).

The defect: the link's reader ran each Core command's handler before reading on, so a handler
that took longer than the silence bound (probes on a loaded host) hid the Core's echo answers,
and the agent dropped a stream to a Core that was answering. The Core then read the closed
stream as the worker's failure (CI: a worker marked LOST 4.5 s into a healthy job). Here a real
gRPC Core stand-in answers every echo at once, and one command's handler takes 5 s."""

from __future__ import annotations

import asyncio
import threading

import pytest

from agent.config import AgentConfig, parse_address
from agent.core_link import CommandHandlers, CoreLink
from tests.agent.harness import RecordingCore
from wire.v1 import agent_pb2

pytestmark = pytest.mark.timeout(60)

HANDLER_S = 5.0  # past the 3 s silence bound


def _answer_echoes(core: RecordingCore, stop: threading.Event) -> None:
    answered = 0
    while not stop.wait(0.02):
        asked = [r for r in core.of_kind("heartbeat") if r.request.heartbeat.echo]
        for received in asked[answered:]:
            core.send_command(
                agent_pb2.ConnectResponse(echo=agent_pb2.HeartbeatEcho(seq=received.request.heartbeat.seq))
            )
        answered = len(asked)


def test_a_slow_command_handler_does_not_make_an_answering_core_look_silent() -> None:
    core = RecordingCore().start()
    stop = threading.Event()
    answering = threading.Thread(target=_answer_echoes, args=(core, stop), daemon=True)
    handled: list[float] = []
    try:
        # A second Core in the list: the agent would move on after the 3 s bound.
        config = AgentConfig(
            job="train",
            worker_id="w0",
            cores=(parse_address(core.address, "--core"), parse_address("127.0.0.1:1", "--core")),
            heartbeat_interval_s=0.25,
            worker_pid=1,  # the link itself never looks at the worker
        )

        async def slow_report_now() -> None:
            await asyncio.sleep(HANDLER_S)
            handled.append(HANDLER_S)

        async def ignore(_: object) -> None:
            return None

        link = CoreLink(
            config,
            lambda: agent_pb2.Register(
                job="train", worker_id="w0", host="h", pid=1, heartbeat_interval_ms=250
            ),
            CommandHandlers(report_now=slow_report_now, drain=ignore, set_frequency=ignore),
        )

        async def scenario() -> None:
            running = asyncio.create_task(link.run())
            while link.sessions == 0:
                await asyncio.sleep(0.01)
            answering.start()
            core.send_command(agent_pb2.ConnectResponse(report_now=agent_pb2.ReportNow()))
            await asyncio.sleep(HANDLER_S + 2.0)
            assert await link.leave("done")
            await asyncio.wait_for(running, 10)

        asyncio.run(scenario())
        assert handled == [HANDLER_S]  # the handler ran to completion
        assert link.sessions == 1 and len(core.streams) == 1  # and the stream was never dropped
        assert any(
            r.request.heartbeat.echo for r in core.of_kind("heartbeat")
        )  # echoes were asked and answered
    finally:
        stop.set()
        core.close()
