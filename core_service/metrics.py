"""Prometheus metrics of the Core. The registry is passed in, so tests and several Cores in one
process never collide."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

if TYPE_CHECKING:
    from fastapi import FastAPI, Request, Response

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# HTTP statuses that mean "request refused" and the reason label they count under.
REST_REJECTIONS = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    403: "PERMISSION_DENIED",
    404: "NOT_FOUND",
    405: "METHOD_NOT_ALLOWED",
    409: "FAILED_PRECONDITION",
    413: "PAYLOAD_TOO_LARGE",
    422: "INVALID_ARGUMENT",
    503: "UNAVAILABLE",
}


SERVER_ERROR_APIS = ("rest", "agent", "executor", "scheduler")
DEPARTURE_KINDS = ("preempted", "drained", "finished", "left")
HTTP_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


class CoreMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.agent_reports = Counter(
            "elaswave_agent_reports_total",
            "Reports received from agents, by kind.",
            ["kind"],
            registry=registry,
        )
        self.report_seconds = Histogram(
            "elaswave_agent_report_handling_seconds",
            "Time to handle one agent report, seconds.",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.agent_streams = Gauge(
            "elaswave_agent_streams", "Agent streams connected to this Core.", registry=registry
        )
        self.failures_detected = Counter(
            "elaswave_failures_detected_total",
            "Workers declared lost or slow, by detection path.",
            ["path"],
            registry=registry,
        )
        self.detection_gap = Histogram(
            "elaswave_detection_gap_seconds",
            "Seconds between a lost worker's last heartbeat and the moment it was declared lost.",
            buckets=LATENCY_BUCKETS,
            registry=registry,
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
            "elaswave_plan_seconds",
            "Time to compute one plan, seconds.",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.apply_seconds = Histogram(
            "elaswave_plan_apply_seconds",
            "Time from publishing a plan to every executor resuming, seconds.",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.rejected_requests = Counter(
            "elaswave_rejected_requests_total",
            "Requests (and single agent reports) refused, by API (agent, executor, scheduler, rest) and reason.",
            ["api", "reason"],
            registry=registry,
        )
        self.grpc_seconds = Histogram(
            "elaswave_grpc_server_handling_seconds",
            "Time from receiving a gRPC call to its status, seconds (a stream's whole lifetime for streams).",
            ["service", "method", "code"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.http_seconds = Histogram(
            "elaswave_http_request_duration_seconds",
            "Time to answer one REST request, seconds.",
            ["method", "route", "status"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.loop_lag = Histogram(
            "elaswave_core_loop_lag_seconds",
            "How late each turn of the Core's event loop came (its beat is 0.05 s), seconds; a "
            "stall past 1 s also logs every thread's stack (core_service.loop_watch).",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.watchdog_step_downs = Counter(
            "elaswave_leader_watchdog_step_downs_total",
            "Leader leases given up because the Core's event loop stalled past its bound.",
            registry=registry,
        )
        self.lease_regrants = Counter(
            "elaswave_liveness_lease_regrants_total",
            "Liveness leases the Core held for a connected agent that lapsed (the Core did not "
            "refresh them in time) and were granted again instead of taken as losses.",
            registry=registry,
        )
        self.planning_stopped = Counter(
            "elaswave_planning_stopped_total",
            "Planning calls stopped (their process killed) at their deadline or when the client left.",
            registry=registry,
        )
        self.server_errors = Counter(
            "elaswave_server_errors_total",
            "Requests that failed inside the Core (HTTP 5xx other than 503; gRPC UNKNOWN/INTERNAL), by API.",
            ["api"],
            registry=registry,
        )
        self.departures = Counter(
            "elaswave_departures_total",
            "Workers that left on purpose (preempted, drained, finished, left cleanly), by kind: "
            "departures, never failures (elaswave_failures_detected_total).",
            ["kind"],
            registry=registry,
        )
        # Every label a dashboard or alert reads starts at 0: a series exists before its first event.
        for api in SERVER_ERROR_APIS:
            self.server_errors.labels(api=api)
        for kind in DEPARTURE_KINDS:
            self.departures.labels(kind=kind)
        self.agent_commands = Counter(
            "elaswave_agent_commands_total",
            "Commands queued on agent streams, by command.",
            ["command"],
            registry=registry,
        )
        self.heartbeats_late = Counter(
            "elaswave_heartbeats_late_total",
            "Times a worker's heartbeats went past its adaptive deadline while its stream and lease "
            "were alive: marked late, not lost (docs/failures.md).",
            registry=registry,
        )
        self.members_compacted = Counter(
            "elaswave_members_compacted_total",
            "LOST and LEFT members removed beyond gone_members_kept (their events stay).",
            registry=registry,
        )
        self.registrations_refused = Counter(
            "elaswave_registrations_refused_total",
            "Worker registrations refused because the job token went over its rate limit.",
            registry=registry,
        )


def observe_http(app: FastAPI, metrics: CoreMetrics) -> None:
    """Adds a middleware timing every REST request and counting refused ones (4xx/503) as
    rejections of api="rest". Routes are labelled by their template, so label sets stay bounded."""

    @app.middleware("http")
    async def timed(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        started = time.perf_counter()
        status = 500  # an exception escaping the app is answered with 500: count it as one
        try:
            response = await call_next(request)
            status = response.status_code
        finally:
            route = request.scope.get("route")
            # Label values stay bounded whatever clients send: unknown methods and paths
            # collapse to one value each, statuses are the server's own.
            template = getattr(route, "path", "unmatched") if route is not None else "unmatched"
            method = request.method if request.method in HTTP_METHODS else "other"
            metrics.http_seconds.labels(method=method, route=template, status=str(status)).observe(
                time.perf_counter() - started
            )
            reason = REST_REJECTIONS.get(status)
            if reason is not None:
                metrics.rejected_requests.labels(api="rest", reason=reason).inc()
            if status >= 500 and status != 503:
                metrics.server_errors.labels(api="rest").inc()
        return response
