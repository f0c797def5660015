#!/usr/bin/env python3
"""Prints HOST:HTTP_PORT of the Core that leads now, asked through the leader-only Service.

`elaswave run --core HOST:PORT` reaches the job's rendezvous store at HOST on a port the Core
picks, and a Kubernetes Service forwards only its declared ports: the launcher must be given the
leading Core's own address. /healthz of the leader names the host it advertises
(ELASWAVE_ADVERTISE: the pod's DNS name in deploy/helm); the HTTP port is the same on every Core.

usage: find-leader.py SERVICE_HOST:HTTP_PORT [TIMEOUT_S]. Retries until a leader answers. With
$ELASWAVE_CORE_TLS_CA (the Core serves TLS, wire.core_tls) it asks over HTTPS, verifying the Core
with that CA bundle.
"""

from __future__ import annotations

import json
import os
import ssl
import sys
import time
import urllib.request


def leader_address(service: str, timeout_s: float) -> str:
    http_port = service.rpartition(":")[2]
    ca = os.environ.get("ELASWAVE_CORE_TLS_CA")
    context = ssl.create_default_context(cafile=ca) if ca else None
    url = f"{'https' if ca else 'http'}://{service}/healthz"
    deadline = time.monotonic() + timeout_s
    last = "no answer yet"
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=3, context=context) as answer:
                health = json.load(answer)
            if health.get("role") == "leader":
                host = str(health["leader"]).rpartition(":")[0]
                if host and host != "unknown":
                    return f"{host}:{http_port}"
            last = f"{service} answered as {health.get('role')}"
        except (OSError, ValueError, KeyError) as exc:
            last = f"{service}: {exc}"
        time.sleep(2)
    raise SystemExit(f"find-leader: no leading Core within {timeout_s:.0f}s ({last})")


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        raise SystemExit("usage: find-leader.py SERVICE_HOST:HTTP_PORT [TIMEOUT_S]")
    print(leader_address(sys.argv[1], float(sys.argv[2]) if len(sys.argv) == 3 else 300.0))
