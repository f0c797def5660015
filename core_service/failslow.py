"""Fail-slow detection: step-time outliers against stage peers, with hysteresis (docs/architecture.md ("The Core's decisions")).

A worker is *suspect* on a step when its step time exceeds both `ratio x median` and
`median + mad_k x MAD` of its stage peers' latest step times (the peers exclude the worker itself,
so one straggler cannot drag the reference up). It is flagged slow only after `trigger_steps`
consecutive suspect steps and cleared only after `clear_steps` consecutive normal ones, so a single
slow step (a GC pause, a checkpoint) never triggers a plan.

Cost: a report is O(1) amortised, whatever the stage size. Stages of up to `EXACT_PEERS` workers
get the exact reference on every report; larger ones (a stage's DP group can hold thousands)
share a reference over all their workers, recomputed once a sixteenth of them have reported
since (at 10,000 agents the per-report scan of every peer used to saturate the Core). There one
worker is at most 1/64 of the sample, and the reference trails the newest reports by a fraction
of a step, both far below the ratio and MAD margins.
"""

from __future__ import annotations

import statistics
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
        track.stage, track.last_time_s = stage, step_time_s
        times = self._stage_times.setdefault(stage, {})
        times[worker_id] = step_time_s
        if len(times) < self.settings.min_peers:
            return None
        median, mad = self._reference(stage, times, worker_id)
        threshold = max(self.settings.ratio * median, median + self.settings.mad_k * mad)
        suspect = step_time_s > threshold
        return self._update_streaks(worker_id, track, suspect, median, threshold)

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
            reason = f"step time back within {threshold:.3f}s for {track.normal_streak} consecutive steps"
            return SlowTransition(worker_id, False, track.last_time_s, median, reason)
        return None
