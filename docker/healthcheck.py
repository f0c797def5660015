#!/usr/bin/env python3
"""Container health checks of the ElasWave images (Docker HEALTHCHECK; Kubernetes uses its own
httpGet probes on /healthz and /readyz, see deploy/helm).

`core`: alive when /healthz answers 200 and the gRPC health service answers at all. A standby
answers NOT_SERVING (it serves no API call until it leads) and is still healthy: leadership is
readiness (/readyz), not liveness. `worker`: alive while the launcher runs at least one agent
(joining the job takes up to the image's start period, during which Docker ignores failures).

Exit 0 healthy, 1 unhealthy (the reason on stderr). Standard library and grpcio only.
"""

from __future__ import annotations

import os
import sys
import urllib.request
from pathlib import Path


def check_core() -> str | None:
    http_port = os.environ.get("ELASWAVE_HTTP_PORT", "8080")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/healthz", timeout=3) as answer:
            if answer.status != 200:
                return f"/healthz answered {answer.status}"
    except OSError as exc:
        return f"/healthz did not answer: {exc}"
    if os.environ.get("ELASWAVE_TLS_CERT"):
        return None  # gRPC speaks TLS only: /healthz is the check
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    grpc_port = os.environ.get("ELASWAVE_GRPC_PORT", "50051")
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        try:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=3)
        except grpc.RpcError as exc:
            return f"gRPC health did not answer: {exc.code().name}"
    return None


def check_worker() -> str | None:
    """Healthy while an agent runs under the container's first process (ELASWAVE_HEALTH_ROOT_PID,
    default 1: docker/preemptible.py, then the launcher, then its agents)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from preemptible import descendants, is_agent

    root = int(os.environ.get("ELASWAVE_HEALTH_ROOT_PID", "1"))
    below = descendants(root)
    if any(is_agent(pid) for pid in below):
        return None
    if below:
        return "the launcher runs no agent (still joining the job, or the job ended)"
    return "no launcher is running"


def main(argv: list[str]) -> int:
    checks = {"core": check_core, "worker": check_worker}
    if len(argv) != 2 or argv[1] not in checks:
        print("usage: healthcheck.py core|worker", file=sys.stderr)
        return 2
    problem = checks[argv[1]]()
    if problem is not None:
        print(f"unhealthy: {problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
