"""Fail-slow detection: step-time outliers against stage peers, with hysteresis (docs/architecture.md ("The Core's decisions")).

A worker is *suspect* on a step when its step time exceeds both `ratio x median` and
`median + mad_k x MAD` of its stage peers' reference times (the peers exclude the worker itself,
so one straggler cannot drag the reference up). A peer's reference time is its median over its
last `window_steps` steps, so one peer's noisy step does not make everyone else look slow. A
worker is flagged slow only after `trigger_steps` consecutive suspect steps; once flagged it counts
as slow until its step time is back within `clear_ratio x median` (a margin below the trigger
ratio) for `clear_steps` consecutive steps. So a single slow step (a GC pause, a checkpoint) never
triggers a plan, and a worker hovering around the threshold does not flip back and forth (issue 27:
40 plans in 600 fault-free steps without this margin and window).

Cost: a report is O(1) amortised, whatever the stage size. Stages of up to `EXACT_PEERS` workers
get the exact reference on every report; larger ones (a stage's DP group can hold thousands)
share a reference over all their workers, recomputed once a sixteenth of them have reported
since (at 10,000 agents the per-report scan of every peer used to saturate the Core). There one
worker is at most 1/64 of the sample, and the reference trails the newest reports by a fraction
of a step, both far below the ratio and MAD margins.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from core_service.config import FailSlowSettings


@dataclass(frozen=True)
class SlowTransition:
    worker_id: str
    slow: bool  # True: became slow; False: recovered
    step_time_s: float
    peer_median_s: float
    reason: str


@dataclass
class _WorkerTrack:
    stage: int
    last_time_s: float
    recent: deque[float] = field(default_factory=deque)  # the last window_steps step times
    suspect_streak: int = 0
    normal_streak: int = 0
    slow: bool = False


EXACT_PEERS = 64
REFRESH_FRACTION = 16  # a large stage's reference is recomputed after size / 16 reports


@dataclass
class _StageReference:
    """Median and MAD of a large stage's latest step times, and reports seen since."""

    median: float = 0.0
    mad: float = 0.0
    stale_after: int = 0  # reports left before a recompute (0: recompute now)


@dataclass
class FailSlowDetector:
    settings: FailSlowSettings
    _tracks: dict[str, _WorkerTrack] = field(default_factory=dict)
    _stage_times: dict[int, dict[str, float]] = field(default_factory=dict)  # stage -> worker -> last s
    _references: dict[int, _StageReference] = field(default_factory=dict)

    def forget(self, worker_id: str) -> None:
        track = self._tracks.pop(worker_id, None)
        if track is not None:
            self._stage_times.get(track.stage, {}).pop(worker_id, None)

    def is_slow(self, worker_id: str) -> bool:
        track = self._tracks.get(worker_id)
        return bool(track and track.slow)

    def observe(self, worker_id: str, stage: int, step_time_s: float) -> SlowTransition | None:
        """Records one step time; returns a transition when the worker's verdict changes."""
        if step_time_s < 0 or step_time_s != step_time_s:
            raise ValueError(f"step_time_s must be a non-negative number, got {step_time_s!r}")
        track = self._tracks.get(worker_id)
        if track is None:
            track = self._tracks[worker_id] = _WorkerTrack(stage=stage, last_time_s=step_time_s)
        elif track.stage != stage:
            self._stage_times.get(track.stage, {}).pop(worker_id, None)
            track.recent.clear()  # another stage, other work: its old times say nothing now
        track.stage, track.last_time_s = stage, step_time_s
        track.recent.append(step_time_s)
        while len(track.recent) > self.settings.window_steps:
            track.recent.popleft()
        times = self._stage_times.setdefault(stage, {})
        times[worker_id] = statistics.median(track.recent) if len(track.recent) > 1 else step_time_s
        if len(times) < self.settings.min_peers:
            return None
        median, mad = self._reference(stage, times, worker_id)
        threshold = max(self.settings.ratio * median, median + self.settings.mad_k * mad)
        if track.slow:  # the margin: back to normal only well below the trigger threshold
            normal = step_time_s <= min(self.settings.clear_ratio, self.settings.ratio) * median
            return self._update_streaks(worker_id, track, not normal, median, threshold)
        return self._update_streaks(worker_id, track, step_time_s > threshold, median, threshold)

    def _reference(self, stage: int, times: dict[str, float], worker_id: str) -> tuple[float, float]:
        """(median, MAD) of the stage's latest step times: exact and without the worker itself in
        small stages, shared and refreshed every size / REFRESH_FRACTION reports in large ones."""
        if len(times) <= EXACT_PEERS:
            peers = [t for w, t in times.items() if w != worker_id]
            median = statistics.median(peers)
            return median, statistics.median(abs(p - median) for p in peers)
        ref = self._references.setdefault(stage, _StageReference())
        if ref.stale_after <= 0:
            values = np.fromiter(times.values(), dtype=np.float64, count=len(times))
            ref.median = float(np.median(values))
            ref.mad = float(np.median(np.abs(values - ref.median)))
            ref.stale_after = len(times) // REFRESH_FRACTION
        ref.stale_after -= 1
        return ref.median, ref.mad

    def _update_streaks(
        self, worker_id: str, track: _WorkerTrack, suspect: bool, median: float, threshold: float
    ) -> SlowTransition | None:
        if suspect:
            track.suspect_streak, track.normal_streak = track.suspect_streak + 1, 0
        else:
            track.suspect_streak, track.normal_streak = 0, track.normal_streak + 1
        if not track.slow and track.suspect_streak >= self.settings.trigger_steps:
            track.slow = True
            reason = (
                f"step time {track.last_time_s:.3f}s above {threshold:.3f}s (peer median {median:.3f}s) "
                f"for {track.suspect_streak} consecutive steps"
            )
            return SlowTransition(worker_id, True, track.last_time_s, median, reason)
        if track.slow and track.normal_streak >= self.settings.clear_steps:
            track.slow = False
            back = min(self.settings.clear_ratio, self.settings.ratio) * median
            reason = f"step time back within {back:.3f}s for {track.normal_streak} consecutive steps"
            return SlowTransition(worker_id, False, track.last_time_s, median, reason)
        return None
