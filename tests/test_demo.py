"""`elaswave demo` as the README's first command runs it: every process real, checked end to end.

The demo's story checks itself against a fault-free single-process run and exits non-zero on
any mismatch; these tests hold it to that and read the report it writes (README, "The demo's
report").
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiproc


def _demo(*args: str, timeout_s: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "elaswave.cli", "demo", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        stdin=subprocess.DEVNULL,
    )


# The report's schema (README, "The demo's report"): the keys a reader may rely on.
EVENT_KEYS = {
    "kind",
    "step",
    "policy",
    "phases",
    "mttr_s",
    "predicted_step_s",
    "measured_step_s",
    "lse",
    "ranks",
    "epochs",
    "mode",
    "reasons",
    "dvfs",
    "migration",
    "live_ranks_after",
}
CONSISTENCY_KEYS = {
    "params_equal_after_recovery",
    "max_param_abs_diff",
    "loss_rel_dev_mean",
    "samples_identical",
}
PHASES = {"detect_s", "plan_s", "communicator_s", "state_s", "replay_s"}


# The demo's own deadline (240 s, its default) comes first, then its bounded teardown (~20 s),
# so a slow or stuck run fails with the demo's diagnosis, not the subprocess killed blind.
@pytest.mark.timeout(330)
def test_demo_story_recovers_every_event_in_place_and_reports_it(tmp_path: Path) -> None:
    run = _demo("--out", str(tmp_path), "--timeout", "240", timeout_s=300)
    out = run.stdout
    assert run.returncode == 0, out[-4000:] + run.stderr[-4000:]
    assert "CHECK FAILED" not in out and "[demo] checks passed" in out
    report = json.loads((tmp_path / "report.json").read_text())
    assert (tmp_path / "demo.png").stat().st_size > 10_000
    assert report["restarts"] == 0 and report["problems"] == []
    c = report["consistency"]
    assert set(c) >= CONSISTENCY_KEYS
    assert c["params_equal_after_recovery"] is True and c["samples_identical"] is True
    assert 0 <= c["max_param_abs_diff"] <= 1e-3  # fp32 round-off over the steps, never a divergence
    assert 0 <= c["loss_rel_dev_mean"] <= 1e-4
    # One event per kind, the join last: spares taken in, the layout back to the fault-free one.
    kinds = [e["kind"] for e in report["events"]]
    assert kinds == ["kill", "straggler", "preempt", "node", "join"], kinds
    assert not report["pending"]
    steps = [e["step"] for e in report["events"]]
    assert steps == sorted(steps) and len(set(steps)) == len(steps), steps
    for e in report["events"]:
        assert set(e) >= EVENT_KEYS, (e["kind"], EVENT_KEYS - set(e))
        assert e["policy"] == "elaswave" and e["mode"] == "in_place", e
        # a join has nothing to detect: its spares start, and the Core plans them in once ready
        assert set(e["phases"]) == (PHASES - {"detect_s"} | {"start_s"} if e["kind"] == "join" else PHASES), (
            e["phases"]
        )
        assert 0 < e["mttr_s"] < 30 and abs(sum(e["phases"].values()) - e["mttr_s"]) < 1e-6, e
        assert e["predicted_step_s"] > 0 and e["measured_step_s"] > 0 and e["lse"] > 0, e
    by_kind = {e["kind"]: e for e in report["events"]}
    assert by_kind["kill"]["live_ranks_after"] == 5 and by_kind["node"]["live_ranks_after"] == 2
    assert by_kind["preempt"]["live_ranks_after"] == 4
    # The straggler: flagged by the Core, rebalanced by Algorithm 1, judged by the DVFS planner.
    straggler = by_kind["straggler"]
    assert straggler["live_ranks_after"] == 5 and "simulated" in straggler["clock_controller"]
    assert straggler["migration"] and straggler["dvfs"], straggler["reasons"]
    thr = report["throughput"]
    assert thr["healthy_samples_per_s"] > 0
    assert [r["kind"] for r in thr["per_event"]] == [e["kind"] for e in report["events"]]
    assert all(r["before_samples_per_s"] > 0 and r["after_samples_per_s"] > 0 for r in thr["per_event"])
    assert re.search(r"^\[demo\] event +step policy", out, flags=re.MULTILINE)


@pytest.mark.timeout(120)
def test_control_plane_demo_sees_the_killed_worker_leave() -> None:
    run = _demo("--control-plane", "--timeout", "90", timeout_s=110)
    out = run.stdout
    assert run.returncode == 0, out[-4000:] + run.stderr[-4000:]
    assert re.search(r"Core marked worker-2 LOST after \d+ ms: worker process killed by signal 9", out), out
    assert "'worker-2': 'LOST'" in out and out.count("'RUNNING'") >= 2


def test_demo_refuses_a_configuration_it_cannot_run() -> None:
    run = _demo("--dp", "2", timeout_s=60)
    assert run.returncode == 2
    assert "needs PP >= 2 and DP >= 3" in run.stderr
