"""Per-job training gauges for Prometheus, from the dashboard's once-a-second samples: step time,
samples/s, loss, live workers and linear scaling efficiency (LSE, ElasWave §6), labelled by job.

Only the leading Core sets them (a standby's are empty), so `max by (job)` over every Core's
series is the job's value (deploy/grafana/elaswave.json)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge

from core_service.dashboard_history import JobSample


class JobGauges:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.step_time = Gauge(
            "elaswave_job_step_time_seconds",
            "Median step time over the job's live workers' newest steps, seconds.",
            ["job"],
            registry=registry,
        )
        self.samples_rate = Gauge(
            "elaswave_job_samples_per_second",
            "Samples the whole job trains per second.",
            ["job"],
            registry=registry,
        )
        self.loss = Gauge(
            "elaswave_job_loss", "Mean training loss of the newest steps.", ["job"], registry=registry
        )
        self.live_workers = Gauge(
            "elaswave_job_live_workers", "Members of the job not LOST or LEFT.", ["job"], registry=registry
        )
        self.lse = Gauge(
            "elaswave_job_linear_scaling_efficiency_ratio",
            "Samples/s over the job's full-size samples/s per worker times the live workers (1 = linear).",
            ["job"],
            registry=registry,
        )
        self._all = (self.step_time, self.samples_rate, self.loss, self.live_workers, self.lse)

    def publish(self, samples: dict[str, JobSample]) -> None:
        """Sets every job's gauges from its newest sample; a value not known is left out."""
        for gauge in self._all:
            gauge.clear()
        for job, s in samples.items():
            self.live_workers.labels(job=job).set(s.live_workers)
            for gauge, value in (
                (self.step_time, s.step_time_s),
                (self.samples_rate, s.samples_per_s),
                (self.loss, s.loss),
                (self.lse, s.lse),
            ):
                if value is not None:
                    gauge.labels(job=job).set(value)

    def clear(self) -> None:
        for gauge in self._all:
            gauge.clear()
