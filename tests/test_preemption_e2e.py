"""A planned departure with the real engine, driven by the Core (docs/architecture.md ("Promises and rules", "The Core's decisions") "Scheduler API", §7).

The demo's job (PP=2 x DP=3 ZeRO-1, one agent + Core-driven worker per rank) is started through
`harness.training`; once every worker committed step k, one worker is preempted, either as a
cluster scheduler would through the Core (REST `POST /api/v1/jobs/{job}/preempt`, scheduler token)
or as Kubernetes/Slurm would (SIGTERM to its agent, which reports a PreemptionNotice). Either way
the Core marks it PREEMPTING and publishes a plan without it; every worker takes the plan at the
next step boundary, the preempted one leaves cleanly (LEFT, never LOST) and the survivors train
every remaining step. The job is checked against the fault-free single-process run like the demo.
"""

from __future__ import annotations

import math
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from harness.control_plane import states
from harness.training import (
    MAX_MEAN_REL_DEV,
    MAX_REL_DEV_BEFORE,
    TrainDemo,
    TrainDemoConfig,
    fault_free_losses,
    job_losses,
    launch_job,
    wait_committed,
    wait_departures,
)

pytestmark = pytest.mark.multiproc

# Stage 1, DP rank 1; more steps than the demo so that plenty are trained after the departure.
CFG = TrainDemoConfig(steps=20, kill_after_step=3, victim_rank=4)
VICTIM = f"rank-{CFG.victim_rank}"
RANKS = list(range(CFG.pp * CFG.dp))


@dataclass(frozen=True)
class Outcome:
    """What a preempted run left behind, read once the job is over."""

    preempted_unix: float
    events: list[dict[str, Any]]
    results: dict[int, dict[str, Any]]
    final: dict[str, str]
    pids_before: dict[str, int]
    pids_after: dict[str, int]
    victim_agent_status: int | None
    fault_free: list[float]  # the same script in one process


def _preempt_through_core(demo: TrainDemo) -> None:
    assert demo.http is not None
    body = {"worker_ids": [VICTIM], "deadline_unix": time.time() + 30, "reason": "spot reclaim (test)"}
    response = demo.http.post(
        "/api/v1/jobs/demo/preempt", json=body, headers={"Authorization": f"Bearer {demo.scheduler_token}"}
    )
    assert response.status_code == 202, response.text


def _sigterm_agent(demo: TrainDemo) -> None:
    demo.agents[CFG.victim_rank].send_signal(signal.SIGTERM)


def _run(tmp_path: Path, preempt: Callable[[TrainDemo], None]) -> Outcome:
    demo = TrainDemo(tmp_path, CFG, timeout_s=90)  # fails with what it waited for, inside the marker
    try:
        launch_job(demo)
        job = wait_committed(demo, CFG.kill_after_step)
        pids_before = {m["worker_id"]: m["pid"] for m in job["members"]}
        preempted_unix = time.time()
        preempt(demo)
        results = demo.wait_results(RANKS)  # the leaving worker writes its results too
        wait_departures(demo, [f"rank-{r}" for r in RANKS])
        job = demo.job()
        assert demo.http is not None
        events = demo.http.get("/api/v1/jobs/demo/events", params={"limit": 10_000}).json()["events"]
        victim_agent = demo.agents[CFG.victim_rank]
        try:
            status: int | None = victim_agent.wait(timeout=10)
        except subprocess.TimeoutExpired:  # reported by the assertion on the status
            status = None
        return Outcome(
            preempted_unix,
            events,
            results,
            states(job),
            pids_before,
            {m["worker_id"]: m["pid"] for m in job["members"]},
            status,
            fault_free_losses(demo),
        )
    finally:
        demo.stop()


def _first(events: list[dict[str, Any]], kind: str, worker: str | None = None) -> dict[str, Any]:
    found = [e for e in events if e["kind"] == kind and (worker is None or e["worker_id"] == worker)]
    assert found, f"no {kind} event{f' for {worker}' if worker else ''} in {[e['kind'] for e in events]}"
    return found[0]


