"""Every bad REST input gets a clear 4xx, cheaply; label sets stay bounded; 5xx are counted.

The defects reproduced: NaN/Infinity in a JSON body gave HTTP 500; bodies of any size were read
and parsed before authentication (100 MB without a token: 348 MB of RSS); a 422 echoed the
whole input back; the job token had no maximum length; made-up HTTP methods each became a
metric label value; a 500 was not counted; `Register.host` with a newline forged a log line.
"""

from __future__ import annotations

import contextlib
import json
import logging
import random
import socket
import string
from collections.abc import Iterator

import grpc
import httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from core_service.config import load_settings
from core_service.jobs import Job
from core_service.limits import MAX_BODY_BYTES
from core_service.logfmt import EscapingFormatter
from core_service.metrics import HTTP_METHODS
from tests.core.core_thread import CoreThread
from tests.core.procs import CoreProcess, create_job, new_token
from wire.v1 import agent_pb2, agent_pb2_grpc

pytestmark = pytest.mark.multiproc

MB = 1024 * 1024


@pytest.fixture(scope="module")
def core(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[CoreProcess, str, str]]:
    token = new_token()
    proc = CoreProcess(tmp_path_factory.mktemp("rest"), "rest", "memory://", token)
    proc.wait_leader()
    job_token = create_job(proc, token, "train")
    yield proc, token, job_token
    proc.stop()


