"""Docs as built (issue 27, item 7): every route the Core serves is documented, every file a
proto or a doc names exists, errors are what the docs say, counters exist before their first event.

A real Core process (gRPC and REST on port 0) serves `/openapi.json` and answers the requests.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.core.procs import CoreProcess, create_job, new_token

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted((ROOT / "docs").glob("*.md"))
PROTOS = sorted((ROOT / "proto" / "wire" / "v1").glob("*.proto"))
METHODS = ("get", "post", "put", "patch", "delete")
# A repository path: directories then a file with a known extension (not part of a longer word).
FILE_REF = re.compile(
    r"(?<![\w./<-])((?:[A-Za-z_][\w.-]*/)+[\w.-]+\.(?:py|md|proto|json|yaml|yml|toml|sh|txt|js|html|css))\b"
)
TOP_DIRS = {p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith(".")}


@pytest.fixture(scope="module")
def core(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[CoreProcess, str]]:
    token = new_token()
    proc = CoreProcess(tmp_path_factory.mktemp("docs"), "core", "memory://", token)
    proc.wait_leader()
    yield proc, token
    proc.stop()


@pytest.mark.multiproc
@pytest.mark.timeout(60)
def test_every_route_in_openapi_is_documented_in_docs(core: tuple[CoreProcess, str]) -> None:
    proc, _ = core
    schema = proc.http.get("/openapi.json").json()
    text = "\n".join(doc.read_text() for doc in DOCS)
    routes = [(m.upper(), path) for path, ops in schema["paths"].items() for m in ops if m in METHODS]
    assert len(routes) >= 15, routes
    missing = [f"{m} {p}" for m, p in routes if f"`{m} {p}" not in text and not _listed_together(text, m, p)]
    assert not missing, f"routes served but not documented in docs/*.md: {missing}"


def _listed_together(text: str, method: str, path: str) -> bool:
    """`GET /healthz`, `GET /metrics` style lists count as documenting each route."""
    return re.search(rf"`{method} [^`]*`, `{method} {re.escape(path)}`", text) is not None


def test_every_file_a_proto_names_exists() -> None:
    # The docs' own links and named files are checked by tests/docs/test_docs.py.
    assert PROTOS, "no .proto files found: the path above is stale"
    missing = []
    for source in PROTOS:
        text = source.read_text()
        for match in FILE_REF.finditer(text):
            ref = match.group(1)
            if ref.split("/")[0] not in TOP_DIRS:
                continue  # not a repository path (a run directory, a URL's path)
            if not ((ROOT / ref).exists() or (ROOT / "proto" / ref).exists()):  # protos import from proto/
                missing.append(f"{source.relative_to(ROOT)}: {ref}")
        for name in re.findall(r"\b[A-Z]+\.md\b", text):
            if not (ROOT / name).exists():
                missing.append(f"{source.relative_to(ROOT)}: {name}")
    assert not missing, missing


@pytest.mark.multiproc
@pytest.mark.timeout(60)
def test_errors_are_as_documented(core: tuple[CoreProcess, str]) -> None:
    proc, token = core
    admin = {"Authorization": f"Bearer {token}"}
    create_job(proc, token, "docs-job")
    # A name that cannot be a job is 422 (before any lookup); a well-formed unknown one 404.
    for bad in ("bad%20name", "-leading-dash", "x" * 64):
        answer = proc.http.get(f"/api/v1/jobs/{bad}")
        assert answer.status_code == 422, (bad, answer.text)
    assert proc.http.get("/api/v1/jobs/no-such-job").status_code == 404
    # An unknown worker in a REST preempt is NOT_FOUND (404), with a plain detail.
    body = {"worker_ids": ["ghost"], "deadline_unix": time.time() + 30, "reason": "test"}
    ghost = proc.http.post("/api/v1/jobs/docs-job/preempt", json=body, headers=admin)
    assert ghost.status_code == 404 and ghost.json()["detail"] == "job 'docs-job' has no worker 'ghost'"
    # A message names the field and its bound, never the value sent.
    past = proc.http.post(
        "/api/v1/jobs/docs-job/preempt", json={**body, "deadline_unix": -5.0}, headers=admin
    )
    assert past.status_code == 422 and "-5" not in past.text, past.text


@pytest.mark.multiproc
@pytest.mark.timeout(60)
def test_error_and_departure_counters_start_at_zero(core: tuple[CoreProcess, str]) -> None:
    proc, _ = core
    text = proc.http.get("/metrics").text
    for api in ("rest", "agent", "executor", "scheduler"):
        assert f'elaswave_server_errors_total{{api="{api}"}} 0.0' in text, api
    for kind in ("preempted", "drained", "finished", "left"):
        assert f'elaswave_departures_total{{kind="{kind}"}} 0.0' in text, kind