def _check_core_view(out: Outcome) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """PREEMPTING, then one plan, applied by the survivors; the victim LEFT, nobody lost or back."""
    marked = _first(out.events, "worker_preempting", VICTIM)
    published = _first(out.events, "plan_published")
    assert marked["seq"] < published["seq"]
    assert published["data"]["epoch"] == 1
    # One plan for the departure. A later one is allowed only for a straggler the Core saw (on a
    # loaded 2-core machine a worker can be slow for real; the DVFS plan is then right to come).
    slow = [e["seq"] for e in out.events if e["kind"] == "worker_slow"]
    later = [e for e in out.events if e["kind"] == "plan_published" and e["data"]["epoch"] > 1]
    unexplained = [(e["seq"], e["detail"]) for e in later if not any(s < e["seq"] for s in slow)]
    assert not unexplained, (
        unexplained,
        [(e["seq"], e["kind"], e["worker_id"], e["detail"]) for e in out.events],
    )
    survivors = {f"rank-{r}" for r in RANKS if r != CFG.victim_rank}
    for phase in ("applied", "resumed"):
        acked = {
            e["worker_id"] for e in out.events if e["kind"] == f"plan_{phase}" and e["data"]["epoch"] == 1
        }
        assert acked == survivors, (phase, acked)
    # The leaving worker took the plan at the same boundary (received, paused) and did not fail it.
    victim_acks = [
        e["kind"] for e in out.events if e["kind"].startswith("plan_") and e["worker_id"] == VICTIM
    ]
    assert victim_acks == ["plan_received", "plan_paused"], victim_acks
    left = _first(out.events, "worker_left", VICTIM)
    assert left["seq"] > published["seq"] and "exited with code 0" in left["detail"], left
    resumed = [e for e in out.events if e["kind"] == "plan_resumed"][-1]
    assert _first(out.events, "phase_running")["seq"] < published["seq"]  # RUNNING before ...
    # ... and after, once every survivor resumed; the victim's LEFT was planned for, no re-plan.
    # (When the survivors finish the job and leave, the Core plans once more and refuses: no rank left.)
    # (On a loaded machine the survivors' acks, sent on a helper thread, can reach the Core after
    # they have trained the job's last step: the job is then RUNNING again because its work is
    # done, the acks counted above all the same. Seen once in CI, 20 steps being short.)
    after = [e for e in out.events if e["seq"] > published["seq"]]
    running = next(e for e in after if e["kind"] == "phase_running")
    assert running["detail"] in (
        "epoch 1 applied by 5 workers",
        "the job's work is done; waiting for its workers to end",
    ), after
    assert not [
        e for e in after if e["seq"] < running["seq"] and e["kind"] in ("phase_planning", "decision_none")
    ]
    assert not [e for e in out.events if e["kind"] in ("worker_lost", "worker_rejoined", "plan_failed")]
    assert out.final == {f"rank-{r}": "LEFT" for r in RANKS}, out.final
    assert out.victim_agent_status == 0  # the agent ended with a Leave after a clean worker exit
    assert out.pids_after == out.pids_before  # no worker was restarted
    return marked, published, resumed


def groups_holding_the_victim() -> set[str]:
    """Its pipeline links, its stage's DP group and the job-wide group (clipping's norm)."""
    stage = CFG.victim_rank // CFG.dp
    links = {f"link/{min(r, CFG.victim_rank)}-{max(r, CFG.victim_rank)}" for r in range(CFG.pp * CFG.dp)}
    return links | {f"dp/{stage}", "world"}


