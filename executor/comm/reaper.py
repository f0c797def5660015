"""Process groups an edit dropped, destroyed on a thread of their own, off the recovery's path.

Destroying a gloo group closes every connection to its peers, each a round trip through the
backend's event loop: after one kill at PP=2 x DP=4 the groups a survivor dropped took it 59-85 ms
to destroy, inside `Communicator.apply_edit` and so inside every recovery, where nothing waits for
it (docs/benchmarks.md). c10d's Python bindings release the GIL while a backend is destroyed, so
the reaper's thread does not hold up the worker's Python either.

Blocking behaviour: `retire` never blocks (an unbounded queue); `drain` blocks until everything
retired so far is destroyed, at most `timeout_s` (tests, shutdown).
"""

from __future__ import annotations

import queue
import threading
from typing import Any


class GroupReaper:
    """One daemon thread that drops the last reference to each object handed to it."""

    def __init__(self, name: str = "elaswave-group-reaper") -> None:
        self._jobs: queue.SimpleQueue[list[Any] | threading.Event] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def retire(self, groups: list[Any]) -> None:
        """Hand over `groups` (the caller must hold no other reference to them: whoever drops the
        last one destroys it). Returns at once."""
        if groups:
            self._jobs.put(groups)

    def drain(self, timeout_s: float) -> bool:
        """Whether everything retired before this call was destroyed within `timeout_s`."""
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        done = threading.Event()
        self._jobs.put(done)
        return done.wait(timeout_s)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if isinstance(job, threading.Event):
                job.set()
            else:
                job.clear()  # the groups' destructors run here
            del job
