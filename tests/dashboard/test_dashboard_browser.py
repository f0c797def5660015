"""The dashboard in real headless Chromium against a live Core (ports 0) with real agents.

The page loads with no console error and no request leaving the machine, shows the running
job's members and layout, follows a worker's death over the event stream without reloading,
and refuses an action without the scheduler token (nothing changes). A screenshot is saved
(ELASWAVE_ARTIFACT_DIR, else the test's tmp dir)."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from core_service.policies import scale_table
from planners.layout import layout_to_dict, make_uniform_layout
from tests.core.procs import AgentProcess, CoreProcess, create_job, new_token, wait_until
from tests.dashboard.browser import (
    artifact_dir,
    click,
    console_errors,
    js,
    network_hosts,
    requested_urls,
    text_of,
)

pytestmark = pytest.mark.multiproc

ROOT = Path(__file__).resolve().parents[2]

JOB = "gpt"
SIZED = "llama-34b"  # a job created with a model (no workers): it has a scale table
WAIT_S = 30.0


RUNNING_RGB = [0x2D, 0xA4, 0x4E]  # STATE_COLOURS.RUNNING in app.js


def grid_pixel(page: Any, worker: str) -> list[int]:
    """The colour the grid canvas shows at `worker`'s cell."""
    return list(
        js(
            page,
            f"""const c = window.__elaswave.gridCells.find(c => c.cell[3] === {worker!r});
            const px = document.getElementById('grid').getContext('2d').getImageData(c.x + 1, c.y + 1, 1, 1).data;
            return [px[0], px[1], px[2]];""",
        )
    )


def sized_model() -> dict[str, Any]:
    model = json.loads((ROOT / "planners/examples/llama2-34b-one-node-lost.json").read_text())
    return {**model, "failed_ranks": [], "max_devices": 128}