def _check_training(out: Outcome) -> tuple[int, float]:
    """The victim left at a step boundary; every step trained once, exactly, vs the fault-free run."""
    victim = out.results[CFG.victim_rank]
    left = victim["left_at_step"]
    assert CFG.kill_after_step < left < CFG.steps and victim["committed_steps"] == left
    assert sorted(int(s) for s in victim["samples"]) == list(range(left))  # committed up to the boundary
    for rank, res in out.results.items():
        assert res["checksum_mismatches"] == 0, (rank, res["checksum_mismatches"])
        assert res["verified_steps"], rank  # the backups were checked (the harness: every 2 steps)
        # Only ops abandoned at the departure boundary: because the plan aborted the step in flight
        # (the abort flag, or the plan itself interrupting the wait on this worker), or, when the
        # victim's exit beats the flag to a survivor blocked on it, a broken connection (closed,
        # reset, failed read: gloo words it several ways) in a group that holds the victim.
        # Either way the same rollback.
        for failure in res["failures"]:
            assert failure["step"] == left, (rank, failure)
            prefix = f"peer failure in group '{failure['group']}': "
            aborted = failure["error"].startswith(prefix + "epoch 0 aborted: ") or failure[
                "error"
            ].startswith(prefix + "plan epoch 1 is published")
            victim_closed = failure["group"] in groups_holding_the_victim() and "gloo" in failure["error"]
            assert aborted or victim_closed, (rank, failure)
        if rank != CFG.victim_rank:
            assert res["committed_steps"] == CFG.steps
            assert [(r["step"], r["epoch"]) for r in res["recoveries"]] == [(left, 1)], res["recoveries"]
    ref = out.fault_free
    losses = job_losses(out.results)
    assert sorted(losses) == list(range(CFG.steps))
    for step in range(left):
        assert abs(losses[step] - ref[step]) / abs(ref[step]) <= MAX_REL_DEV_BEFORE, step
    after = range(left, CFG.steps)
    dev = sum(abs(losses[s] - ref[s]) / abs(ref[s]) for s in after) / len(after)
    assert math.isfinite(dev) and dev <= MAX_MEAN_REL_DEV, dev
    _check_samples(out.results)
    return left, dev


def _check_samples(results: dict[int, dict[str, Any]]) -> None:
    """Every sample of every global batch, once per stage: the victim's share before it left.
    A rank's stage is the one it ran that step in (a plan may re-shape the stages)."""
    for step in range(CFG.steps):
        expected = list(range(step * CFG.global_batch, (step + 1) * CFG.global_batch))
        per_stage: dict[int, list[int]] = {}
        for res in results.values():
            stage = res["stage_of_step"].get(str(step))
            if stage is not None:
                per_stage.setdefault(stage, []).extend(res["samples"].get(str(step), []))
        assert sorted(per_stage) == list(range(len(per_stage))) and per_stage, (step, sorted(per_stage))
        for stage, samples in per_stage.items():
            assert sorted(samples) == expected, (step, stage, sorted(samples))


def _report_timings(
    out: Outcome,
    marked: dict[str, Any],
    published: dict[str, Any],
    resumed: dict[str, Any],
    left: int,
    dev: float,
) -> None:
    recs = [r for res in out.results.values() for r in res["recoveries"]]
    print(
        f"\n[preempt] signal -> PREEMPTING {1e3 * (marked['time_unix'] - out.preempted_unix):.0f} ms; "
        f"-> plan published {1e3 * (published['time_unix'] - out.preempted_unix):.0f} ms; "
        f"-> every survivor resumed {1e3 * (resumed['time_unix'] - out.preempted_unix):.0f} ms; "
        f"slowest apply {1e3 * max(r['apply_s'] for r in recs):.0f} ms; victim left before step {left}; "
        f"mean relative loss deviation after it {dev:.1e}"
    )


@pytest.mark.timeout(120)
def test_scheduler_preemption_through_the_core_is_a_clean_departure(tmp_path: Path) -> None:
    out = _run(tmp_path, _preempt_through_core)
    marked, published, resumed = _check_core_view(out)
    assert "scheduler" in marked["detail"]
    left, dev = _check_training(out)
    _report_timings(out, marked, published, resumed, left, dev)


@pytest.mark.timeout(120)
def test_sigterm_of_the_agent_is_a_preemption_report_and_a_clean_departure(tmp_path: Path) -> None:
    out = _run(tmp_path, _sigterm_agent)
    marked, published, resumed = _check_core_view(out)
    assert "sigterm" in marked["detail"]
    left, dev = _check_training(out)
    _report_timings(out, marked, published, resumed, left, dev)