def raw_http(port: int, head: str, body: bytes = b"") -> tuple[int, bytes]:
    """One HTTP/1.1 exchange on a raw socket: the status and the response body. The request's
    body may be cut short (the server answers before reading it)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head.encode() + b"\r\n\r\n")
        with contextlib.suppress(OSError):  # the server may answer and close before the body is out
            sock.sendall(body)
        data = b""
        while b"\r\n\r\n" not in data or len(data) < data.find(b"\r\n\r\n") + 4 + _length(data):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    status = int(data.split(b" ", 2)[1])
    return status, data.split(b"\r\n\r\n", 1)[1]


def _length(data: bytes) -> int:
    for line in data.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":")[1])
    return 0


@pytest.mark.timeout(60)
def test_non_finite_numbers_get_422_not_500(core: tuple[CoreProcess, str, str]) -> None:
    proc, token, _ = core
    admin = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    for path, raw in (
        ("/api/v1/jobs/train/preempt", '{"worker_ids": ["w0"], "deadline_unix": NaN}'),
        ("/api/v1/jobs/train/preempt", '{"worker_ids": ["w0"], "deadline_unix": Infinity}'),
        ("/api/v1/jobs", '{"name": "x", "expected_workers": -Infinity}'),
        ("/api/v1/jobs/train/workers/w0/commands", '{"command": "drain", "deadline_unix": NaN}'),
    ):
        response = proc.http.post(path, content=raw, headers=admin)
        assert response.status_code == 422, (path, raw, response.status_code, response.text)
        detail = response.json()["detail"]
        assert isinstance(detail, list) and "not a JSON number" in detail[0]["msg"], detail
    assert proc.metric("elaswave_server_errors_total", api="rest") == 0
    assert proc.http.get("/api/v1/jobs/x").status_code == 404


@pytest.mark.timeout(60)
def test_oversized_bodies_are_refused_before_they_are_read(core: tuple[CoreProcess, str, str]) -> None:
    proc, token, _ = core
    rss_before = psutil.Process(proc.proc.pid).memory_info().rss
    # Declared too large: answered at once, without a token, before a byte of the body is read.
    status, body = raw_http(
        proc.http_port,
        f"POST /api/v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {100 * MB}",
    )
    assert status == 413 and str(MAX_BODY_BYTES) in json.loads(body)["detail"]
    # Streamed without a length: cut off once it passes the bound.
    chunk = b"a" * MB
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(8)) + b"0\r\n\r\n"
    status, _ = raw_http(
        proc.http_port,
        "POST /api/v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked",
        chunked,
    )
    assert status == 413
    # A body within the bound but far too long for its fields: 422 without the input echoed.
    big = {"name": "n" * MB, "token": "t" * 5000}
    anonymous = proc.http.post("/api/v1/jobs", json=big)
    assert anonymous.status_code == 401 and len(anonymous.content) < 200
    response = proc.http.post("/api/v1/jobs", json=big, headers={"Authorization": f"Bearer {token}"})
    assert response.status_code == 422 and len(response.content) < 2_000, len(response.content)
    assert "nnnnnnnnnn" not in response.text
    rss_after = psutil.Process(proc.proc.pid).memory_info().rss
    assert rss_after - rss_before < 40 * MB, (rss_before, rss_after)
    assert proc.metric("elaswave_rejected_requests_total", api="rest", reason="PAYLOAD_TOO_LARGE") == 2


@pytest.mark.timeout(60)
def test_token_and_names_have_maximum_lengths(core: tuple[CoreProcess, str, str]) -> None:
    proc, token, _ = core
    admin = {"Authorization": f"Bearer {token}"}
    too_long = proc.http.post("/api/v1/jobs", json={"name": "long-token", "token": "t" * 1025}, headers=admin)
    assert too_long.status_code == 422 and too_long.json()["detail"][0]["loc"] == ["body", "token"]
    assert proc.http.get("/api/v1/jobs/" + "j" * 64).status_code == 422
    assert proc.http.get("/api/v1/jobs/long-token").status_code == 404


@pytest.mark.timeout(60)
def test_metric_labels_stay_bounded_under_made_up_methods_and_paths(
    core: tuple[CoreProcess, str, str],
) -> None:
    proc, _, _ = core
    rng = random.Random(7)
    for _ in range(60):
        method = "".join(rng.choices(string.ascii_uppercase, k=8))
        path = "/" + "".join(rng.choices(string.ascii_lowercase, k=12))
        status, _ = raw_http(proc.http_port, f"{method} {path} HTTP/1.1\r\nHost: x")
        assert 400 <= status < 500
    families = {f.name: f for f in text_string_to_metric_families(proc.metrics())}
    samples = families["elaswave_http_request_duration_seconds"].samples
    methods = {s.labels["method"] for s in samples}
    routes = {s.labels["route"] for s in samples}
    assert methods <= HTTP_METHODS | {"other"} and "other" in methods, methods
    assert all(r == "unmatched" or r.startswith(("/api/", "/healthz", "/metrics", "/readyz")) for r in routes)
    assert len(proc.metrics()) < 200_000


@pytest.mark.timeout(60)
def test_a_host_with_a_newline_is_refused_and_log_lines_cannot_be_forged(
    core: tuple[CoreProcess, str, str],
) -> None:
    proc, _, job_token = core
    register = agent_pb2.Register(job="train", worker_id="w5", host="h\n2026 INFO forged line")
    with grpc.insecure_channel(proc.grpc_address) as channel:
        call = agent_pb2_grpc.AgentServiceStub(channel).Connect(
            iter([agent_pb2.ConnectRequest(register=register)]),
            metadata=[("authorization", f"Bearer {job_token}")],
            timeout=5,
        )
        with pytest.raises(grpc.RpcError) as err:
            next(call)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "printable" in err.value.details()
    record = logging.LogRecord("x", logging.WARNING, "f", 1, "host=%s", ("a\nb\r\x1b[31m",), None)
    line = EscapingFormatter("%(message)s").format(record)
    assert line == "host=a\\nb\\r\\x1b[31m" and "\n" not in line


@pytest.mark.timeout(60)
def test_a_server_error_is_answered_500_and_counted() -> None:
    core = CoreThread(
        load_settings(dev_mode=True, core_id="faulty", grpc_port=0, http_port=0, scheduler_token="t" * 16)
    )
    try:
        assert core.run(core.core.wait_leader(10), 15)
        job = core.run(_create(core), 10)
        job.layout_json = "{not json"  # a record the Core cannot read: a bug, not the client's fault
        with httpx.Client(base_url=core.http_url, timeout=5) as http:
            assert http.get("/api/v1/jobs/broken").status_code == 500
        registry = core.core.metrics.registry
        assert registry.get_sample_value("elaswave_server_errors_total", {"api": "rest"}) == 1
        count = registry.get_sample_value(
            "elaswave_http_request_duration_seconds_count",
            {"method": "GET", "route": "/api/v1/jobs/{job}", "status": "500"},
        )
        assert count == 1
    finally:
        core.stop()


async def _create(core: CoreThread) -> Job:
    from pydantic import SecretStr

    from core_service.config import JobSpec

    return core.core.table.create_job(JobSpec(name="broken", token=SecretStr("x" * 16)), now=0.0)
