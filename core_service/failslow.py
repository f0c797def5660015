"""Fail-slow detection: step-time outliers against stage peers, with hysteresis (DESIGN.md §5).

A worker is *suspect* on a step when its step time exceeds both `ratio x median` and
`median + mad_k x MAD` of its stage peers' latest step times (the peers exclude the worker itself,
so one straggler cannot drag the reference up). It is flagged slow only after `trigger_steps`
consecutive suspect steps and cleared only after `clear_steps` consecutive normal ones, so a single
slow step (a GC pause, a checkpoint) never triggers a plan.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

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


@dataclass
class FailSlowDetector:
    settings: FailSlowSettings
    _tracks: dict[str, _WorkerTrack] = field(default_factory=dict)

    def forget(self, worker_id: str) -> None:
        self._tracks.pop(worker_id, None)

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
        track.stage, track.last_time_s = stage, step_time_s
        peers = [t.last_time_s for w, t in self._tracks.items() if w != worker_id and t.stage == stage]
        if len(peers) + 1 < self.settings.min_peers:
            return None
        median = statistics.median(peers)
        mad = statistics.median(abs(p - median) for p in peers)
        threshold = max(self.settings.ratio * median, median + self.settings.mad_k * mad)
        suspect = step_time_s > threshold
        return self._update_streaks(worker_id, track, suspect, median, threshold)

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
