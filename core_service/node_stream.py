"""AgentService.ConnectNode: the Connect streams of a node's agents, carried over one stream.

Why: one Python event loop pays gRPC's per-message work (completion-queue events, futures, task
wake-ups: about 100 us) for every report on its own stream, so 10,000 agents at 1 Hz saturate a
core before the reports themselves cost anything. A node multiplexer (agent/node_mux.py) packs
the messages of all its agents into one gRPC message per flush, and the Core handles each frame
with a plain function call.

Each channel keeps Connect's semantics exactly: its first frame is a Register checked with that
agent's own credentials (`AgentServicer.accept`, as for Connect's metadata); reports go through
the same `dispatch` (validation, refusals, counters); commands for the worker come back as
replies on its channel; a channel that ends without a Leave, or is still open when the stream
ends, is a fail-stop signal for its worker ("agent stream closed without leave").
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import grpc

from core_service.grpc_util import Malformed, RpcError, invalid
from core_service.seams import ServicerCore
from wire.v1 import agent_pb2

if TYPE_CHECKING:
    from core_service.agent_session import AgentSession

# A node runs a few dozen workers; the bound keeps one stream from holding a job's worth of
# sessions, and keeps one gRPC message (4 MB at most) from carrying unbounded work.
MAX_NODE_CHANNELS = 1_024
MAX_FRAMES_PER_MESSAGE = 4_096
MAX_REPLIES_PER_MESSAGE = 1_024


class AgentEndpoint(Protocol):
    """What a node stream needs of the AgentService (core_service.agent_service.AgentServicer):
    one channel is handled exactly as one Connect stream."""

    core: ServicerCore

    async def accept(
        self, first: agent_pb2.ConnectRequest, job_token: str | None, worker_token: str | None
    ) -> tuple[AgentSession, agent_pb2.ConnectResponse]: ...

    async def dispatch(self, session: AgentSession, msg: object) -> bool:
        """Handle one message of an accepted session; True when the session ended (Leave)."""


@dataclass
class _Channel:
    session: AgentSession
    pump: asyncio.Task


def _bearer(authorization: str) -> str | None:
    return authorization[len("Bearer ") :].strip() if authorization.startswith("Bearer ") else None


class NodeStream:
    """Serves one ConnectNode call: frames in, one handler step each; replies out, batched."""

    def __init__(self, servicer: AgentEndpoint, context: grpc.aio.ServicerContext) -> None:
        self.servicer, self.core, self.context = servicer, servicer.core, context
        self.channels: dict[int, _Channel] = {}
        self.replies: asyncio.Queue[agent_pb2.NodeReply] = asyncio.Queue()

    async def serve(self) -> None:
        try:
            self.core.require_leader()
        except RpcError as err:
            self._count_refusal(err)
            await self.context.abort(err.code, err.message)
            return
        writer = asyncio.ensure_future(self._write_replies())
        try:
            while True:
                msg = await self.context.read()
                if msg is grpc.aio.EOF:
                    return
                if isinstance(msg, Malformed):
                    raise invalid(msg.message)
                if len(msg.frames) > MAX_FRAMES_PER_MESSAGE:
                    raise invalid(f"more than {MAX_FRAMES_PER_MESSAGE} frames in one NodeRequest")
                for frame in msg.frames:
                    await self._frame(frame)
        except RpcError as err:
            self._count_refusal(err)
            await self.context.abort(err.code, err.message)
        finally:
            writer.cancel()
            for channel in self.channels.values():
                channel.pump.cancel()
                self._close(channel.session)
            self.channels.clear()

    async def _frame(self, frame: agent_pb2.NodeFrame) -> None:
        number = frame.channel
        channel = self.channels.get(number)
        if frame.end:
            if channel is not None:
                self._drop(number, channel)
                self._close(channel.session)
            return
        if channel is None:
            await self._open(number, frame)
            return
        try:
            left = await self.servicer.dispatch(channel.session, frame.request)
        except RpcError as err:  # not a refusal of one report: the channel cannot go on
            self._count_refusal(err)
            self._drop(number, channel)
            self._end(number, err.code, err.message)
            self._close(channel.session)
            return
        if left:  # the Leave is stored and its session closed
            self._drop(number, channel)
            self._end(number, grpc.StatusCode.OK, "")

    async def _open(self, number: int, frame: agent_pb2.NodeFrame) -> None:
        try:
            if number == 0:
                raise invalid("channel 0 is not a channel number")
            if len(self.channels) >= MAX_NODE_CHANNELS:
                raise RpcError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"more than {MAX_NODE_CHANNELS} channels on one stream",
                )
            if not frame.HasField("request"):
                raise invalid(f"channel {number} is not open: its first frame must carry a register")
            self.core.require_leader()
            session, ack = await self.servicer.accept(
                frame.request, _bearer(frame.authorization), frame.worker_token or None
            )
        except RpcError as err:
            self._count_refusal(err)
            self._end(number, err.code, err.message)
            return
        session.handler = asyncio.current_task()  # kick_all ends the node's stream: agents reconnect
        self.replies.put_nowait(agent_pb2.NodeReply(channel=number, response=ack))
        self.channels[number] = _Channel(session, asyncio.ensure_future(self._pump(number, session)))

    def _drop(self, number: int, channel: _Channel) -> None:
        channel.pump.cancel()
        del self.channels[number]

    def _close(self, session: AgentSession) -> None:
        """The channel ended without a Leave: a fail-stop signal, as a Connect stream's end. A
        task of its own: it runs even when this handler is being cancelled (the node's stream
        vanished), and releasing the worker's lease does not hold up the node's other agents."""
        asyncio.ensure_future(self.core.membership.close_session(session, time.time(), clean=False))

    def _end(self, number: int, code: grpc.StatusCode, details: str) -> None:
        self.replies.put_nowait(
            agent_pb2.NodeReply(channel=number, end=True, code=code.value[0], details=details)
        )

    def _count_refusal(self, err: RpcError) -> None:
        self.core.metrics.rejected_requests.labels(api="agent", reason=err.code.name).inc()

    async def _pump(self, number: int, session: AgentSession) -> None:
        """Commands queued for one worker (membership.send) become replies on its channel."""
        while True:
            command = await session.outbox.get()
            self.replies.put_nowait(agent_pb2.NodeReply(channel=number, response=command))

    async def _write_replies(self) -> None:
        """Everything queued goes out as one message: acks of a registering node, echoes."""
        with contextlib.suppress(asyncio.CancelledError):
            while True:
                batch = [await self.replies.get()]
                while not self.replies.empty() and len(batch) < MAX_REPLIES_PER_MESSAGE:
                    batch.append(self.replies.get_nowait())
                await self.context.write(agent_pb2.NodeResponse(replies=batch))
