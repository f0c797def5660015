"""Ordered, non-blocking registry writes for the asyncio Core."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from core_service.registry import MemoryRegistry, Registry, RegistryError

log = logging.getLogger("elaswave.core.persist")
T = TypeVar("T")


async def registry_call(registry: Registry, fn: Callable[..., T], *args: Any) -> T:
    """Runs a registry call off the event loop when it does network I/O (etcd); an in-memory
    registry answers in microseconds, and a thread hop per call would cost more than the call."""
    if isinstance(registry, MemoryRegistry):
        return fn(*args)
    return await asyncio.to_thread(fn, *args)


@dataclass(frozen=True)
class _Write:
    key: str
    value: bytes | None  # None = delete


class Persister:
    """Queues writes in call order and applies them on a worker thread, one at a time.

    Writes are retried with backoff while the backend is unavailable, so nothing queued is lost
    while the Core lives; `flush()` waits until everything queued so far is written.
    """

    def __init__(self, registry: Registry, retry_max_s: float = 2.0) -> None:
        self.registry = registry
        self.retry_max_s = retry_max_s
        self._queue: asyncio.Queue[_Write | None] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self.enabled = True

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._drain(), name="persister")

    def put(self, key: str, value: bytes) -> None:
        if self.enabled:
            self._queue.put_nowait(_Write(key, value))

    def delete(self, key: str) -> None:
        if self.enabled:
            self._queue.put_nowait(_Write(key, None))

    async def flush(self) -> None:
        await self._queue.join()

    async def stop(self) -> None:
        if self._task is None:
            return
        await self.flush()
        self._queue.put_nowait(None)
        await self._task
        self._task = None

    async def _drain(self) -> None:
        while True:
            write = await self._queue.get()
            try:
                if write is None:
                    return
                await self._apply_with_retry(write)
            finally:
                self._queue.task_done()

    async def _apply_with_retry(self, write: _Write) -> None:
        delay = 0.05
        while True:
            try:
                if write.value is None:
                    await registry_call(self.registry, self.registry.delete, write.key)
                else:
                    await registry_call(self.registry, self.registry.put, write.key, write.value)
                return
            except RegistryError as exc:
                log.warning("registry write of %s failed (%s); retrying in %.2fs", write.key, exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.retry_max_s)
