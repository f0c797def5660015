"""Per-job time series for the dashboard: step time, samples/s, loss and live workers over time.

The Core keeps only each member's newest step report; the dashboard's charts need history, so
the leader samples every job once a second into a bounded ring (an hour by default). Longer
history belongs to Prometheus (deploy/grafana): this is what an operator sees at a glance, and
it starts empty on a Core that just took over.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from core_service.jobs import Job

SAMPLE_INTERVAL_S = 1.0
SAMPLES_KEPT = 3600
# A step report older than this many median step times (and at least STALE_MIN_S) says nothing
# about the job's current speed: during a recovery the charts show a gap, not the last value.
STALE_STEPS = 3.0
STALE_MIN_S = 5.0
# Samples at a job's full size whose median is its LSE reference (a minute at one a second).
REFERENCE_SAMPLES = 60


@dataclass(frozen=True)
class JobSample:
    """One point of a job's history; step values are None while no live worker reports steps."""

    time_unix: float
    live_workers: int
    step: int | None
    step_time_s: float | None  # median over live workers' newest steps, seconds
    samples_per_s: float | None  # samples the whole job trains per second
    loss: float | None  # mean of the losses reported (the last stage computes it)
    plan_epoch: int
    # Linear scaling efficiency (ElasWave §6): samples/s over what the job's full size trained,
    # scaled to the live workers; 1.0 keeps every surviving worker as productive as before.
    lse: float | None = None


def sample_job(job: Job, now: float) -> JobSample:
    live = job.live_members()
    reports = [m.last_step for m in live if m.last_step is not None]
    if reports:
        median = statistics.median(r.step_time_s for r in reports)
        stale_after = max(STALE_MIN_S, STALE_STEPS * median)
        reports = [r for r in reports if now - r.received_unix <= stale_after]
    if not reports:
        return JobSample(now, len(live), None, None, None, None, job.plan_epoch)
    step_time = statistics.median(r.step_time_s for r in reports)
    # Every sample passes through every stage: count it once, on the first stage that reported
    # (with no stages reported, every worker is its own data-parallel replica).
    staged = [r for r in reports if r.stage >= 0]
    first_stage = min((r.stage for r in staged), default=-1)
    counted = [r for r in reports if r.stage == first_stage] if staged else reports
    samples = sum(r.samples for r in counted)
    losses = [r.loss for r in reports if r.loss is not None]
    return JobSample(
        time_unix=now,
        live_workers=len(live),
        step=max(r.step for r in reports),
        step_time_s=step_time,
        samples_per_s=samples / step_time if step_time > 0 else None,
        loss=statistics.fmean(losses) if losses else None,
        plan_epoch=job.plan_epoch,
    )


@dataclass
class FullSize:
    """A job's largest live size and its samples/s per worker then: the LSE reference."""

    workers: int = 0
    rates: deque[float] = field(default_factory=lambda: deque(maxlen=REFERENCE_SAMPLES))

    def lse(self, sample: JobSample) -> float | None:
        if sample.samples_per_s is None or not sample.live_workers:
            return None
        if sample.live_workers > self.workers:
            self.workers = sample.live_workers
            self.rates.clear()
        if sample.live_workers == self.workers:
            self.rates.append(sample.samples_per_s / sample.live_workers)
        if not self.rates:
            return None
        expected = statistics.median(self.rates) * sample.live_workers
        return sample.samples_per_s / expected if expected > 0 else None


class JobHistory:
    """The sampled series of every job this Core has led."""

    def __init__(self, kept: int = SAMPLES_KEPT) -> None:
        self.kept = kept
        self.series: dict[str, deque[JobSample]] = {}
        self.full: dict[str, FullSize] = {}

    def sample(self, jobs: dict[str, Job], now: float) -> None:
        for name, job in jobs.items():
            ring = self.series.setdefault(name, deque(maxlen=self.kept))
            point = sample_job(job, now)
            ring.append(replace(point, lse=self.full.setdefault(name, FullSize()).lse(point)))
        for gone in set(self.series) - set(jobs):
            del self.series[gone]
            self.full.pop(gone, None)

    def latest(self, job: str) -> JobSample | None:
        ring = self.series.get(job)
        return ring[-1] if ring else None

    def of(self, job: str, since: float = 0.0) -> list[JobSample]:
        return [s for s in self.series.get(job, ()) if s.time_unix > since]

    def columns(self, job: str, since: float = 0.0) -> dict[str, list[Any]]:
        """The series as columns (what the dashboard's charts plot), oldest first."""
        samples = self.of(job, since)
        names = list(JobSample.__dataclass_fields__)
        rows = [asdict(s) for s in samples]
        return {n: [r[n] for r in rows] for n in names}

    def median_step_time(self, job: str, start: float, stop: float) -> float | None:
        """The median step time sampled in [start, stop): a plan's measured effect."""
        values = [
            s.step_time_s
            for s in self.series.get(job, ())
            if start <= s.time_unix < stop and s.step_time_s is not None
        ]
        return statistics.median(values) if values else None
