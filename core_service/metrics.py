"""Prometheus metrics of the Core. The registry is passed in, so tests and several Cores in one
process never collide."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class CoreMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.agent_reports = Counter(
            "elaswave_agent_reports_total", "Reports received from agents, by kind.", ["kind"],
            registry=registry,
        )
        self.report_seconds = Histogram(
            "elaswave_agent_report_handling_seconds", "Time to handle one agent report, seconds.",
            buckets=LATENCY_BUCKETS, registry=registry,
        )
        self.agent_streams = Gauge(
            "elaswave_agent_streams", "Agent streams connected to this Core.", registry=registry
        )
        self.failures_detected = Counter(
            "elaswave_failures_detected_total", "Workers declared lost or slow, by detection path.",
            ["path"], registry=registry,
        )
        self.detection_gap = Histogram(
            "elaswave_detection_gap_seconds",
            "Seconds between a lost worker's last heartbeat and the moment it was declared lost.",
            buckets=LATENCY_BUCKETS, registry=registry,
        )
        self.members = Gauge(
            "elaswave_members", "Members per job and state.", ["job", "state"], registry=registry
        )
        self.is_leader = Gauge(
            "elaswave_core_is_leader", "1 when this Core is the leader, 0 when standby.", registry=registry
        )
        self.plans_published = Counter(
            "elaswave_plans_published_total", "Plans published, by policy.", ["policy"], registry=registry
        )
        self.plan_seconds = Histogram(
            "elaswave_plan_seconds", "Time to compute one plan, seconds.", buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.apply_seconds = Histogram(
            "elaswave_plan_apply_seconds", "Time from publishing a plan to every executor resuming, seconds.",
            buckets=LATENCY_BUCKETS, registry=registry,
        )
        self.rejected_requests = Counter(
            "elaswave_rejected_requests_total", "Requests refused, by API and reason.", ["api", "reason"],
            registry=registry,
        )
