"""Waiting for ops without a future (gloo's point-to-point works) off the caller's thread.

A gloo send or receive has no future to call back and reports `is_completed()` only once
`wait()` has returned, so the only way to learn that it finished is to block in `wait()`. The
caller must not block there: it polls for an abort flagged by another survivor and for its
deadline while it waits (`Communicator._wait_done`). One helper thread per group blocks instead.

A job is a list of works waited for in order, with one event set when the last has completed (or
the first has failed): a step's all-gather on the host is D - 1 sends and D - 1 receives per
bucket, and handing each work to the thread on its own cost a thread wake-up and an event per
work: the all-gather's wait took 1.0 ms of CPU per worker-step at DP=4 on the 2-core machine, 0.5
ms as one job (docs/benchmarks.md).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class WaitJob:
    """Works waited for in order by a `Waiter`. `completed` counts those that have returned
    from `wait()`; `done` is set once all have, or at the first that raised (in `errors`)."""

    works: Sequence[object]
    done: threading.Event = field(default_factory=threading.Event)
    errors: list[BaseException] = field(default_factory=list)
    completed: int = 0


class Waiter:
    """One daemon thread that blocks in `work.wait()` for each submitted job's works, in order."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[WaitJob] = queue.SimpleQueue()
        threading.Thread(target=self._run, daemon=True, name="op-waiter").start()

    def submit(self, works: Sequence[object]) -> WaitJob:
        """Queue `works` (never blocks); the returned job says when and how they completed."""
        job = WaitJob(list(works))
        self._jobs.put(job)
        return job

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                for work in job.works:
                    work.wait()  # type: ignore[attr-defined]
                    job.completed += 1
            except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
                job.errors.append(exc)
            job.done.set()