@pytest.fixture(scope="module")
def cluster(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[CoreProcess, str, list[AgentProcess]]]:
    tmp = tmp_path_factory.mktemp("dashboard")
    token = new_token()
    core = CoreProcess(tmp, "core", "memory://", token)
    core.wait_leader()
    layout = make_uniform_layout(num_layers=4, num_stages=2, dp=2, global_batch=8, num_micro_batches=2)
    job_token = create_job(core, token, JOB, expected_workers=4, layout=layout_to_dict(layout))
    create_job(core, token, SIZED, model=sized_model())
    agents = [
        AgentProcess(tmp, JOB, f"w{r}", core.grpc_address, job_token, rank=r, stage=r // 2, dp_rank=r % 2)
        for r in range(4)
    ]
    try:
        wait_until(
            lambda: list(core.states(JOB).values()).count("RUNNING") == 4, WAIT_S, "four RUNNING workers"
        )
        yield core, token, agents
    finally:
        for agent in agents:
            agent.stop()
        core.stop()


@pytest.mark.timeout(120)
def test_the_dashboard_shows_the_job_follows_a_kill_and_refuses_actions_without_the_token(
    cluster: tuple[CoreProcess, str, list[AgentProcess]], page: Any, tmp_path: Path
) -> None:
    core, _, agents = cluster
    base = f"http://127.0.0.1:{core.http_port}"
    requested_urls(page)
    page.get(f"{base}/#job={JOB}")
    wait_until(
        lambda: js(page, "return window.__elaswave.view && window.__elaswave.view.summary.name"),
        WAIT_S,
        "the job view",
    )

    # The running job: its name, both stages with their members, the 2 x 2 layout grid.
    assert text_of(page, "[data-testid=job-name]") == JOB
    assert JOB in text_of(page, "[data-testid=jobs]")
    grid = js(page, "return window.__elaswave.view.grid")
    assert [s["layers"] for s in grid["stages"]] == [[0, 2], [2, 4]]
    assert [[c[0] for c in s["cells"]] for s in grid["stages"]] == [[0, 1], [2, 3]]
    wait_until(
        lambda: (
            {c[1] for s in js(page, "return window.__elaswave.view.grid").get("stages") for c in s["cells"]}
            == {"RUNNING"}
        ),
        WAIT_S,
        "every rank RUNNING in the grid",
    )
    assert "4 RUNNING" in text_of(page, "[data-testid=job-summary]")
    click(page, "button[data-stage='1']")
    wait_until(
        lambda: js(page, "return document.querySelectorAll('[data-member]').length") == 2,
        WAIT_S,
        "stage 1 listed",
    )
    assert sorted(
        js(page, "return [...document.querySelectorAll('[data-member]')].map(e => e.dataset.member)")
    ) == ["w2", "w3"]
    wait_until(
        lambda: js(
            page,
            "return window.__elaswave.history && window.__elaswave.history.step_time_s.some(v => v != null)",
        ),
        WAIT_S,
        "a step time in the chart's history",
    )
    assert console_errors(page) == []

    # Kill w3's worker process: the agent reports the exit, the page follows without reloading.
    js(page, "window.__notReloaded = true")
    updates = js(page, "return window.__elaswave.updates")
    worker = psutil.Process(agents[3].proc.pid).children(recursive=True)
    assert worker, "the agent of w3 runs its worker"
    for child in worker:
        child.send_signal(signal.SIGKILL)
    wait_until(lambda: "LOST" in text_of(page, "[data-member='w3']"), WAIT_S, "w3 LOST in the member list")
    assert js(page, "return window.__notReloaded") is True
    assert js(page, "return window.__elaswave.updates") > updates
    assert "LOST" in text_of(page, "[data-stage-row='1']")
    assert js(
        page, "return document.querySelector('[data-testid=events] tr[data-kind=worker_lost]') !== null"
    )
    assert core.states(JOB)["w3"] == "LOST"
    # The Core plans rank 3 out; the grid follows the new layout, drawn on its canvas.
    wait_until(
        lambda: [len(s["cells"]) for s in js(page, "return window.__elaswave.view.grid.stages")] == [2, 1],
        WAIT_S,
        "the re-planned layout in the grid",
    )
    assert grid_pixel(page, "w2") == RUNNING_RGB
    assert console_errors(page) == []

    # Actions ask for the token; without it (and with a wrong one) the Core refuses, the page
    # says so, and nothing changes.
    before = [
        e["kind"]
        for e in core.http.get(f"/api/v1/jobs/{JOB}/events", params={"limit": 10000}).json()["events"]
    ]
    click(page, "[data-testid=action-checkpoint]")
    assert js(page, "return document.getElementById('action-dialog').open") is True
    click(page, "[data-testid=action-confirm]")
    wait_until(
        lambda: "refused (401)" in text_of(page, "[data-testid=notice]"), WAIT_S, "a refusal for no token"
    )
    click(page, "button[data-action='drain'][data-worker='w2']")
    page.find_element("css selector", "[data-testid=action-token]").send_keys("not-the-scheduler-token")
    click(page, "[data-testid=action-confirm]")
    wait_until(
        lambda: "refused (403)" in text_of(page, "[data-testid=notice]"),
        WAIT_S,
        "a refusal for a wrong token",
    )
    assert "wrong scheduler token" in text_of(page, "[data-testid=notice]")
    after = [
        e["kind"]
        for e in core.http.get(f"/api/v1/jobs/{JOB}/events", params={"limit": 10000}).json()["events"]
    ]
    assert "checkpoint_requested" not in after and "worker_command" not in after
    assert [k for k in after if k in ("worker_draining",)] == [k for k in before if k in ("worker_draining",)]
    assert core.states(JOB)["w2"] == "RUNNING"
    # The only console errors are the two refused requests themselves.
    errors = console_errors(page)
    assert len(errors) == 2 and all(("401" in e or "403" in e) for e in errors), errors

    # Nothing left the machine: every request the page made went to this Core.
    assert network_hosts(page) == {f"127.0.0.1:{core.http_port}"}
    shot = artifact_dir(tmp_path) / "dashboard.png"
    assert page.save_screenshot(str(shot))
    print(f"dashboard screenshot: {shot}")


@pytest.mark.timeout(60)
def test_api_docs_load_offline(cluster: tuple[CoreProcess, str, list[AgentProcess]], page: Any) -> None:
    """/docs renders Swagger UI from assets the Core ships: no CDN, no console error."""
    core, _, _ = cluster
    requested_urls(page)  # drop what the previous page asked for
    page.get(f"http://127.0.0.1:{core.http_port}/docs")
    wait_until(
        lambda: js(page, "return document.querySelectorAll('.opblock').length") > 5,
        WAIT_S,
        "Swagger UI operations",
    )
    assert "/api/v1/dashboard/stream" in js(page, "return document.body.innerText")
    assert network_hosts(page) == {f"127.0.0.1:{core.http_port}"}
    assert console_errors(page) == []


@pytest.mark.timeout(60)
def test_switching_jobs_shows_the_scale_table_of_a_job_with_a_model(
    cluster: tuple[CoreProcess, str, list[AgentProcess]], page: Any
) -> None:
    core, _, _ = cluster
    page.get(f"http://127.0.0.1:{core.http_port}/#job={JOB}")
    wait_until(
        lambda: js(page, "return window.__elaswave.view && window.__elaswave.view.summary.name") == JOB,
        WAIT_S,
        "the first job",
    )
    click(page, f"[data-job='{SIZED}']")
    wait_until(
        lambda: js(page, "return window.__elaswave.view && window.__elaswave.view.summary.name") == SIZED,
        WAIT_S,
        "the second job, without a reload",
    )
    wait_until(
        lambda: js(page, "return window.__elaswave.view.scale.rows.length") > 0, WAIT_S, "its scale table"
    )
    shown = js(page, "return [...document.querySelectorAll('#scale tr')].map(r => r.cells[0].innerText)")
    job = type("ModelOnly", (), {"name": SIZED, "model_json": json.dumps(sized_model())})()
    assert shown == [str(row["devices"]) for row in scale_table(job)]
    assert "no plan published yet" in text_of(page, "[data-testid=plans]")
    assert console_errors(page) == []


@pytest.mark.timeout(60)
def test_a_core_whose_reads_need_the_token_asks_for_it_before_showing_anything(
    tmp_path: Path, page: Any
) -> None:
    token = new_token()
    core = CoreProcess(tmp_path, "guarded", "memory://", token, extra_env={"ELASWAVE_READ_ACCESS": "token"})
    try:
        core.wait_leader()
        create_job(core, token, "secret")
        page.get(f"http://127.0.0.1:{core.http_port}/")
        wait_until(
            lambda: js(page, "return document.getElementById('action-dialog').open"),
            WAIT_S,
            "the token dialog",
        )
        assert "scheduler token only (401" in text_of(page, "[data-testid=notice]")
        assert text_of(page, "[data-testid=jobs]") == ""  # nothing shown without the token
        page.find_element("css selector", "[data-testid=action-token]").send_keys(token)
        click(page, "[data-testid=action-confirm]")
        wait_until(
            lambda: (
                js(page, "return window.__elaswave.view && window.__elaswave.view.summary.name") == "secret"
            ),
            WAIT_S,
            "the job, once the token is given",
        )
        assert text_of(page, "[data-testid=token-state]") == "token set for this tab"
        errors = console_errors(page)
        assert len(errors) == 1 and "401" in errors[0], errors  # the stream refused without the token
    finally:
        page.get("about:blank")
        core.stop()
