"""The upstream side of a node multiplexer: one ``AgentService.ConnectNode`` stream to the Core
that carries many agents' Connect streams as numbered channels (core_service/node_stream.py).

``NodeLink.open`` starts a channel with the agent's Register and its own credentials; the
returned ``NodeChannel`` reads and writes like a Connect call. Frames written by any channel
within ``linger_s`` of each other leave as one gRPC message, which is what makes one Core able to
watch 10,000 agents (docs/control-plane.md, "Fan-in"). When the stream fails, every open channel
ends with the stream's status, as every agent's own stream would have.
"""

from __future__ import annotations

import asyncio
import itertools

import grpc
import grpc.aio

from wire.v1 import agent_pb2, agent_pb2_grpc

# The Core refuses more per message (core_service.node_stream.MAX_FRAMES_PER_MESSAGE).
MAX_FRAMES_PER_MESSAGE = 4_096
DEFAULT_LINGER_S = 0.01


class ChannelEnded(Exception):
    """The channel ended: the Core's status for it (OK after a Leave), or the stream's failure."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code, self.details = code, details


_CODES = {code.value[0]: code for code in grpc.StatusCode}


class NodeChannel:
    """One agent's stream inside a NodeLink."""

    def __init__(self, link: NodeLink, number: int) -> None:
        self.link, self.number = link, number
        self.ended: ChannelEnded | None = None
        self._replies: asyncio.Queue[agent_pb2.ConnectResponse | ChannelEnded] = asyncio.Queue()

    def write(self, request: agent_pb2.ConnectRequest) -> None:
        if self.ended is None:
            self.link._queue(agent_pb2.NodeFrame(channel=self.number, request=request))

    async def read(self) -> agent_pb2.ConnectResponse:
        """The Core's next message to this agent; raises ChannelEnded once the channel is over."""
        item = await self._replies.get()
        if isinstance(item, ChannelEnded):
            self._replies.put_nowait(item)  # every later read sees the end too
            raise item
        return item

    def end(self) -> None:
        """The agent's stream ended; without a Leave before it the Core marks the worker lost."""
        if self.ended is None:
            self._finish(ChannelEnded(grpc.StatusCode.CANCELLED, "ended by the agent"))
            self.link._queue(agent_pb2.NodeFrame(channel=self.number, end=True))

    def _finish(self, ended: ChannelEnded) -> None:
        if self.ended is None:
            self.ended = ended
            self.link.channels.pop(self.number, None)
            self._replies.put_nowait(ended)


class NodeLink:
    def __init__(
        self,
        channel: grpc.aio.Channel,
        linger_s: float = DEFAULT_LINGER_S,
        metadata: tuple[tuple[str, str], ...] = (),
    ) -> None:
        """`linger_s`: how long a frame may wait for others to share its message."""
        self.linger_s = linger_s
        self.channels: dict[int, NodeChannel] = {}
        self.failed: ChannelEnded | None = None
        self._numbers = itertools.count(1)
        self._frames: list[agent_pb2.NodeFrame] = []
        self._wakeup = asyncio.Event()
        self._call = agent_pb2_grpc.AgentServiceStub(channel).ConnectNode(metadata=metadata)
        self._tasks = [asyncio.ensure_future(self._write()), asyncio.ensure_future(self._read())]

    def open(
        self, register: agent_pb2.Register, job_token: str | None, worker_token: str | None = None
    ) -> NodeChannel:
        """A new channel whose first frame is `register` with the agent's own credentials."""
        channel = NodeChannel(self, next(self._numbers))
        if self.failed is not None:
            channel._finish(self.failed)
            return channel
        self.channels[channel.number] = channel
        self._queue(
            agent_pb2.NodeFrame(
                channel=channel.number,
                request=agent_pb2.ConnectRequest(register=register),
                authorization=f"Bearer {job_token}" if job_token else "",
                worker_token=worker_token or "",
            )
        )
        return channel

    async def close(self) -> None:
        """Ends the stream: every channel still open is a fail-stop signal for its worker."""
        self._fail(ChannelEnded(grpc.StatusCode.CANCELLED, "node link closed"))
        for task in self._tasks:
            task.cancel()
        self._call.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _queue(self, frame: agent_pb2.NodeFrame) -> None:
        self._frames.append(frame)
        self._wakeup.set()

    async def _write(self) -> None:
        try:
            while True:
                await self._wakeup.wait()
                if self.linger_s > 0:
                    await asyncio.sleep(self.linger_s)
                self._wakeup.clear()
                frames, self._frames = self._frames, []
                for i in range(0, len(frames), MAX_FRAMES_PER_MESSAGE):
                    await self._call.write(
                        agent_pb2.NodeRequest(frames=frames[i : i + MAX_FRAMES_PER_MESSAGE])
                    )
        except grpc.aio.AioRpcError as exc:
            self._fail(ChannelEnded(exc.code(), exc.details() or ""))
        except asyncio.InvalidStateError:  # written after the call ended: _read reports why
            pass

    async def _read(self) -> None:
        try:
            async for response in self._call:
                for reply in response.replies:
                    channel = self.channels.get(reply.channel)
                    if channel is None:
                        continue
                    if reply.end:
                        code = _CODES.get(reply.code, grpc.StatusCode.UNKNOWN)
                        channel._finish(ChannelEnded(code, reply.details))
                    else:
                        channel._replies.put_nowait(reply.response)
            self._fail(ChannelEnded(grpc.StatusCode.UNAVAILABLE, "the Core ended the node stream"))
        except grpc.aio.AioRpcError as exc:
            self._fail(ChannelEnded(exc.code(), exc.details() or ""))

    def _fail(self, ended: ChannelEnded) -> None:
        if self.failed is None:
            self.failed = ended
        for channel in list(self.channels.values()):
            channel._finish(ended)
