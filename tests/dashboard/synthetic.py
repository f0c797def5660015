"""A synthetic job of many members: real agent streams (AgentService.Connect) opened from one
process, each registering its rank and reporting memory and a step, then holding the stream.
Cheaper than a thousand agent processes, and the Core cannot tell the difference."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator

import grpc

from wire.v1 import agent_pb2, agent_pb2_grpc

CONNECTIONS = 10


class SyntheticMembers:
    """`count` members of `job`, rank r on stage r // dp; runs on its own event-loop thread."""

    def __init__(self, address: str, job: str, job_token: str, count: int, dp: int) -> None:
        self.address, self.job, self.token, self.count, self.dp = address, job, job_token, count, dp
        self.acked = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self, timeout_s: float = 60.0) -> None:
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise AssertionError(f"only {self.acked} of {self.count} streams acknowledged in {timeout_s}s")
        if self._error is not None:
            raise AssertionError(f"synthetic members failed: {self._error!r}")

    def stop(self) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(timeout=20)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._stop = asyncio.Event()
        try:
            self._loop.run_until_complete(self._main())
        except BaseException as exc:  # reported to the test thread
            self._error = exc
            self._ready.set()
        finally:
            self._loop.close()

    async def _requests(self, rank: int) -> AsyncIterator[agent_pb2.ConnectRequest]:
        stage, dp_rank = divmod(rank, self.dp)
        yield agent_pb2.ConnectRequest(
            register=agent_pb2.Register(
                job=self.job,
                worker_id=f"m{rank:04d}",
                host=f"node{rank // 8:03d}",
                pid=1000 + rank,
                stage=stage,
                dp_rank=dp_rank,
                rank=rank,
                heartbeat_interval_ms=1000,
            )
        )
        yield agent_pb2.ConnectRequest(
            memory=agent_pb2.MemoryUsage(
                host_used_bytes=8 << 30,
                host_total_bytes=64 << 30,
                worker_rss_bytes=(2 << 30) + rank,
                device_used_bytes=[(20 << 30) + rank * (1 << 20)],
                device_total_bytes=[80 << 30],
                cpu_percent=50.0,
            )
        )
        yield agent_pb2.ConnectRequest(
            step=agent_pb2.StepMetrics(
                step=10,
                step_time_s=0.5,
                compute_time_s=0.4,
                loss=2.5,
                samples=4,
                stage=stage,
                dp_rank=dp_rank,
            )
        )
        await self._stop.wait()

    async def _main(self) -> None:
        channels = [
            grpc.aio.insecure_channel(self.address, options=[("grpc.use_local_subchannel_pool", 1)])
            for _ in range(CONNECTIONS)
        ]
        stubs = [agent_pb2_grpc.AgentServiceStub(ch) for ch in channels]
        metadata = [("authorization", f"Bearer {self.token}")]
        calls = [
            stubs[r % CONNECTIONS].Connect(self._requests(r), metadata=metadata) for r in range(self.count)
        ]
        try:
            firsts = await asyncio.gather(*(c.read() for c in calls))
            self.acked = sum(
                1 for f in firsts if isinstance(f, agent_pb2.ConnectResponse) and f.HasField("ack")
            )
            if self.acked != self.count:
                raise AssertionError(f"{self.acked} of {self.count} streams acknowledged")
            self._ready.set()
            await self._stop.wait()
        finally:
            for c in calls:
                c.cancel()
            for ch in channels:
                await ch.close()
