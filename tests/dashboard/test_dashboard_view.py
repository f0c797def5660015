"""The dashboard's computations on a hand-built job, compared with values worked out by hand:
members per stage, the layout grid, spares, a plan's MTTR breakdown and predicted vs measured
step time, the history's samples/s and linear scaling efficiency."""

from __future__ import annotations

from collections import deque

import pytest

from core_service.config import FailSlowSettings
from core_service.dashboard_history import JobHistory, JobSample, sample_job
from core_service.dashboard_view import (
    layout_grid,
    members_of_stage,
    plans,
    recent_events,
    spares,
    stage_rows,
)
from core_service.failslow import FailSlowDetector
from core_service.jobs import Job
from core_service.model import Event, MemberRecord, StepReport, WorkerState
from planners.layout import make_uniform_layout

T0 = 1_000.0


def member(rank: int, state: WorkerState, step: int | None = 7, at: float = T0) -> MemberRecord:
    stage, dp = divmod(rank, 2)
    m = MemberRecord(f"w{rank}", f"h{rank}", 100 + rank, state=state, stage=stage, dp_rank=dp, rank=rank)
    m.last_heartbeat_unix = at - 0.5
    m.memory = {
        "device_used_bytes": [rank << 30],
        "device_total_bytes": [8 << 30],
        "worker_rss_bytes": 1 << 30,
    }
    if step is not None:
        loss = 2.0 if stage == 1 else None
        m.last_step = StepReport(step, 0.5 + 0.1 * rank, 0.4, loss, 4, stage, dp, at - 0.2)
    return m


def job_of(*members: MemberRecord) -> Job:
    job = Job("j", "digest", len(members), T0, FailSlowDetector(FailSlowSettings()))
    layout = make_uniform_layout(num_layers=4, num_stages=2, dp=2, global_batch=8, num_micro_batches=2)
    job.layout_json = layout.replace(frequencies_mhz=((0, 1500), (1, 1700))).to_json()
    job.members = {m.worker_id: m for m in members}
    return job


def test_members_per_stage_grid_and_spares() -> None:
    spare = MemberRecord("w9", "h9", 9, state=WorkerState.RUNNING, rank=9)
    job = job_of(
        member(0, WorkerState.RUNNING),
        member(1, WorkerState.RUNNING),
        member(2, WorkerState.LOST),
        member(3, WorkerState.RUNNING),
        spare,
    )
    job.members["w1"].probes = {"device": {"healthy": False, "detail": "xid 79", "at": T0}}
    rows = {r["stage"]: r for r in stage_rows(job, T0)}
    assert rows[0]["by_state"] == {"RUNNING": 2} and rows[0]["unhealthy"] == 1
    assert rows[1]["by_state"] == {"LOST": 1, "RUNNING": 1}
    assert rows[1]["device_used_max_bytes"] == 3 << 30  # the LOST member's memory does not count
    assert (rows[0]["min_step"], rows[0]["max_step"]) == (7, 7) and rows[0][
        "step_time_median_s"
    ] == pytest.approx(0.55)
    assert rows[-1]["members"] == 1  # the spare: no stage in the layout
    listed = members_of_stage(job, 1, T0)
    assert [(m["worker_id"], m["state"], m["last_step"]) for m in listed] == [
        ("w2", "LOST", 7),
        ("w3", "RUNNING", 7),
    ]
    assert members_of_stage(job, 0, T0)[1]["health"] == "unhealthy: device"
    grid = layout_grid(job)
    assert grid is not None
    assert [(s["layers"], s["clock_mhz"]) for s in grid["stages"]] == [([0, 2], [1500, 1700]), ([2, 4], None)]
    assert grid["stages"][1]["cells"] == [[2, "LOST", None, "w2"], [3, "RUNNING", None, "w3"]]
    assert [s["worker_id"] for s in spares(job)] == ["w9"]


def event(seq: int, at: float, kind: str, worker: str = "", **data: object) -> Event:
    return Event(seq, at, "j", kind, worker, "", dict(data))


def test_a_recoverys_mttr_breakdown_and_its_predicted_vs_measured_step_time() -> None:
    job = job_of(member(0, WorkerState.RUNNING), member(1, WorkerState.RUNNING))
    log = [
        event(1, 90.0, "worker_joined", "w0"),
        event(2, 91.0, "decision_none"),  # answered the joins: they do not start the recovery
        event(3, 100.0, "worker_lost", "w3"),
        event(4, 100.2, "plan_published", epoch=1, mode="in_place", policy="elaswave"),
        event(5, 100.3, "plan_paused", "w0", epoch=1),
        event(6, 100.5, "plan_paused", "w1", epoch=1),
        event(7, 101.0, "plan_applied", "w0", epoch=1),
        event(8, 101.1, "plan_applied", "w1", epoch=1),
        event(9, 101.6, "plan_resumed", "w0", epoch=1, steps_lost=2),
        event(10, 101.6, "layout_committed", epoch=1),
        event(11, 101.7, "plan_resumed", "w1", epoch=1),
    ]
    job.events.extend(log)
    history = JobHistory()
    for t, step_time in ((95.0, 0.5), (99.0, 0.5), (102.0, 0.6), (103.0, 0.6), (104.0, 0.7)):
        history.series.setdefault("j", deque()).append(JobSample(t, 2, 1, step_time, 8 / step_time, None, 1))
    (row,) = plans(job, history, {1: 0.62}.get)
    assert row["triggers"] == ["worker_lost w3"] and row["trigger_count"] == 1
    phases = {k: round(v, 6) for k, v in row["phases_s"].items()}
    assert phases == {"plan": 0.2, "pause": 0.3, "apply": 0.6, "resume": 0.5}
    assert round(row["mttr_s"], 6) == 1.6 and row["steps_lost"] == 2
    assert row["predicted_step_time_s"] == 0.62
    assert row["measured_step_time_s"] == 0.6  # median of the samples after the commit
    assert row["step_time_before_s"] == 0.5
    # The events list leaves the per-worker acknowledgements to the plans table.
    assert [e["kind"] for e in recent_events(job)] == [
        "layout_committed",
        "plan_published",
        "worker_lost",
        "decision_none",
        "worker_joined",
    ]


def test_samples_per_second_count_each_sample_once_and_lse_tracks_the_full_size() -> None:
    job = job_of(*(member(r, WorkerState.RUNNING) for r in range(4)))
    first = sample_job(job, T0)
    # Stage 0 (w0, w1) trains 4 + 4 samples a step; the median step time of all four is 0.65 s.
    assert first.step_time_s == pytest.approx(0.65) and first.samples_per_s == pytest.approx(8 / 0.65)
    assert first.loss == 2.0 and first.live_workers == 4 and first.step == 7
    history = JobHistory()
    history.sample({"j": job}, T0)
    assert history.latest("j").lse == pytest.approx(1.0)  # type: ignore[union-attr]
    # One worker of four lost and the job keeps 3/4 of its throughput: linear.
    job.members["w3"].state = WorkerState.LOST
    for m in job.members.values():
        if m.last_step is not None:
            m.last_step.step_time_s = 0.65 * 4 / 3
    history.sample({"j": job}, T0 + 1)
    latest = history.latest("j")
    assert latest is not None and latest.live_workers == 3
    assert abs(latest.lse - 1.0) < 1e-9  # type: ignore[operator]
    # Stale reports (a stalled job) give a gap, not the last value.
    stalled = sample_job(job, T0 + 60)
    assert stalled.step_time_s is None and stalled.samples_per_s is None and stalled.live_workers == 3
