"""The dashboard stays usable with 1,000 members in a job: the page aggregates members per stage,
draws the 8 x 125 layout on one canvas and lists a stage's members virtualised, so its DOM stays
small however large the job (render times are printed; timing bounds belong to benchmarks)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from planners.layout import layout_to_dict, make_uniform_layout
from tests.core.procs import CoreProcess, create_job, new_token, wait_until
from tests.dashboard.browser import (
    artifact_dir,
    click,
    console_errors,
    js,
    network_hosts,
    requested_urls,
    text_of,
)
from tests.dashboard.synthetic import SyntheticMembers

pytestmark = pytest.mark.multiproc

JOB = "big"
STAGES, DP = 8, 125
MEMBERS = STAGES * DP
# Elements the page may hold with every panel open: the newest 150 events (~900), 20 plans, one
# row per stage and the virtualised member list's ~20 rows of ~13 elements. A page that drew
# every member would hold more than 13,000.
MAX_ELEMENTS = 2500


@pytest.fixture(scope="module")
def big_job(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CoreProcess]:
    tmp = tmp_path_factory.mktemp("big")
    token = new_token()
    # Synthetic members send no heartbeats after registering: a long timeout keeps them alive.
    core = CoreProcess(tmp, "core", "memory://", token, heartbeat_timeout_s=300, lease_ttl_s=300)
    core.wait_leader()
    layout = make_uniform_layout(
        num_layers=2 * STAGES, num_stages=STAGES, dp=DP, global_batch=2 * MEMBERS, num_micro_batches=2
    )
    job_token = create_job(core, token, JOB, expected_workers=MEMBERS, layout=layout_to_dict(layout))
    members = SyntheticMembers(core.grpc_address, JOB, job_token, MEMBERS, DP)
    try:
        members.start()
        wait_until(
            lambda: list(core.states(JOB).values()).count("RUNNING") == MEMBERS, 60, "1,000 RUNNING members"
        )
        yield core
    finally:
        members.stop()
        core.stop()


@pytest.mark.timeout(120)
def test_a_thousand_members_render_aggregated_and_virtualised(
    big_job: CoreProcess, page: Any, tmp_path: Path
) -> None:
    core = big_job
    requested_urls(page)
    page.get(f"http://127.0.0.1:{core.http_port}/#job={JOB}")
    wait_until(
        lambda: js(page, "return window.__elaswave.view && window.__elaswave.view.summary.name") == JOB,
        30,
        "the big job's view",
    )
    assert f"{MEMBERS} RUNNING" in text_of(page, "[data-testid=job-summary]")
    grid = js(page, "return window.__elaswave.view.grid")
    assert [len(s["cells"]) for s in grid["stages"]] == [DP] * STAGES
    assert {c[1] for s in grid["stages"] for c in s["cells"]} == {"RUNNING"}
    stage_rows = js(page, "return [...document.querySelectorAll('[data-stage-row]')].map(r => r.innerText)")
    assert len(stage_rows) == STAGES and all(f"{DP} RUNNING" in r for r in stage_rows)

    click(page, "button[data-stage='3']")
    wait_until(lambda: js(page, "return window.__elaswave.members.length") == DP, 30, "stage 3's members")
    shown = js(page, "return [...document.querySelectorAll('[data-member]')].map(e => e.dataset.member)")
    assert 0 < len(shown) < 30 and shown[0] == "m0375"
    js(page, "const s = document.getElementById('members-scroll'); s.scrollTop = s.scrollHeight;")
    wait_until(
        lambda: (
            "m0499"
            in js(page, "return [...document.querySelectorAll('[data-member]')].map(e => e.dataset.member)")
        ),
        10,
        "the last member of stage 3 after scrolling",
    )
    elements = js(page, "return document.getElementsByTagName('*').length")
    assert elements < MAX_ELEMENTS, elements
    updates = js(page, "return window.__elaswave.updates")
    wait_until(lambda: js(page, "return window.__elaswave.updates") > updates + 1, 10, "live updates")
    render_ms = js(page, "return window.__elaswave.renderMs")
    first_view_ms = js(page, "return window.__elaswave.firstViewAt")
    print(
        f"1,000 members: first view {first_view_ms:.0f} ms after navigation, one update renders in {render_ms:.1f} ms, {elements} DOM elements"
    )
    assert network_hosts(page) == {f"127.0.0.1:{core.http_port}"}
    assert console_errors(page) == []
    assert page.save_screenshot(str(artifact_dir(tmp_path) / "dashboard-1000-members.png"))
