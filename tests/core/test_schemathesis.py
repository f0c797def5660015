"""schemathesis against a live Core: with the scheduler token and without it, every operation of
the REST API answers as its OpenAPI schema says (documented statuses, bodies and content types),
no request gets a 5xx, and the Core is healthy afterwards.

The dashboard's routes (/api/v1/dashboard/...) are left out: they belong to the dashboard's own
tests. Both runs go at once (they mostly wait on the Core), each bounded in examples and time.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.core.procs import CoreProcess, new_token

pytestmark = pytest.mark.multiproc

SCHEMATHESIS = Path(sys.executable).with_name("schemathesis")
RUN_TIMEOUT_S = 120


@pytest.fixture
def core(tmp_path: Path) -> Iterator[tuple[CoreProcess, str]]:
    token = new_token()
    proc = CoreProcess(tmp_path, "schema", "memory://", token)
    proc.wait_leader()
    yield proc, token
    proc.stop()


def schemathesis(proc: CoreProcess, headers: list[str], report: Path) -> subprocess.Popen[bytes]:
    if not SCHEMATHESIS.exists():
        pytest.fail("schemathesis is not installed in the venv (pip install -e '.[dev]')")
    command = [
        str(SCHEMATHESIS),
        "run",
        f"http://127.0.0.1:{proc.http_port}/openapi.json",
        "--checks",
        "all",
        # A well-formed request the Core refuses for what it means (a job that exists, a model
        # that does not parse) is not a schema violation.
        "--exclude-checks",
        "positive_data_acceptance",
        "--exclude-path-regex",
        "^/api/v1/dashboard",
        "--max-examples",
        "10",
        "--seed",
        "1",
        "--request-timeout",
        "15",
        "--no-color",
    ]
    for header in headers:
        command += ["-H", header]
    # Run from the report's folder: schemathesis keeps its example database in ./.schemathesis.
    return subprocess.Popen(command, stdout=report.open("wb"), stderr=subprocess.STDOUT, cwd=report.parent)


@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
def test_the_rest_api_matches_its_schema_with_and_without_the_token(
    core: tuple[CoreProcess, str], tmp_path: Path
) -> None:
    proc, token = core
    runs = {
        "with-token": schemathesis(proc, [f"Authorization: Bearer {token}"], tmp_path / "with-token.txt"),
        "anonymous": schemathesis(proc, [], tmp_path / "anonymous.txt"),
    }
    for name, run in runs.items():
        try:
            code = run.wait(RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            run.kill()
            code = run.wait()
        report = (tmp_path / f"{name}.txt").read_text()
        assert code == 0, f"schemathesis ({name}) found problems:\n{report[-6000:]}"
        assert "passed" in report and "Stateful" in report, report[-2000:]
    assert proc.http.get("/healthz").json()["status"] == "ok"
    assert proc.metric("elaswave_server_errors_total", api="rest") == 0
