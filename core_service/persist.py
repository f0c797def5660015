"""Ordered, non-blocking registry writes for the asyncio Core, one writer task per leadership term.

Writes are queued in call order and applied one at a time off the event loop. Every write gets a
sequence number, so a mutating API call can wait until everything it queued is stored
(`wait_durable`) before it answers: an acknowledged change survives a leader crash. A leader
that is deposed `abandon`s its queue: its successor owns the registry, and a late write from the
old term would overwrite newer state.

A term started with a `Fence` (the leader key holding this Core's election entry) makes every
write conditional on it in the write's own registry transaction, so a Core whose lease lapsed
before it noticed cannot overwrite its successor's records. A write refused that way (`FenceLost`)
ends the term at once: nothing queued after it is tried, waiters fail, and `on_fenced_out` tells
the owner, which must step down. It is never retried: the fence will not come back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from core_service.registry import Fence, FenceLost, MemoryRegistry, Registry, RegistryError

log = logging.getLogger("elaswave.core.persist")
T = TypeVar("T")


async def registry_call(registry: Registry, fn: Callable[..., T], *args: Any) -> T:
    """Runs a registry call off the event loop when it does network I/O (etcd); an in-memory
    registry answers in microseconds, and a thread hop per call would cost more than the call."""
    if isinstance(registry, MemoryRegistry):
        return fn(*args)
    return await asyncio.to_thread(fn, *args)


class NotDurable(RuntimeError):
    """Writes were not stored in the registry in time, or this Core stopped writing."""


@dataclass(frozen=True)
class _Write:
    seq: int
    key: str
    value: bytes | None  # None = delete


class Persister:
    """Queues writes in call order and applies them on a worker thread, one at a time.

    Writes are retried with backoff while the backend is unavailable, so nothing queued is lost
    while the term lasts. Writes are accepted only between `start()` and `stop()`/`abandon()` (or
    a fenced write refused): a standby has nothing to write. `on_fenced_out(term, reason)` is
    called on the event loop when a term ends because its fence was lost.
    """

    def __init__(
        self,
        registry: Registry,
        retry_max_s: float = 2.0,
        on_fenced_out: Callable[[int, str], None] | None = None,
    ) -> None:
        self.registry = registry
        self.retry_max_s = retry_max_s
        self.on_fenced_out = on_fenced_out
        self._queue: asyncio.Queue[_Write | None] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self._fence: Fence | None = None
        self._queued_seq = 0
        self._stored_seq = 0
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []
        self._last_error = ""
        self._stopped_reason = "this Core is not the leader"
        self.terms_started = 0

    @property
    def enabled(self) -> bool:
        """True while a term's writer task runs (writes are accepted)."""
        return self._task is not None and not self._task.done()

    @property
    def fence(self) -> Fence | None:
        """The fence of the current (or last) term, for the term's writes that do not go
        through the queue (plans, liveness keys): they must be fenced alike."""
        return self._fence

    def lost_fence(self, exc: FenceLost) -> None:
        """Another write of this term was refused by the fence: the term ends exactly as if one
        of its queued writes had been (nothing more is written, `on_fenced_out` is told)."""
        if self.enabled:
            self._fenced_out(self.terms_started, f"leadership lost: {exc}")

    @property
    def backlog(self) -> int:
        """Writes queued but not stored yet."""
        return self._queued_seq - self._stored_seq

    def start(self, fence: Fence | None = None) -> None:
        """Begins a leadership term with an empty queue and exactly one writer task; with `fence`,
        every write of the term is stored only while the fence holds."""
        if self.enabled:
            raise RuntimeError("the persister is already running: one writer task per leadership term")
        self._fence = fence
        self._queue = asyncio.Queue()
        self._queued_seq = self._stored_seq = 0
        self._last_error = ""
        self._task = asyncio.get_running_loop().create_task(self._drain(), name="persister")
        self.terms_started += 1

    def put(self, key: str, value: bytes) -> None:
        self._enqueue(key, value)

    def delete(self, key: str) -> None:
        self._enqueue(key, None)

    def _enqueue(self, key: str, value: bytes | None) -> None:
        # Counted even when dropped (no term, or the term was fenced out): a caller's wait_durable
        # must then fail instead of acknowledging a change that was never stored.
        self._queued_seq += 1
        if self.enabled:
            self._queue.put_nowait(_Write(self._queued_seq, key, value))

    async def flush(self) -> None:
        await self._queue.join()

    async def wait_durable(self, timeout_s: float) -> None:
        """Returns once every write queued before this call is stored; raises `NotDurable`
        with the reason when that does not happen within `timeout_s` or the term ends first."""
        target = self._queued_seq
        if self._stored_seq >= target:
            return
        if not self.enabled:
            raise NotDurable(f"{target - self._stored_seq} write(s) were dropped: {self._stopped_reason}")
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((target, future))
        try:
            await asyncio.wait_for(asyncio.shield(future), timeout_s)
        except TimeoutError:
            why = (
                f"last registry error: {self._last_error}"
                if self._last_error
                else f"{self.backlog} write(s) queued"
            )
            raise NotDurable(f"registry writes not stored within {timeout_s:g}s ({why})") from None
        finally:
            with contextlib.suppress(ValueError):
                self._waiters.remove((target, future))

    async def stop(self, timeout_s: float | None = None) -> None:
        """Ends the term after storing what is queued (at most `timeout_s`, then abandons)."""
        if self._task is None:
            return
        try:
            await asyncio.wait_for(self.flush(), timeout_s)
        except TimeoutError:
            log.warning("%d registry write(s) not stored within %.1fs at stop", self.backlog, timeout_s)
        await self.abandon("this Core stopped leading")

    async def abandon(self, reason: str) -> None:
        """Ends the term now: queued writes are dropped and waiters fail with `reason`.

        A write already handed to the registry thread still completes (fenced: only if this Core
        still holds the fence then); nothing after it starts.
        """
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._end_term(reason)

    def _end_term(self, reason: str) -> None:
        """Drops what is queued and fails every waiter with `reason` (the writer task is gone)."""
        self._stopped_reason = reason
        dropped = self.backlog
        if dropped:
            log.warning("dropping %d queued registry write(s): %s", dropped, reason)
        while not self._queue.empty():
            self._queue.get_nowait()
            self._queue.task_done()
        for _, future in self._waiters:
            if not future.done():
                future.set_exception(NotDurable(f"write(s) dropped: {reason}"))
        self._waiters.clear()
        self._queued_seq = self._stored_seq

    async def _drain(self) -> None:
        term = self.terms_started
        while True:
            write = await self._queue.get()
            try:
                if write is None:
                    return
                await self._apply_with_retry(write)
                self._stored(write.seq)
            except FenceLost as exc:
                # Leadership is gone: this write and everything after it must never land.
                self._last_error = str(exc)
                self._fenced_out(term, f"leadership lost: {exc}")
                return
            finally:
                self._queue.task_done()

    def _fenced_out(self, term: int, reason: str) -> None:
        log.error("registry writer of term %d stops: %s", term, reason)
        task, self._task = self._task, None  # accepts no more writes from here on
        if task is not None and task is not asyncio.current_task():
            task.cancel()  # its write in flight, if any, is fenced and refused as well
        self._end_term(reason)
        if self.on_fenced_out is not None:
            self.on_fenced_out(term, reason)

    def _stored(self, seq: int) -> None:
        self._stored_seq = seq
        self._last_error = ""
        for target, future in self._waiters:
            if target <= seq and not future.done():
                future.set_result(None)

    async def _apply_with_retry(self, write: _Write) -> None:
        delay = 0.05
        while True:
            try:
                await self._apply(write)
                return
            except FenceLost:
                raise  # refused, not failed: retrying cannot bring the leadership back
            except RegistryError as exc:
                self._last_error = f"{write.key}: {exc}"
                log.warning("registry write of %s failed (%s); retrying in %.2fs", write.key, exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.retry_max_s)

    async def _apply(self, write: _Write) -> None:
        fence, registry = self._fence, self.registry
        if fence is None:
            if write.value is None:
                await registry_call(registry, registry.delete, write.key)
            else:
                await registry_call(registry, registry.put, write.key, write.value)
        elif write.value is None:
            await registry_call(registry, registry.delete_fenced, fence, write.key)
        else:
            await registry_call(registry, registry.put_fenced, fence, write.key, write.value)
