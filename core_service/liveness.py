"""Adaptive heartbeat deadlines: a phi-accrual failure detector per agent stream.

A fixed heartbeat timeout cannot tell a dead agent from one whose heartbeats are late because
its machine is loaded: at load average 8 the gaps between heartbeats stretch and jitter, and a
timeout tight enough to find a hung agent quickly declares healthy ones LOST. Following
Hayashibara et al., "The phi accrual failure detector" (SRDS 2004), each stream keeps a window
of its observed inter-arrival times and models them as a normal distribution; a silence of `t`
seconds has suspicion phi(t) = -log10(P(next gap > t)). The stream's deadline is the silence at
which phi reaches the configured threshold, clamped to [floor, ceiling]: a steady stream gets
the floor (`heartbeat_timeout_s`), a jittery one a later deadline, never beyond the ceiling.

The deadline only decides when a worker is *late*: membership marks a late worker whose stream
and lease are alive with a note, never LOST (docs/failures.md, "Detection paths").
"""

from __future__ import annotations

import math
import statistics
from collections import deque

# Below this many gaps the estimate is noise: the stream gets the floor.
MIN_SAMPLES = 4
# The standard deviation is floored at this fraction of the mean gap (and MIN_STDEV_S): a
# perfectly regular stream would otherwise get a deadline one gap long, and the first scheduling
# hiccup of a loaded machine would make it late.
MIN_STDEV_FRACTION = 0.25
MIN_STDEV_S = 0.05


class ArrivalWindow:
    """The last `window` gaps between heartbeats of one stream and the deadline they imply."""

    __slots__ = ("_gaps", "_last", "_sum", "_sum_sq", "floor_s", "ceiling_s", "phi")

    def __init__(self, *, floor_s: float, ceiling_s: float, phi: float, window: int, start: float) -> None:
        if not 0.0 < floor_s <= ceiling_s:
            raise ValueError(f"heartbeat floor {floor_s} s must be > 0 and <= the ceiling {ceiling_s} s")
        if phi <= 0.0 or window < MIN_SAMPLES:
            raise ValueError(f"phi {phi} must be > 0 and window {window} >= {MIN_SAMPLES}")
        self.floor_s, self.ceiling_s, self.phi = floor_s, ceiling_s, phi
        self._gaps: deque[float] = deque(maxlen=window)
        self._last = start
        # Running sums make `deadline_s` O(1): the sweep asks for it once per member and tick.
        self._sum = 0.0
        self._sum_sq = 0.0

    @property
    def samples(self) -> int:
        return len(self._gaps)

    def record(self, now: float) -> None:
        """A heartbeat arrived at `now` (seconds on the Core's clock)."""
        gap = max(0.0, now - self._last)
        self._last = now
        if len(self._gaps) == self._gaps.maxlen:
            old = self._gaps[0]
            self._sum -= old
            self._sum_sq -= old * old
        self._gaps.append(gap)
        self._sum += gap
        self._sum_sq += gap * gap

    def _distribution(self) -> statistics.NormalDist | None:
        n = len(self._gaps)
        if n < MIN_SAMPLES:
            return None
        mean = self._sum / n
        variance = max(0.0, self._sum_sq / n - mean * mean)
        stdev = max(math.sqrt(variance), mean * MIN_STDEV_FRACTION, MIN_STDEV_S)
        return statistics.NormalDist(mean, stdev)

    def deadline_s(self) -> float:
        """Seconds of silence after the last heartbeat at which the stream is late."""
        dist = self._distribution()
        if dist is None:
            return self.floor_s
        # phi(t) = -log10(1 - F(t)) = threshold  <=>  t = F^-1(1 - 10^-threshold).
        tail = 10.0**-self.phi
        t = dist.inv_cdf(1.0 - tail) if tail > 1e-15 else dist.mean + 8.0 * dist.stdev
        return min(self.ceiling_s, max(self.floor_s, t))

    def suspicion(self, silence_s: float) -> float:
        """phi of a silence of `silence_s` seconds (0 without enough samples; capped at 100)."""
        dist = self._distribution()
        if dist is None:
            return 0.0
        survival = 1.0 - dist.cdf(silence_s)
        return 100.0 if survival <= 1e-100 else min(100.0, -math.log10(survival))
