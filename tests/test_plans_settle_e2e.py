"""Plans that settle (issue 27, item 1): no plan churn on a busy machine, a real straggler still planned for.

The GPT example as PP=2 x DP=2 (4 workers, one agent each, under a real Core with gRPC and REST
on port 0) on this 2-core machine: the cores are oversubscribed, so wall-clock compute varies
from rank to rank and step to step for no reason but the OS scheduler. Measured side by side on
the same machine before the fix, 600 such steps made 18 plans (10 `worker_slow` events); the Core
must now make at most 2. Then one worker really computes 3x slower (`ELASWAVE_INJECT_SLOW_FILE`,
executor.slow_injection): the Core must still publish a plan for it within 10 of its steps.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from harness.training import TrainDemo, TrainDemoConfig, launch_job, wait_committed
from wire.worker_env import INJECT_SLOW_FILE_ENV

pytestmark = pytest.mark.multiproc

# 600 steps take about 50 s on the shared 2-core machine (measured: `elaswave run
# --nproc-per-node 4 --pp 2 examples/gpt/train.py --steps 600`, 52 s wall).
FAULT_FREE_STEPS = 600
MOST_PLANS = 2
STRAGGLER_RANK = 1  # stage 0, DP rank 1
SLOWDOWN = 3.0
PLANNED_WITHIN_STEPS = 10


def _events(demo: TrainDemo) -> list[dict[str, Any]]:
    assert demo.http is not None
    return demo.http.get("/api/v1/jobs/demo/events", params={"limit": 10_000}).json()["events"]


def _kinds(events: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [e for e in events if e["kind"] == kind]


@pytest.mark.timeout(240)
def test_a_fault_free_job_on_oversubscribed_cores_makes_at_most_two_plans(tmp_path: Path) -> None:
    cfg = TrainDemoConfig(pp=2, dp=2, steps=FAULT_FREE_STEPS, kill_after_step=0, victim_rank=0, dropout=0.0)
    demo = TrainDemo(tmp_path, cfg, timeout_s=220)
    try:
        launch_job(demo)
        results = demo.wait_results(list(range(4)))
        events = _events(demo)
    finally:
        demo.stop()
    assert all(r["committed_steps"] == FAULT_FREE_STEPS for r in results.values()), results
    plans = _kinds(events, "plan_published")
    assert len(plans) <= MOST_PLANS, [p["detail"] for p in plans]
    # The workers saw the same: the newest plan epoch any of them followed.
    assert max(r["plan_epoch"] for r in results.values()) <= MOST_PLANS


@pytest.mark.timeout(180)
def test_a_real_3x_straggler_is_planned_for_within_10_steps(tmp_path: Path) -> None:
    cfg = TrainDemoConfig(pp=2, dp=2, steps=80, kill_after_step=0, victim_rank=0, dropout=0.0)
    demo = TrainDemo(tmp_path, cfg, timeout_s=160)
    slow_file = tmp_path / "slow.json"
    demo.extra_env[STRAGGLER_RANK] = {INJECT_SLOW_FILE_ENV: str(slow_file)}
    try:
        launch_job(demo)
        wait_committed(demo, 15)
        slow_file.write_text(json.dumps({"slowdown": SLOWDOWN}))
        results = demo.wait_results(list(range(4)))
        events = _events(demo)
    finally:
        demo.stop()
    straggler = results[STRAGGLER_RANK]
    slowed = sorted(int(s) for s, extra in straggler["slowed_s"].items() if extra > 0)
    assert slowed, "the slowdown never took effect"
    flagged = [e for e in _kinds(events, "worker_slow") if e["worker_id"] == f"rank-{STRAGGLER_RANK}"]
    assert flagged, [e["kind"] for e in events]
    plans = [p for p in _kinds(events, "plan_published") if p["seq"] > flagged[0]["seq"]]
    assert plans, [(e["kind"], e["detail"]) for e in events if e["seq"] > flagged[0]["seq"]]
    published = plans[0]["time_unix"]
    committed = straggler["committed_unix"]
    steps_before_plan = [s for s in map(int, committed) if s >= slowed[0] and committed[str(s)] <= published]
    assert len(steps_before_plan) <= PLANNED_WITHIN_STEPS, (slowed[0], steps_before_plan)
    assert "fail-slow" in " ".join(plans[0]["data"]["reasons"])
