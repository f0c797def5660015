"""A step's own compute time, measured so that a busy machine is not mistaken for a straggler.

The Core's fail-slow detector compares each rank's own compute against its stage peers
(docs/architecture.md, "The Core's decisions"). Wall time minus the time blocked on peers is
not enough on a machine whose cores are oversubscribed (4 workers on 2 cores): a rank that the
OS scheduler happens to deschedule for a few milliseconds looks 1.5x slower than its peer on
that step, although its device (here: its CPU work) is not slower at all, and the Core's plans
chased that noise (40 plans in 600 fault-free steps, issue 27).

On the CPU the work a step does is the CPU time of the thread that runs it (the trainer runs
with one intra-op thread, `torch.set_num_threads(1)`): time spent waiting to be scheduled, or
blocked on peers, is no CPU time. A genuinely slower device does more CPU time per step. On an
accelerator CPU time says nothing about the kernels, so there the wall time minus the time
blocked on peers is kept. Either way the result never exceeds that wall figure.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass
class ComputeClock:
    """Start before a step's compute, `stop` after it; `cpu`: the step runs on this thread's CPU."""

    cpu: bool
    _wall0: float = 0.0
    _cpu0: float = 0.0

    def start(self) -> None:
        self._wall0, self._cpu0 = time.perf_counter(), time.thread_time()

    def stop(self, blocked_s: float) -> float:
        """Seconds of own compute since `start`; `blocked_s`: time blocked on peers meanwhile."""
        wall = max(0.0, time.perf_counter() - self._wall0 - blocked_s)
        if not self.cpu:
            return wall
        return min(wall, max(0.0, time.thread_time() - self._cpu0))
