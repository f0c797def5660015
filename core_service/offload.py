"""Heavy planning off the Core's event loop, in a child process that can be stopped.

A scale table or a what-if plan can take seconds of CPU. Run on the event loop it would freeze
every stream and the leader's own liveness; run in a thread it could not be stopped when the
client gives up (Python threads cannot be cancelled) and would still hold the GIL. So such calls
go to one child process (spawned on first use), one call at a time, each with a deadline: the
client's gRPC deadline capped by `MAX_PLANNING_S`. When the deadline passes or the caller is
cancelled (the client went away), the child is killed, so the work stops, and the next call
spawns a fresh one.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import multiprocessing.connection
import time
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from typing import Any, TypeVar

log = logging.getLogger("elaswave.core.offload")

T = TypeVar("T")
# The longest any one planning call may run, whatever deadline the client asked for.
MAX_PLANNING_S = 30.0
KILL_WAIT_S = 2.0


class PlanningTimeout(TimeoutError):
    """The call did not finish within its deadline; its work was stopped."""


class PlanningFailed(Exception):
    """The planning function raised; `kind` is the exception's class name, `code` the name of
    the gRPC status it carried (core_service.grpc_util.RpcError), if any."""

    def __init__(self, kind: str, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.code = code


def _serve(conn: multiprocessing.connection.Connection) -> None:
    """The child: run each (function, args) received and send back its result or its error."""
    while True:
        try:
            fn, args = conn.recv()
        except (EOFError, OSError):
            return
        try:
            conn.send(("ok", fn(*args)))
        except Exception as exc:  # the parent maps the error to a status; never crash the child
            code = getattr(getattr(exc, "code", None), "name", None)  # a gRPC status, if it has one
            conn.send(("error", type(exc).__name__, str(exc), code))


class PlanningWorker:
    """One child process running planner calls, killed when a call overruns or is abandoned."""

    def __init__(
        self, max_seconds: float = MAX_PLANNING_S, on_stop: Callable[[], None] | None = None
    ) -> None:
        """`on_stop`: called each time a call's work is stopped (the child killed)."""
        self.max_seconds = max_seconds
        self._on_stop = on_stop
        self._lock = asyncio.Lock()
        self._process: BaseProcess | None = None
        self._conn: multiprocessing.connection.Connection | None = None
        self.kills = 0  # calls stopped by killing the child

    async def call(self, fn: Callable[..., T], *args: Any, timeout_s: float | None = None) -> T:
        """`fn(*args)` in the child; `fn` must be importable and its args picklable. Raises
        PlanningTimeout after min(timeout_s, max_seconds) (queueing behind another call counts),
        PlanningFailed when `fn` raised."""
        budget = self.max_seconds if timeout_s is None else max(0.0, min(timeout_s, self.max_seconds))
        deadline = time.monotonic() + budget
        try:
            async with asyncio.timeout(budget):
                async with self._lock:
                    return await self._run(fn, args, deadline)
        except TimeoutError:
            raise PlanningTimeout(f"planning did not finish within {budget:.1f} s and was stopped") from None

    async def _run(self, fn: Callable[..., T], args: tuple[Any, ...], deadline: float) -> T:
        conn = self._ensure_child()
        try:
            conn.send((fn, args))
            reply = await asyncio.to_thread(_receive, conn, deadline)
        except BaseException:
            # Timed out, cancelled (the client went away) or the pipe broke: stop the work now.
            self._kill(stopping_work=True)
            raise
        if reply[0] == "ok":
            return reply[1]
        raise PlanningFailed(reply[1], reply[2], reply[3])

    def _ensure_child(self) -> multiprocessing.connection.Connection:
        if self._process is not None and self._process.is_alive() and self._conn is not None:
            return self._conn
        self._kill()
        context = multiprocessing.get_context("spawn")  # never fork a process running gRPC threads
        parent, child = context.Pipe()
        process = context.Process(target=_serve, args=(child,), name="elaswave-planning", daemon=True)
        process.start()
        child.close()
        self._process, self._conn = process, parent
        return parent

    def _kill(self, stopping_work: bool = False) -> None:
        process, conn = self._process, self._conn
        self._process = self._conn = None
        if conn is not None:
            conn.close()
        if process is not None and process.is_alive():
            process.kill()
            process.join(KILL_WAIT_S)
            if stopping_work:
                self.kills += 1
                if self._on_stop is not None:
                    self._on_stop()
                log.warning("planning process %s stopped: its call overran or was abandoned", process.pid)

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def close(self) -> None:
        self._kill()


def _receive(conn: multiprocessing.connection.Connection, deadline: float) -> tuple[Any, ...]:
    """Waits (in a worker thread) for the child's reply; TimeoutError at `deadline`."""
    left = deadline - time.monotonic()
    if left <= 0 or not conn.poll(left):
        raise TimeoutError("planning deadline passed")
    return conn.recv()
