"""Plan acknowledgements off the training thread (issue 23, items 3 and the MTTR goal).

A worker acknowledges every plan phase to the Core (RECEIVED, PAUSED, APPLIED, RESUMED, FAILED;
`executor.plan_client.PlanClient.ack`): each is one gRPC round trip, bounded by the client's RPC
timeout. No worker waits on the Core between phases (the phases are reports: what the Core
shows and how it decides the job is RUNNING again), yet each ack ran on the training thread,
so a recovery paid two round trips before its apply began and the first step after it paid the
RESUMED one (14-31 ms each on a loaded 2-core machine, measured with `executor.step_phases`).

`BackgroundAcks` wraps the client: `ack` queues the acknowledgement and returns at once; one
thread sends them in order (a worker's phases reach the Core in the order it went through
them), and `close` sends what is queued (bounded) before it closes the client, so a worker that
leaves right after its PAUSED still says so. Everything else is the client's own.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

_CLOSE = object()


class BackgroundAcks:
    """A `PlanClient` whose `ack` is sent by a helper thread, in order (module docstring)."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.sent: list[tuple[int, str, bool]] = []  # (epoch, phase, taken by the Core), in order
        self._queue: queue.Queue[Any] = queue.Queue()
        self._thread = threading.Thread(target=self._send_all, name="elaswave-acks", daemon=True)
        self._thread.start()

    def __getattr__(self, name: str) -> Any:
        # Only reached for what this wrapper does not define: the client's own methods.
        return getattr(self.client, name)

    def ack(self, epoch: int, phase: str, seconds: float, **kwargs: Any) -> bool:
        """Queue the acknowledgement (the client's arguments); True: it is queued, never blocks."""
        self._queue.put((epoch, phase, seconds, kwargs))
        return True

    def flush(self, timeout_s: float) -> bool:
        """Wait (at most `timeout_s`) until every queued acknowledgement was sent; True if so."""
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks:
            if time.monotonic() > deadline or not self._thread.is_alive():
                return False
            time.sleep(0.005)
        return True

    def close(self) -> None:
        """Send what is queued (at most one RPC timeout per acknowledgement), then close the client."""
        self._queue.put(_CLOSE)
        self._thread.join(self.client.rpc_timeout_s * (self._queue.qsize() + 1))
        self.client.close()

    def _send_all(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is _CLOSE:
                    return
                epoch, phase, seconds, kwargs = item
                # The client bounds each call and never raises on a transport error.
                self.sent.append((epoch, phase, self.client.ack(epoch, phase, seconds, **kwargs)))
            finally:
                self._queue.task_done()
